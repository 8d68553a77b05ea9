"""Offline validation of deploy/: every kustomization renders (tests/deploy/kustomize_lite.py,
and the real kustomize wherever a binary is on PATH), kubernetes-validate --strict accepts every
built-in kind, KubeRay documents match the KubeRay CRD schemas, the `ray up` config matches the
schema inside the Ray wheel, and the properties no schema checks hold (restricted security
context, NetworkPolicy, grpc probes, GPUs, /dev/shm, flags the CLI accepts). Every check is also
shown a broken copy that it must reject."""

from __future__ import annotations

import copy
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy import manifest_checks as mc
from tests.deploy.kustomize_lite import KustomizeError, build, object_id

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu-demo": K8S / "overlays" / "cpu-demo", "gpu": K8S / "overlays" / "gpu",
                  "kuberay": K8S / "kuberay"}
OVERLAYS = ("cpu-demo", "gpu")
# the oldest Kubernetes supported here (grpc probes are GA since 1.27) and the newest schemas bundled
K8S_VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
CRD_DIR = REPO.parent / "shared" / "data" / "kuberay-crds"
ENGINE_PORTS = {"router": 50051, "verifier": 50052, "drafter": 50053}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: build(path) for name, path in KUSTOMIZATIONS.items()}


def _deployments(objects) -> dict[str, dict]:
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objects if o["kind"] == "Deployment"}


def _container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


# ------------------------------------------------------------------------------ kustomize renders

@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_kustomization_renders(rendered, name):
    kinds = sorted({o["kind"] for o in rendered[name]})
    if name == "kuberay":
        assert kinds == ["RayCluster", "RayJob", "Service"]
    else:
        assert {"Deployment", "Service", "NetworkPolicy", "PodDisruptionBudget"} <= set(kinds)
        assert set(_deployments(rendered[name])) == {"router", "verifier", "drafter"}
    if name != "base":
        assert {o["metadata"].get("namespace") for o in rendered[name] if o["kind"] != "Namespace"} == {
            yaml.safe_load((KUSTOMIZATIONS[name] / "kustomization.yaml").read_text())["namespace"]}


