"""Where deploy/ keeps things and how its containers map to the spectandem CLI, for the deploy
tests: the kustomizations, the engine ports, a rendered list's Deployments and their one
container, a container's args parsed as the image's entrypoint passes them on, and the
Dockerfile's build arguments."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy" / "k8s"
KUSTOMIZATIONS = {"base": K8S / "base", "cpu-demo": K8S / "overlays" / "cpu-demo", "gpu": K8S / "overlays" / "gpu",
                  "kuberay": K8S / "kuberay"}
OVERLAYS = ("cpu-demo", "gpu")
ENGINE_PORTS = {"router": 50051, "verifier": 50052, "drafter": 50053}
ROLES = {"router": ["serve", "--backend", "grpc"], "drafter": ["drafter"], "verifier": ["verifier"], "serve": ["serve"]}


def _deployments(objects) -> dict[str, dict]:
    return {o["metadata"]["labels"]["app.kubernetes.io/component"]: o for o in objects if o["kind"] == "Deployment"}


def _container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


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
