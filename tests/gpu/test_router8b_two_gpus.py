"""On a machine with two GPUs (`python -m pytest -m gpu tests/gpu`): the router8b rows with the
EAGLE-3 head on cuda:1 and the target on cuda:0 (tiny llama8b scale, fp32, CUDA graphs on). The
head, its proposer and caches live on cuda:1, target features cross over in the catch-ups, and
every mode's tokens are the target's greedy continuation (bench_router8b raises otherwise)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target
from benchmarks.bench.router8b import bench_router8b
from spectandem.config import GpuPaths

pytestmark = pytest.mark.gpu

STEPS = 4
MAX_TOKENS = 16      # 1 token from the prefill + 3 rounds of STEPS + 1 at full acceptance


def test_drafter_on_its_own_gpu():
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    model = random_target(llama8b_spec("tiny"), "cuda:0", torch.float32, 0)
    head = random_eagle3_head(model, SHAPES["tiny"]["draft_vocab_size"], "cuda:0", torch.float32, 0)
    runs = ControlledRuns(model, head, "cuda:0", 4, 2, 16, MAX_TOKENS, STEPS, 0, GpuPaths(cuda_graphs=True))
    own = runs.with_drafter_device("cuda:1")
    assert next(own.inner.head.parameters()).device == torch.device("cuda:1")
    assert own.inner.cache.k[0].device == torch.device("cuda:1")
    assert next(runs.inner.head.parameters()).device == torch.device("cuda:0")   # the original stays
    assert own.placement()["placement"] == "drafter-own-gpu" and runs.placement()["placement"] == "one-device"
    rows = bench_router8b(runs, [1.0], ["sequential", "pingpong"], [4], drafter_device="cuda:1")
    by = {(r["placement"], r["mode"]) for r in rows}
    assert by == {("one-device", m) for m in ("plain", "sequential", "pingpong")} | {
        ("drafter-own-gpu", m) for m in ("sequential", "pingpong")}
    for r in rows:
        assert r["matches_plain"] and r["round_over_verify"] >= 0.99 and r["verify_busy_s"] > 0, r
        if r["mode"] != "plain":
            assert r["accept_length"] == STEPS + 1 and r["over_verify_alone"] > 0, r
    assert all(r["drafter_device"] == "cuda:1" for r in rows if r["placement"] == "drafter-own-gpu")