def _real_kustomize() -> list[str] | None:
    """A kustomize >= v4 command (`patches` and target regexes), or None."""
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        out = subprocess.run(["kubectl", "version", "--client"], capture_output=True, text=True).stdout
        version = next((line.split()[-1] for line in out.splitlines() if line.startswith("Kustomize Version")), "v0")
        if int(version.lstrip("v").split(".")[0] or 0) >= 4:
            return ["kubectl", "kustomize"]
    return None


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_real_kustomize_renders_the_same_objects(rendered, name):
    cmd = _real_kustomize()
    if cmd is None:
        pytest.skip("no kustomize >= v4 on PATH (kubectl or kustomize; neither is on PyPI): the overlays were "
                    "rendered by tests/deploy/kustomize_lite.py alone")
    out = subprocess.run(cmd + [str(KUSTOMIZATIONS[name])], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    real = {object_id(o): o for o in yaml.safe_load_all(out.stdout) if o}
    assert real == {object_id(o): o for o in rendered[name]}


def test_renderer_fails_loudly_on_broken_kustomizations(tmp_path):
    overlay = tmp_path / "k8s"
    shutil.copytree(K8S, overlay)
    gpu = overlay / "overlays" / "gpu" / "kustomization.yaml"
    good = gpu.read_text()
    for broken, message in [
        (good.replace("- ../../base", "- ../../bsae"), "not a local file or directory"),
        (good.replace("spectandem-(drafter|verifier)", "spectandem-engine"), "matches no object"),
        (good + "commonLabels:\n  team: x\n", "not supported"),
        (good.replace("- namespace.yaml", "- namespace.yaml\n  - ../../base/pdb.yaml"), "defined twice"),
    ]:
        gpu.write_text(broken)
        with pytest.raises(KustomizeError, match=message):
            build(gpu.parent)
    gpu.write_text(good)
    assert build(gpu.parent)


# ---------------------------------------------------------------- kubernetes-validate --strict

def _builtin(objects):
    return [o for o in objects if not o["apiVersion"].startswith("ray.io/")]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_builtin_kinds_pass_kubernetes_validate_strict(rendered, name, version):
    docs = _builtin(rendered[name])
    # KubeRay's pod templates are core PodTemplateSpecs: validate them strictly as well.
    docs += [{"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "t"}, "template": t}
             for _, t in mc.pod_templates(rendered[name]) if name == "kuberay"]
    assert docs
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)   # SchemaNotFoundError fails too


def test_kubernetes_validate_cli_strict(rendered, tmp_path):
    path = tmp_path / "gpu.yaml"
    path.write_text(yaml.safe_dump_all(rendered["gpu"]))
    out = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "-k", K8S_VERSIONS[0], str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "WARN" not in out.stdout + out.stderr, out.stdout + out.stderr
    assert out.stdout.count("passed") == len(rendered["gpu"])


def test_strict_validation_rejects_broken_copies(rendered):
    verifier = _deployments(rendered["gpu"])["verifier"]
    for path, mutate in [
        ("readinesProbe", lambda c: c.update(readinesProbe=c.pop("readinessProbe"))),   # a typo'd field
        ("grpc port as a name", lambda c: c["startupProbe"]["grpc"].update(port="grpc")),  # grpc wants a number
        ("limits as a list", lambda c: c["resources"].update(limits=[{"nvidia.com/gpu": 1}])),
    ]:
        broken = copy.deepcopy(verifier)
        mutate(_container(broken))
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


# ------------------------------------------------------------------------ KubeRay CRD schemas

def _strict(schema):
    """An API server prunes unknown fields; make them errors instead: objects with properties and
    no x-kubernetes-preserve-unknown-fields get additionalProperties: false."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def crd_validators():
    if not CRD_DIR.is_dir():
        pytest.skip(f"the KubeRay CRD schemas are not here: {CRD_DIR} is absent (they live outside the project, "
                    "in ../shared/data/kuberay-crds beside the repository; CI has them)")
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    validators = {}
    for path in sorted(CRD_DIR.glob("ray.io_*.yaml")):
        crd = yaml.load(path.read_text(), Loader=loader)
        for version in crd["spec"]["versions"]:
            schema = _strict(version["schema"]["openAPIV3Schema"])
            validators[(f"ray.io/{version['name']}", crd["spec"]["names"]["kind"])] = jsonschema.Draft7Validator(schema)
    return validators


def _crd_errors(validators, doc) -> list[str]:
    validator = validators[(doc["apiVersion"], doc["kind"])]
    return [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]


def test_kuberay_documents_match_the_crd_schemas(rendered, crd_validators):
    ray_docs = [o for o in rendered["kuberay"] if o["apiVersion"].startswith("ray.io/")]
    assert {o["kind"] for o in ray_docs} == {"RayCluster", "RayJob"}
    for doc in ray_docs:
        assert _crd_errors(crd_validators, doc) == [], doc["kind"]


def test_crd_schemas_reject_broken_copies(rendered, crd_validators):
    cluster = next(o for o in rendered["kuberay"] if o["kind"] == "RayCluster")
    for mutate in [
        lambda s: s.update(workerGroupSpec=s.pop("workerGroupSpecs")),                # renamed field
        lambda s: s["workerGroupSpecs"][0]["rayStartParams"].update({"num-gpus": 2}),  # values are strings
        lambda s: s["headGroupSpec"]["template"]["spec"]["containers"][0].update(imagePullPolicy=["Always"]),
    ]:
        broken = copy.deepcopy(cluster)
        mutate(broken["spec"])
        assert _crd_errors(crd_validators, broken)


def test_kuberay_pieces_fit_together(rendered):
    docs = {o["kind"]: o for o in rendered["kuberay"] if o["kind"] != "Service"}
    cluster, job = docs["RayCluster"], docs["RayJob"]
    service = next(o for o in rendered["kuberay"] if o["kind"] == "Service")
    spec = cluster["spec"]
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert job["spec"]["submissionMode"] in ("K8sJobMode", "HTTPMode")
    # rayStartParams are strings; the head runs the router and no engine
    for params in [spec["headGroupSpec"]["rayStartParams"]] + [g["rayStartParams"] for g in spec["workerGroupSpecs"]]:
        assert all(isinstance(v, str) for v in params.values()), params
    assert spec["headGroupSpec"]["rayStartParams"]["num-gpus"] == "0"
    pairs = 0
    for group in spec["workerGroupSpecs"]:
        (worker,) = group["template"]["spec"]["containers"]
        num_gpus = int(group["rayStartParams"]["num-gpus"])
        assert mc.gpus(worker) == num_gpus >= 2 and num_gpus % 2 == 0, "a pair (two GPUs) must fit one pod"
        assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
        pairs += group["replicas"] * num_gpus // 2
    program, *argv = shlex.split(job["spec"]["entrypoint"])
    assert program == "spectandem"
    args = _parse_cli(argv)
    assert args.command == "serve" and args.backend == "ray" and args.ray_address == "auto"
    assert args.replicas == pairs and args.device == "cuda" and args.host == "0.0.0.0"
    # the router Service reaches the head pod, where the job driver listens
    (head,) = spec["headGroupSpec"]["template"]["spec"]["containers"]
    assert service["spec"]["selector"] == {"ray.io/cluster": cluster["metadata"]["name"], "ray.io/node-type": "head"}
    head_ports = {p["containerPort"] for p in head["ports"]}
    assert {p["targetPort"] for p in service["spec"]["ports"]} == {args.port, args.http_port} <= head_ports
    assert args.metrics_port in head_ports
    assert spec["rayVersion"] == _dockerfile_arg("RAY_VERSION")


# ------------------------------------------------------------------------------ ray up config

def _ray_schema() -> dict:
    import importlib.resources
    import json

    return json.loads((importlib.resources.files("ray") / "autoscaler" / "ray-schema.json").read_text())


def _ray_config() -> dict:
    return yaml.safe_load((REPO / "deploy" / "ray" / "cluster.yaml").read_text())


def test_ray_up_config_matches_the_schema_in_the_ray_wheel():
    cfg = _ray_config()
    jsonschema.validate(cfg, _ray_schema())
    nodes = cfg["available_node_types"]
    assert nodes[cfg["head_node_type"]]["resources"] == {"CPU": 0, "GPU": 0}   # the router only
    workers = [n for name, n in nodes.items() if name != cfg["head_node_type"]]
    assert workers and all(n["resources"]["GPU"] >= 2 and n["resources"]["GPU"] % 2 == 0 for n in workers)
    assert cfg["docker"]["image"].endswith(":0.1.0")


def test_ray_up_config_passes_rays_own_validation():
    try:
        from ray.autoscaler._private.util import prepare_config, validate_config
    except ImportError as exc:  # a private API: say so rather than fail on a Ray refactor
        pytest.skip(f"ray.autoscaler._private.util moved in this Ray ({exc}); the schema test still ran")
    validate_config(prepare_config(_ray_config()))


def test_ray_schema_rejects_broken_copies():
    schema = _ray_schema()
    for mutate in [
        lambda c: c["available_node_types"]["gpu_worker"]["resources"].update(GPU=0.5),   # integers only
        lambda c: c.update(head_node=c.pop("head_node_type")),                             # unknown key
        lambda c: c["docker"].update(run_option=["--gpus all"]),
    ]:
        broken = _ray_config()
        mutate(broken)
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)


def test_ray_readme_commands_parse():
    text = (REPO / "deploy" / "ray" / "README.md").read_text()
    code = "\n".join(text.split("```")[1::2])          # the fenced blocks
    commands = [line.split('"')[1] for line in code.splitlines() if '"spectandem serve' in line]
    assert commands
    for command in commands:
        args = _parse_cli(shlex.split(command)[1:])
        assert args.command == "serve" and args.ray_address == "auto" and args.replicas >= 2


# ------------------------------------------------------------------- properties of the manifests

@pytest.mark.parametrize("name", ("cpu-demo", "gpu", "kuberay"))
def test_every_pod_runs_restricted(rendered, name):
    templates = list(mc.pod_templates(rendered[name]))
    assert len(templates) == {"kuberay": 2}.get(name, 3)    # router, verifier, drafter; or Ray head, workers
    assert [p for where, t in templates for p in mc.restricted_problems(where, t)] == []


def test_restricted_check_rejects_broken_copies(rendered):
    where, template = next(mc.pod_templates(rendered["gpu"]))
    for mutate, problem in [
        (lambda p: p["containers"][0]["securityContext"].update(allowPrivilegeEscalation=True),
         "allowPrivilegeEscalation"),
        (lambda p: p["containers"][0]["securityContext"]["capabilities"].update(drop=["NET_RAW"]), "drop ALL"),
        (lambda p: p["containers"][0]["securityContext"].pop("readOnlyRootFilesystem"), "readOnlyRootFilesystem"),
        (lambda p: p["securityContext"].pop("runAsNonRoot"), "runAsNonRoot"),
        (lambda p: p["securityContext"].update(seccompProfile={"type": "Unconfined"}), "seccompProfile"),
        (lambda p: p["volumes"].append({"name": "host", "hostPath": {"path": "/"}}), "hostPath"),
        (lambda p: p["containers"][0].update(
            volumeMounts=[m for m in p["containers"][0]["volumeMounts"] if m["mountPath"] != "/tmp"]), "/tmp"),
    ]:
        broken = copy.deepcopy(template)
        mutate(broken["spec"])
        assert any(problem in p for p in mc.restricted_problems(where, broken)), problem


@pytest.mark.parametrize("name", OVERLAYS)
def test_only_the_router_reaches_the_engines(rendered, name):
    assert mc.ingress_problems(rendered[name], {"drafter", "verifier"}, "router") == []


def test_network_policy_check_rejects_broken_copies(rendered):
    for mutate, problem in [
        (lambda s: s["ingress"][0].pop("from"), "admits every source"),
        (lambda s: s["ingress"][0]["from"].append({"ipBlock": {"cidr": "0.0.0.0/0"}}), "not a plain podSelector"),
        (lambda s: s["ingress"][0]["from"][0]["podSelector"]["matchLabels"].pop("app.kubernetes.io/component"),
         "admits pods of"),
        (lambda s: s["ingress"][0]["ports"][0].update(port=8080), "ports"),
        (lambda s: s["podSelector"]["matchLabels"].update({"app.kubernetes.io/component": "nothing"}),
         "no NetworkPolicy restricts"),
    ]:
        objects = copy.deepcopy(rendered["gpu"])
        policy = next(o for o in objects if o["kind"] == "NetworkPolicy")
        mutate(policy["spec"])
        assert any(problem in p for p in mc.ingress_problems(objects, {"drafter", "verifier"}, "router")), problem


@pytest.mark.parametrize("name", OVERLAYS)
def test_probes_are_grpc_on_the_served_port(rendered, name):
    from drafter.service import SERVICE_NAME as DRAFTER
    from router.server import SERVICE_NAME as GENERATION
    from verifier.service import SERVICE_NAME as VERIFIER

    services = {"router": GENERATION, "verifier": VERIFIER, "drafter": DRAFTER}
    for component, deployment in _deployments(rendered[name]).items():
        c, args = _container(deployment), _container_args(_container(deployment))
        port = ENGINE_PORTS[component]
        ports = {"grpc": port} if component != "router" else {"grpc": port, "http": args.http_port,
                                                              "metrics": args.metrics_port}
        assert {p["name"]: p["containerPort"] for p in c["ports"]} == ports and args.port == port
        assert c["startupProbe"]["grpc"] == {"port": port}
        assert c["readinessProbe"]["grpc"] == {"port": port, "service": services[component]}
        # the router's health follows the verifier's, so its liveness checks only the port
        liveness = {"tcpSocket": {"port": port}} if component == "router" else {"grpc": {"port": port}}
        handler = {k: v for k, v in c["livenessProbe"].items() if k in ("grpc", "tcpSocket", "httpGet", "exec")}
        assert handler == liveness


def test_gpus_shm_and_models(rendered):
    for name in OVERLAYS:
        deployments = _deployments(rendered[name])
        for component in ("verifier", "drafter"):
            template = deployments[component]["spec"]["template"]
            assert mc.shm_problems(component, template) == []
            assert mc.gpus(_container(deployments[component])) == (1 if name == "gpu" else 0)
            assert _container_args(_container(deployments[component])).device == ("cuda" if name == "gpu" else "cpu")
        assert mc.gpus(_container(deployments["router"])) == 0
        claims = {v["persistentVolumeClaim"]["claimName"] for d in deployments.values()
                  for v in d["spec"]["template"]["spec"]["volumes"] if "persistentVolumeClaim" in v}
        assert claims == ({"spectandem-models"} if name == "gpu" else set())   # cpu-demo: the demo pair in the image
    broken = copy.deepcopy(_deployments(rendered["gpu"])["verifier"]["spec"]["template"])
    broken["spec"]["volumes"] = [v for v in broken["spec"]["volumes"] if v["name"] != "shm"]
    assert mc.shm_problems("verifier", broken)


@pytest.mark.parametrize("name", OVERLAYS)
def test_args_parse_and_the_pair_agrees(rendered, name):
    deployments = _deployments(rendered[name])
    args = {component: _container_args(_container(d)) for component, d in deployments.items()}
    router = args["router"]
    assert router.backend == "grpc" and router.host == "0.0.0.0"
    services = {o["metadata"]["name"]: o for o in rendered[name] if o["kind"] == "Service"}
    for component, address in (("verifier", router.verifier_address), ("drafter", router.drafter_address)):
        (host_port,) = address
        host, port = host_port.rsplit(":", 1)
        svc = services[host]
        assert mc.selects({"matchLabels": svc["spec"]["selector"]},
                          deployments[component]["spec"]["template"]["metadata"]["labels"])
        (svc_port,) = svc["spec"]["ports"]
        assert svc_port["port"] == int(port) and svc_port["targetPort"] == "grpc"
        assert args[component].max_slots >= router.max_running
    # every port of every Service is a named port of the pods it selects
    for svc in services.values():
        component = svc["spec"]["selector"]["app.kubernetes.io/component"]
        named = {p["name"] for p in _container(deployments[component])["ports"]}
        assert {p["targetPort"] for p in svc["spec"]["ports"]} <= named, svc["metadata"]["name"]
    pod = deployments["router"]["spec"]["template"]
    assert pod["metadata"]["annotations"]["prometheus.io/port"] == str(router.metrics_port)
    tree = ("method", "num_steps", "topk", "num_draft_tokens", "fused", "target", "draft")
    assert {k: getattr(args["drafter"], k) for k in tree} == {k: getattr(router, k) for k in tree}
    assert args["verifier"].method == router.method and args["verifier"].target == router.target


def test_pdb_covers_every_pod(rendered):
    for name in OVERLAYS:
        (pdb,) = [o for o in rendered[name] if o["kind"] == "PodDisruptionBudget"]
        for deployment in _deployments(rendered[name]).values():
            assert mc.selects(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])


# ------------------------------------------------------------------------------- the image

ROLES = {"router": ["serve", "--backend", "grpc"], "drafter": ["drafter"], "verifier": ["verifier"], "serve": ["serve"]}


def _parse_cli(argv: list[str]):
    from spectandem.cli import build_parser

    return build_parser().parse_args(argv)


def _container_args(container: dict):
    """A container's args as the image's entrypoint maps them to the spectandem CLI."""
    role, *rest = container["args"]
    return _parse_cli(ROLES[role] + rest)


def _dockerfile_arg(name: str) -> str:
    for line in (REPO / "deploy" / "docker" / "Dockerfile").read_text().splitlines():
        if line.startswith(f"ARG {name}="):
            return line.split("=", 1)[1]
    raise AssertionError(f"no ARG {name} in the Dockerfile")


def test_dockerfile():
    lines = [line for line in (REPO / "deploy" / "docker" / "Dockerfile").read_text().splitlines()
             if line and not line.startswith("#")]
    assert "nvidia/cuda:" in _dockerfile_arg("CUDA_IMAGE") and "runtime" in _dockerfile_arg("CUDA_IMAGE")
    final = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM ")):]
    (user,) = [line.split()[1] for line in final if line.startswith("USER ")]
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root USER (runAsNonRoot can only check a number)"
    pods = [t["spec"] for name in OVERLAYS for _, t in mc.pod_templates(build(KUSTOMIZATIONS[name]))]
    assert {p["securityContext"]["runAsUser"] for p in pods} == {int(uid)}
    for line in lines:
        if line.startswith("COPY ") and "--from=" not in line:
            for source in [w for w in line.split()[1:-1] if not w.startswith("--")]:
                assert (REPO / source).exists(), f"COPY source {source} is missing"
    (expose,) = [line for line in final if line.startswith("EXPOSE ")]
    assert {int(p) for p in expose.split()[1:]} == set(ENGINE_PORTS.values())
    assert any(line.startswith("ENTRYPOINT ") and "spectandem-entrypoint" in line for line in final)


@pytest.mark.parametrize("argv,expected", [
    (["router", "--port", "1"], "spectandem serve --backend grpc --port 1"),
    (["drafter", "--port", "2"], "spectandem drafter --port 2"),
    (["verifier"], "spectandem verifier"),
    (["serve", "--replicas", "2"], "spectandem serve --replicas 2"),
    ([], "spectandem serve"),
    (["echo", "ray", "start"], "ray start"),           # anything else runs as a command
])
def test_entrypoint_maps_roles_to_commands(tmp_path, argv, expected):
    stub = tmp_path / "spectandem"
    stub.write_text('#!/bin/sh\necho spectandem "$@"\n')
    stub.chmod(0o755)
    env = {"PATH": f"{tmp_path}:/usr/bin:/bin"}
    out = subprocess.run(["bash", str(REPO / "deploy" / "docker" / "entrypoint.sh"), *argv],
                         capture_output=True, text=True, env=env, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected
