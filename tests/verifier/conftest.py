"""Fixtures of the verifier tests."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    # The acceptance-law tensors are small but above torch's parallel grain size; with a busy
    # neighbour process on a 2-core machine, OpenMP workers waiting for a core made those files 8x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
