"""On a GPU (`python -m pytest -m gpu tests/gpu`): the target's verify reading a chain's drafts
from device tokens (a miss's launch before the host has them: VerifierEngine.launch), through
the CUDA graphs, the tree attention and the batch-invariant kernels, the drafts on a second GPU
where there is one (the drafter's): logits and features equal a verify of the full tree
(tests/verifier/test_runner.py `check_device_tokens`)."""

from __future__ import annotations

import pytest
import torch

from spectandem.modeling.llama import load_llama
from tests.verifier.test_runner import AUX, DEMO, check_device_tokens
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("path", ["graphs", "graphs+tree-attention", "batch-invariant"])
def test_device_tokens_on_the_gpu(path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = load_llama(DEMO, device="cuda:0")
    kw = {"graphs": dict(cuda_graphs=True), "graphs+tree-attention": dict(cuda_graphs=True, triton_attention=True),
          "batch-invariant": dict(batch_invariant=True)}[path]
    drafts_on = "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"
    check_device_tokens(lambda: NativeRunner(model, AUX, max_slots=3, max_len=64, **kw), "cuda:0", drafts_on)
