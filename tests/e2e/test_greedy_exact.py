"""Greedy speculative output is token-identical to target-only greedy decoding (fp32, CPU),
with transformers' own `generate` as the oracle, on every prompt."""

from __future__ import annotations

import pytest

from spectandem.config import SamplingParams
from tests.e2e.conftest import MAX_TOKENS, speculator

CONFIGS = [
    ("none", {}),
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=4, topk=2, num_draft_tokens=8)),
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
    ("eagle3", dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True)),
    ("eagle", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle", dict(num_steps=3, topk=3, num_draft_tokens=10)),
    ("eagle", dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True)),
    ("draft-model", dict(num_steps=4, topk=2, num_draft_tokens=8)),
    ("ngram", dict(num_steps=4, num_draft_tokens=5)),
]


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS) for _ in range(n)]


@pytest.mark.parametrize("method,tree", CONFIGS, ids=[f"{m}-{'-'.join(f'{k}{v}' for k, v in t.items())}"
                                                      for m, t in CONFIGS])
def test_batched_equals_oracle(method, tree, prompts, oracle):
    """All prompts in one batch (larger than topk)."""
    spec = speculator(method, **tree)
    outs = spec.generate(prompts, _greedy(len(prompts)))
    assert len(prompts) >= 20
    for i, (c, expected) in enumerate(zip(outs, oracle)):
        assert c.token_ids == expected, f"prompt {i}: {c.token_ids} != {expected}"
    if method not in ("none",):
        rounds = sum(c.stats.num_rounds for c in outs)
        accepted = sum(c.stats.accepted_tokens for c in outs)
        assert accepted > 0 and rounds > 0  # speculation really happened


@pytest.mark.parametrize("method,tree", [CONFIGS[1], CONFIGS[3], CONFIGS[4], CONFIGS[6]],
                         ids=["eagle3-chain", "eagle3-tree", "eagle3-fused", "eagle-tree"])
def test_batch_one_equals_oracle(method, tree, prompts, oracle):
    spec = speculator(method, max_slots=1, **tree)
    for i, (p, expected) in enumerate(zip(prompts, oracle)):
        (c,) = spec.generate([p], _greedy(1))
        assert c.token_ids == expected, f"prompt {i}"


def test_stop_and_length(prompts, oracle):
    """max_tokens truncates mid-round; a stop token ends the completion right after it."""
    spec = speculator("eagle3", num_steps=4, topk=1, num_draft_tokens=5)
    outs = spec.generate(prompts[:4], [SamplingParams(max_tokens=7) for _ in range(4)])
    for c, expected in zip(outs, oracle):
        assert c.token_ids == expected[:7] and c.finish_reason == "length"
    stop = oracle[0][5]
    (c,) = spec.generate([prompts[0]], [SamplingParams(max_tokens=MAX_TOKENS, stop_token_ids=(stop,))])
    assert c.token_ids == oracle[0][: oracle[0].index(stop) + 1] and c.finish_reason == "stop"


def test_context_end(prompts, oracle):
    """Near the end of the context the loop stops speculating, and ends with 'length'."""
    p = prompts[0]
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths
    from router.local import LocalSpeculator

    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3", num_steps=4, num_draft_tokens=5), max_slots=1,
                           max_len=len(p) + 12)
    (c,) = spec.generate([p], _greedy(1))
    assert c.finish_reason == "length"
    assert c.token_ids == oracle[0][: len(c.token_ids)]
    assert len(p) + len(c.token_ids) == len(p) + 12
