"""On a GPU (`python -m pytest -m gpu tests/gpu`): "ahead" at batch 1 over the tiny llama8b-scale
pair (fp32, CUDA graphs on) with chained verifies, which in-process links do on a GPU: the
verifier starts the verdict's next tree itself, from its launch buffers, and the tokens are
still the target's greedy continuation (bench_router8b raises otherwise). With two GPUs, the
head on the second too."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target
from benchmarks.bench.router8b import bench_router8b
from spectandem.config import GpuPaths

pytestmark = pytest.mark.gpu

STEPS = 4
MAX_TOKENS = 64


@pytest.mark.parametrize("triton", [False, True], ids=["graphs", "graphs+tree-attention"])
def test_chained_verifies_keep_the_tokens(triton):
    """With the tree attention the verify reads packed inputs, and the chained launches take
    the inputs packed before the verdict (verifier/chained.py: prepared launches)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    model = random_target(llama8b_spec("tiny"), "cuda:0", torch.float32, 0)
    head = random_eagle3_head(model, SHAPES["tiny"]["draft_vocab_size"], "cuda:0", torch.float32, 0)
    runs = ControlledRuns(model, head, "cuda:0", 4, 2, 16, MAX_TOKENS, STEPS, 0,
                          GpuPaths(cuda_graphs=True, triton_attention=triton))
    second = "cuda:1" if torch.cuda.device_count() > 1 else None
    rows = bench_router8b(runs, [0.9, 1.0], ["ahead"], [1], drafter_device=second)
    ahead = [r for r in rows if r["mode"] == "ahead"]
    assert len(ahead) == (4 if second else 2)
    for r in ahead:
        assert r["matches_plain"], r
        # Every hit's next round is a router-held tree; most of those the verifier started itself.
        assert r["ready_trees"] == r["ahead_hits"] and r["chained_verifies"] > 0, r
        assert r["chained_verifies"] <= r["ready_trees"], r
        assert (r["prepared_verifies"] > 0) == triton and r["prepared_verifies"] <= r["chained_verifies"], r
        # A miss's tree went out before the host had it, its forward reading the drafter's tokens
        # (across GPUs with two), whenever it went out at once; the tokens above are still exact.
        assert r["early_device_verifies"] == r["early_verifies"], r
