"""Fixtures of the deploy tests: every kustomization rendered by tests/deploy/kustomize_lite.py."""

from __future__ import annotations

import pytest

from tests.deploy.kustomize_lite import build
from tests.deploy.layout import KUSTOMIZATIONS


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: build(path) for name, path in KUSTOMIZATIONS.items()}
