"""Offline validation of deploy/: every kustomization renders (tests/deploy/kustomize_lite.py,
and the real kustomize wherever a binary is on PATH), and the renderer fails loudly on a broken
kustomization."""

from __future__ import annotations

import shutil
import subprocess

import pytest
import yaml

from tests.deploy.kustomize_lite import KustomizeError, build, object_id
from tests.deploy.layout import K8S, KUSTOMIZATIONS, _deployments


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
