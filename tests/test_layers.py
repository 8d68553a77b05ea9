"""The import rule between the four packages.

``spectandem/`` (config, protocol types, codec, sampling, trees, caches, model code, kernels,
client SDK) is the bottom layer and imports none of the others. ``drafter/`` and ``verifier/``
import only ``spectandem/`` (never each other, never ``router/``). ``router/`` imports
``spectandem/`` and deals in ids, tokens, counts and opaque handles: it never imports torch.

Every import counts, at module level or inside a function. Command-line entry modules that
assemble the roles are the only exceptions; each is listed below with its reason.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spectandem", "drafter", "verifier", "router")

# package -> top-level names it must not import
FORBIDDEN = {
    "spectandem": {"router", "drafter", "verifier"},
    "drafter": {"router", "verifier"},
    "verifier": {"router", "drafter"},
    "router": {"torch", "drafter", "verifier"},
}

# module (path relative to the repository root) -> (names it may import anyway, reason)
ENTRY_POINTS = {
    "spectandem/cli.py": (
        {"router", "drafter", "verifier"},
        "the `spectandem` command: dispatches to `serve`, `drafter`, `verifier`, `train-draft`, "
        "`generate` and `bench`, which live in the roles",
    ),
    "spectandem/generate_cli.py": (
        {"router", "drafter", "verifier"},
        "`spectandem generate`: builds the in-process pair (router.local.LocalSpeculator)",
    ),
    "spectandem/bench/": (
        {"router", "drafter", "verifier"},
        "`spectandem bench`: measures the whole system, so it builds all three roles",
    ),
    "router/serve.py": (
        {"drafter", "verifier"},
        "`spectandem serve`: starts the engines (Ray actors, gRPC services or in process)",
    ),
    "router/links_local.py": (
        {"drafter", "verifier"},
        "the in-process backend of `spectandem serve` / `generate`: the engines live in the "
        "router's process, so the router builds them itself",
    ),
    "router/local.py": (
        {"drafter", "verifier"},
        "LocalSpeculator, the in-process pair of `spectandem generate` and the tests: it builds "
        "both engines in one process and runs them through the in-process links",
    ),
    "router/local_base.py": (
        {"drafter", "verifier"},
        "the in-process links' common base: calls the engines it holds directly",
    ),
}


def _exception(rel: str) -> set[str]:
    for key, (names, _reason) in ENTRY_POINTS.items():
        if rel == key or (key.endswith("/") and rel.startswith(key)):
            return names
    return set()


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module imported by ``path`` (top level and inside functions)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = path.relative_to(ROOT).parts[:-1]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:        # relative: resolve against the file's package
                base = list(package[: len(package) - node.level + 1])
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def _files():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield pkg, path


def _violations() -> list[str]:
    bad = []
    for pkg, path in _files():
        rel = path.relative_to(ROOT).as_posix()
        allowed = _exception(rel)
        for lineno, module in _imports(path):
            top = module.split(".")[0]
            if top in FORBIDDEN[pkg] and top not in allowed:
                bad.append(f"{rel}:{lineno} imports {module}")
    return bad


def test_layers_import_downward():
    bad = _violations()
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


def test_exceptions_exist():
    """Every listed exception names a module that is there (no stale entries)."""
    for key in ENTRY_POINTS:
        assert (ROOT / key).exists(), key


@pytest.mark.parametrize("pkg", PACKAGES)
def test_packages_are_scanned(pkg):
    assert any(True for p, _ in _files() if p == pkg)
