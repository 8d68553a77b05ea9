"""Offline validation of deploy/: the properties no schema checks hold in the rendered manifests
(restricted security context, NetworkPolicy, grpc probes, GPUs, /dev/shm, flags the CLI accepts,
the router and engine pairs agreeing, PodDisruptionBudgets, KubeRay pieces fitting together).
Every check is also shown a broken copy that it must reject."""

from __future__ import annotations

import copy
import shlex

import pytest

from tests.deploy import manifest_checks as mc
from tests.deploy.layout import (ENGINE_PORTS, OVERLAYS, _container, _container_args, _deployments, _dockerfile_arg,
                                 _parse_cli)


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
