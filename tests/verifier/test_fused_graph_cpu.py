"""The fused round as one static-shape computation (verifier/fused.py FusedGraphStep), run
eagerly on the CPU (graph=False): greedy output equals plain decoding token for token, batched
and padded, for EAGLE-3 and EAGLE-1; the engines' state after it is what the unfused round
leaves (committed tokens, head cache length); sampled requests fall back to the unfused step.
The graphed replay is compared with this path on the GPU (tests/gpu/test_fused_graph.py)."""

from __future__ import annotations

import pytest

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from verifier.fused import FusedGraphStep, FusedStep
from router.local import LocalSpeculator
from spectandem.reference import generate
from tests.e2e.conftest import PROMPT_TEXTS

FUSED = dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True)


@pytest.fixture(scope="module")
def plain():
    t, _ = demo_paths("none")
    spec = LocalSpeculator(t, None, SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:6]]
    return prompts, [c.token_ids for c in spec.generate(prompts, [SamplingParams(max_tokens=40)] * 6)]


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_static_fused_round_equals_plain(plain, method):
    prompts, expected = plain
    t, d = demo_paths(method)
    spec = LocalSpeculator(t, d, SpecConfig(method=method, **FUSED), max_slots=8, max_len=256)
    calls: list[int] = []

    class Counting(FusedGraphStep):
        def __call__(self, tree):
            calls.append(len(tree.request_ids))
            return super().__call__(tree)

    fused = FusedStep(spec.verifier, spec.drafter, Counting(spec.verifier, spec.drafter, graph=False))
    got = generate(spec.verifier, spec.drafter, prompts, [SamplingParams(max_tokens=40)] * 6,
                   spec.eos_token_ids, spec.lookahead, None, fused)
    assert [c.token_ids for c in got] == expected
    assert 6 in calls   # the whole batch (padded to a bucket of 8) went through the static round
    assert sum(c.stats.accepted_tokens for c in got) > 0
    assert not spec.drafter.requests and not spec.verifier.requests


def test_state_after_a_static_round_matches_the_unfused_round():
    t, d = demo_paths("eagle3")
    cfg = SpecConfig(method="eagle3", **FUSED)
    a = LocalSpeculator(t, d, cfg, max_slots=4, max_len=256)
    b = LocalSpeculator(t, d, cfg, max_slots=4, max_len=256)
    prompt = a.tokenizer.encode(PROMPT_TEXTS[3]).ids
    sp = SamplingParams(max_tokens=64)
    for spec in (a, b):
        out = spec.verifier.prefill(["r"], [prompt], [sp], [1])[0]
        spec.drafter.add("r", prompt, out.first_token_id, sp, 1, out.features)
    static, unfused = FusedGraphStep(a.verifier, a.drafter, graph=False), FusedStep(b.verifier, b.drafter)
    tree_a, tree_b = a.drafter.draft(["r"]), b.drafter.draft(["r"])
    for _ in range(12):
        outs_a, tree_a = static(tree_a)
        outs_b, tree_b = unfused(tree_b)
        assert [o.token_ids for o in outs_a] == [o.token_ids for o in outs_b]
        assert a.drafter.proposer.cache_len["r"] == b.drafter.proposer.cache_len["r"]
        assert a.drafter.requests["r"].token_ids == b.drafter.requests["r"].token_ids
        assert a.verifier.requests["r"].token_ids == b.verifier.requests["r"].token_ids
        assert tree_a.committed_lens == tree_b.committed_lens


def test_sampled_requests_take_the_unfused_step():
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3", **FUSED), max_slots=4, max_len=256)
    step = FusedGraphStep(spec.verifier, spec.drafter, graph=False)
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[0]).ids
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=3)
    out = spec.verifier.prefill(["r"], [prompt], [sp], [3])[0]
    spec.drafter.add("r", prompt, out.first_token_id, sp, 3, out.features)
    assert not step.supports(spec.drafter.draft(["r"]))


def test_graph_needs_cuda():
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3", **FUSED), max_slots=2, max_len=128)
    with pytest.raises(ValueError, match="CUDA"):
        FusedGraphStep(spec.verifier, spec.drafter, graph=True)
