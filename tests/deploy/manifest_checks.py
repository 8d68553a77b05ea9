"""Properties of rendered manifests that no schema checks: the restricted security profile, who
may reach the engines, probes, GPUs, shared memory. Each check returns a list of problems (empty:
it holds), so a test can show a good manifest passes and a broken copy is caught."""

from __future__ import annotations

from typing import Iterator

# The Pod Security Standards' "restricted" profile allows only these volume types.
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def pod_templates(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """(where, pod template) for every pod the objects create, KubeRay's included."""
    for o in objects:
        name = f"{o['kind']}/{o['metadata']['name']}"
        spec = o.get("spec", {})
        if o["kind"] in WORKLOADS:
            yield name, spec["template"]
        elif o["kind"] == "RayCluster":
            yield from _ray_cluster_templates(name, spec)
        elif o["kind"] == "RayService":
            yield from _ray_cluster_templates(name, spec["rayClusterConfig"])
        elif o["kind"] == "RayJob":
            if "rayClusterSpec" in spec:
                yield from _ray_cluster_templates(name, spec["rayClusterSpec"])
            if "submitterPodTemplate" in spec:
                yield f"{name} submitter", spec["submitterPodTemplate"]


def _ray_cluster_templates(name: str, spec: dict):
    yield f"{name} head", spec["headGroupSpec"]["template"]
    for group in spec.get("workerGroupSpecs", []):
        yield f"{name} worker group {group['groupName']}", group["template"]


def restricted_problems(where: str, template: dict) -> list[str]:
    """The restricted profile, and a read-only root filesystem with a writable /tmp."""
    pod = template["spec"]
    psc = pod.get("securityContext", {})
    out = []
    for flag in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(flag):
            out.append(f"{where}: {flag} is set")
    if pod.get("automountServiceAccountToken") is not False:
        out.append(f"{where}: automountServiceAccountToken is not false (the pods never call the API)")
    for v in pod.get("volumes", []):
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"{where}: volume {v['name']} is of type {sorted(kinds)}, not allowed by the restricted profile")
    emptydirs = {v["name"] for v in pod.get("volumes", []) if "emptyDir" in v}
    for c in pod.get("initContainers", []) + pod["containers"]:
        at = f"{where} container {c['name']}"
        sc = c.get("securityContext", {})
        if sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is not True:
            out.append(f"{at}: runAsNonRoot is not true")
        if sc.get("runAsUser", psc.get("runAsUser")) == 0:
            out.append(f"{at}: runAsUser is 0")
        seccomp = sc.get("seccompProfile", psc.get("seccompProfile", {})).get("type")
        if seccomp != "RuntimeDefault":
            out.append(f"{at}: seccompProfile is {seccomp!r}, not RuntimeDefault")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{at}: allowPrivilegeEscalation is not false")
        if sc.get("privileged"):
            out.append(f"{at}: privileged")
        caps = sc.get("capabilities", {})
        if "ALL" not in caps.get("drop", []):
            out.append(f"{at}: capabilities do not drop ALL")
        if caps.get("add"):
            out.append(f"{at}: capabilities add {caps['add']}")
        if sc.get("readOnlyRootFilesystem") is not True:
            out.append(f"{at}: readOnlyRootFilesystem is not true")
        if not any(m["mountPath"] == "/tmp" and m["name"] in emptydirs for m in c.get("volumeMounts", [])):
            out.append(f"{at}: no writable emptyDir at /tmp (the root filesystem is read-only)")
    return out


def shm_problems(where: str, template: dict) -> list[str]:
    pod = template["spec"]
    memory = {v["name"] for v in pod.get("volumes", []) if v.get("emptyDir", {}).get("medium") == "Memory"}
    return [f"{where} container {c['name']}: /dev/shm is not a memory-backed emptyDir"
            for c in pod["containers"]
            if not any(m["mountPath"] == "/dev/shm" and m["name"] in memory for m in c.get("volumeMounts", []))]


def gpus(container: dict) -> int:
    return int(container.get("resources", {}).get("limits", {}).get("nvidia.com/gpu", 0))


def selects(selector: dict, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions In/NotIn/Exists/DoesNotExist) against labels."""
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for e in selector.get("matchExpressions", []):
        has, value = e["key"] in labels, labels.get(e["key"])
        ok = {"In": has and value in e.get("values", []), "NotIn": not has or value not in e.get("values", []),
              "Exists": has, "DoesNotExist": not has}[e["operator"]]
        if not ok:
            return False
    return True


def ingress_problems(objects: list[dict], protected: set[str], allowed: str) -> list[str]:
    """Pods of the `protected` components accept traffic only from pods of the `allowed` component,
    only on their own container ports: some Ingress policy selects each of them, and every
    ingress rule that applies names only peers that are `allowed` pods (a rule without `from`,
    an ipBlock or a namespaceSelector would admit others)."""
    pods = {t["metadata"]["labels"]["app.kubernetes.io/component"]: (where, t) for where, t in pod_templates(objects)}
    policies = [o for o in objects if o["kind"] == "NetworkPolicy"]
    out = []
    for component in sorted(protected):
        if component not in pods:
            out.append(f"no pod of component {component!r}")
            continue
        where, template = pods[component]
        labels = template["metadata"]["labels"]
        ports = {p["containerPort"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
        mine = [p for p in policies if selects(p["spec"]["podSelector"], labels)
                and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
        if not mine:
            out.append(f"{where}: no NetworkPolicy restricts its ingress")
        for p in mine:
            at = f"NetworkPolicy/{p['metadata']['name']} on {component}"
            for i, rule in enumerate(p["spec"].get("ingress", [])):
                peers = rule.get("from")
                if not peers:
                    out.append(f"{at}: ingress[{i}] has no `from`, so it admits every source")
                for peer in peers or []:
                    if set(peer) != {"podSelector"}:
                        out.append(f"{at}: ingress[{i}] peer {peer} is not a plain podSelector")
                        continue
                    admitted = {c for c, (_, t) in pods.items()
                                if selects(peer["podSelector"], t["metadata"]["labels"])}
                    if admitted != {allowed}:
                        out.append(f"{at}: ingress[{i}] admits pods of {sorted(admitted)}, not only {allowed!r}")
                rule_ports = {p.get("port") for p in rule.get("ports", [])}
                if not rule_ports or not rule_ports <= ports:
                    out.append(f"{at}: ingress[{i}] ports {sorted(map(str, rule_ports))} are not within the "
                               f"container ports {sorted(ports)}")
    return out
