"""The import rule between the four packages.

``spectandem/`` (config, protocol types, codec, sampling, trees, caches, model code, kernels,
client SDK) is the bottom layer and imports none of the others. ``drafter/`` and ``verifier/``
import only ``spectandem/`` (never each other, never ``router/``). ``router/`` imports
``spectandem/`` and deals in ids, tokens, counts and opaque handles: it never imports torch, and
reaches the engines through links (router/links.py), not their modules.

Every import counts, at module level or inside a function. The exceptions are the modules that
assemble the roles: command-line entry points, and the backends that build or place the engines
themselves (in process, as Ray actors). Each is listed below with its reason; none may import
torch into the router.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("spectandem", "drafter", "verifier", "router")

# package -> top-level names it must not import
FORBIDDEN = {   # benchmarks/ sits above all four: none of them imports it
    "spectandem": {"router", "drafter", "verifier", "benchmarks"},
    "drafter": {"router", "verifier", "benchmarks"},
    "verifier": {"router", "drafter", "benchmarks"},
    "router": {"torch", "drafter", "verifier", "benchmarks"},
}

# module (path relative to the repository root) -> (names it may import anyway, reason)
ENTRY_POINTS = {
    "spectandem/cli.py": (
        {"router", "drafter", "verifier", "benchmarks"},
        "the `spectandem` command: dispatches to `serve`, `drafter`, `verifier`, `train-draft`, "
        "`generate` (in the roles) and `bench` (benchmarks/bench/)",
    ),
    "router/links_local.py": (
        {"drafter", "verifier"},
        "the in-process backend of `spectandem serve --backend local`: the engines live in the "
        "router's process and the links call them through the same calls as their Ray actors "
        "and gRPC services",
    ),
    "router/local.py": (
        {"drafter", "verifier"},
        "LocalSpeculator, the in-process pair of `spectandem generate` and the tests: it builds "
        "both engines in one process and runs the reference loop over them",
    ),
    "router/links_ray.py": (
        {"drafter", "verifier"},
        "the Ray backend of `spectandem serve`: places the engine actors, and Ray needs their classes",
    ),
}


def _exception(rel: str) -> set[str]:
    for key, (names, _reason) in ENTRY_POINTS.items():
        if rel == key or (key.endswith("/") and rel.startswith(key)):
            return names
    return set()


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every absolute module imported by ``path`` (top level and inside functions)."""
    return _imports_of(path.read_text(), path.relative_to(ROOT).parts[:-1], str(path))


def _imports_of(source: str, package: tuple[str, ...], filename: str = "<source>") -> list[tuple[int, str]]:
    tree = ast.parse(source, filename=filename)
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


def _scan() -> tuple[list[str], set[str]]:
    """(imports that break the rule, the exceptions some import needed)."""
    bad, used = [], set()
    for pkg, path in _files():
        rel = path.relative_to(ROOT).as_posix()
        allowed = _exception(rel)
        for lineno, module in _imports(path):
            top = module.split(".")[0]
            if top not in FORBIDDEN[pkg]:
                continue
            if top in allowed:
                used.add(next(k for k in ENTRY_POINTS if rel == k or (k.endswith("/") and rel.startswith(k))))
            else:
                bad.append(f"{rel}:{lineno} imports {module}")
    return bad, used


def test_layers_import_downward():
    bad, _ = _scan()
    assert not bad, "layer rule broken:\n" + "\n".join(bad)


def test_exceptions_are_needed():
    """Every listed exception names a module that is there and still imports what it may (no
    stale entries)."""
    _, used = _scan()
    for key in ENTRY_POINTS:
        assert (ROOT / key).exists(), key
        assert key in used, f"{key} no longer needs its exception"


def test_scanner_sees_function_level_and_relative_imports():
    source = "import os\n\ndef f():\n    from router import links\n    from ..verifier import engine\n"
    assert {m for _, m in _imports_of(source, ("spectandem", "kernels"))} == {"os", "router", "spectandem.verifier"}


@pytest.mark.parametrize("pkg", PACKAGES)
def test_packages_are_scanned(pkg):
    assert any(p == pkg for p, _ in _files())
