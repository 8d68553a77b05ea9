"""Seeded sampling with the real demo pair: batch invariance, the global RNG untouched, and the
speculative output's distribution against the target's exact distribution."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from scipy import stats

from spectandem.config import SamplingParams
from tests.e2e.conftest import speculator

ALPHA = 1e-6


def _params(n, temperature, max_tokens=24, **kw):
    return [SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=1000 + i, **kw) for i in range(n)]


@pytest.mark.parametrize("temperature,tree", [
    (0.3, dict(num_steps=4, topk=2, num_draft_tokens=8)),   # deterministic drafts, target-only tree sampling
    (0.9, dict(num_steps=4, topk=1, num_draft_tokens=5)),   # sampled chain, rejection sampling with q
    (1.0, dict(num_steps=3, topk=2, num_draft_tokens=7)),   # two sampled candidates per root
])
def test_seeded_runs_ignore_batch_and_keep_global_rng(prompts, temperature, tree):
    spec = speculator("eagle3", **tree)
    sel = prompts[:6]
    torch_state, np_state, py_state = torch.random.get_rng_state(), np.random.get_state(), random.getstate()
    alone = [spec.generate([p], [sp])[0].token_ids for p, sp in zip(sel, _params(len(sel), temperature, top_p=0.95))]
    together = [c.token_ids for c in spec.generate(sel, _params(len(sel), temperature, top_p=0.95))]
    mixed_batch = sel[:3] + prompts[10:14]
    mixed = spec.generate(mixed_batch, _params(3, temperature, top_p=0.95) + [
        SamplingParams(max_tokens=9, temperature=0.0)] * 4)
    assert together == alone
    assert [c.token_ids for c in mixed[:3]] == alone[:3]
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    assert np.random.get_state()[1].tolist() == np_state[1].tolist() and random.getstate() == py_state
    assert any(c.stats.accepted_tokens > 0 for c in mixed[:3])


def test_deterministic_drafts_reproduce_plain_sampling(prompts):
    """Target-only tree sampling draws each position with the uniform plain decoding uses, so
    seeded speculative output equals seeded plain decoding token for token."""
    plain = speculator("none").generate(prompts[:8], _params(8, 0.7, top_k=50))
    spec = speculator("eagle3", num_steps=4, topk=2, num_draft_tokens=8,
                      draft_sampling_min_temperature=1.5).generate(prompts[:8], _params(8, 0.7, top_k=50))
    assert [c.token_ids for c in spec] == [c.token_ids for c in plain]
    assert sum(c.stats.accepted_tokens for c in spec) > 0


def _exact_next(spec, context: list[int], temperature: float) -> np.ndarray:
    """The target's exact next-token distribution after `context` (float64)."""
    from spectandem.sampling import logits_to_probs

    model = spec.verifier.runner.model
    from spectandem.kv_cache import KVCache

    t = len(context)
    cache = KVCache(model.spec.num_layers, 1, model.spec.num_kv_heads, t, model.spec.head_dim, torch.float32)
    pos = torch.arange(t)[None]
    with torch.no_grad():
        h, _ = model(torch.tensor([context]), pos, cache.batch(torch.tensor([0]), pos, t),
                     torch.tril(torch.ones(t, t, dtype=torch.bool))[None])
        return logits_to_probs(model.logits(h[0, -1]), temperature).numpy()


def _chisq_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit; bins with expected count < 5 are merged into one."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("tree", [dict(num_steps=2, topk=1, num_draft_tokens=3),
                                  dict(num_steps=2, topk=2, num_draft_tokens=5)],
                         ids=["sampled-chain", "two-candidates"])
def test_rejection_sampling_follows_target_distribution(tokenizer, tree):
    """Speculative tokens 2 and 3 (the first round's depth-1 and depth-2 positions, decided by
    rejection sampling against the real head's q) follow the target's exact conditionals."""
    temperature = 1.0
    spec = speculator("eagle3", max_slots=500, max_len=32, draft_sampling_min_temperature=0.5, **tree)
    prompt = tokenizer.encode("def get(self, key").ids
    p1 = _exact_next(spec, prompt, temperature)
    first = int(p1.argmax())
    n = 3000
    tokens = []
    for start in range(0, n, 500):
        params = [SamplingParams(max_tokens=3, temperature=temperature, seed=start + i, ignore_eos=True)
                  for i in range(500)]
        tokens += [c.token_ids for c in spec.generate([prompt] * 500, params)]
    given = [t for t in tokens if t[0] == first]
    assert len(given) > 500
    p2 = _exact_next(spec, prompt + [first], temperature)
    counts2 = np.bincount([t[1] for t in given], minlength=p2.size)
    assert _chisq_pvalue(counts2, p2) > ALPHA
    second = int(counts2.argmax())
    p3 = _exact_next(spec, prompt + [first, second], temperature)
    counts3 = np.bincount([t[2] for t in given if t[1] == second], minlength=p3.size)
    assert _chisq_pvalue(counts3, p3) > ALPHA
    # The same data must be told apart from a nearby wrong law (the test has power).
    wrong = _exact_next(spec, prompt + [first], 0.8)
    assert _chisq_pvalue(counts2, wrong) < ALPHA
