"""Fixtures of the drafter tests: one intra-op thread per module, and the real demo target and
both demo heads (fp32). Each test module loads its own (module scope); a module that defines a
fixture of the same name (the loader tests' tiny target) uses that one."""

import pytest
import torch

from drafter.loader import load_head
from spectandem.modeling.llama import load_llama
from tests.drafter.proposer_helpers import MODELS


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target():
    return load_llama(f"{MODELS}/target", torch.float32)


@pytest.fixture(scope="module", params=["eagle3", "eagle"])
def head(request, target):
    return load_head(f"{MODELS}/{request.param}", target, kind=request.param, dtype=torch.float32)
