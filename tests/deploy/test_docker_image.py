"""The container image of deploy/docker: the Dockerfile (a CUDA runtime base, a numeric non-root
USER that the pods' runAsUser matches, COPY sources present, the engine ports exposed) and the
entrypoint's mapping of roles to spectandem commands."""

from __future__ import annotations

import subprocess

import pytest

from tests.deploy import manifest_checks as mc
from tests.deploy.kustomize_lite import build
from tests.deploy.layout import ENGINE_PORTS, KUSTOMIZATIONS, OVERLAYS, REPO, _dockerfile_arg


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
