"""Chain draft ahead in one pass (drafter/ahead_chains.py), fp32 on the CPU, on the demo heads:

- the one-pass outcome cache equals the general one (a fork per node absorbing its path, host
  ranking, a tree per outcome: drafter/ahead.py) round after round: the same outcomes and the
  same next chains, token for token; a shifted position (a wrong layout) must be caught;
- the engine takes the one-pass path for chains, and only for them;
- the host ranking (`rank_chain_outcomes`) follows the score order, skips each depth's child and
  -inf tokens, and breaks ties by depth then token.
"""

from __future__ import annotations

import pytest

from drafter import ahead_chains
from drafter.ahead import fill_outcomes
from drafter.ahead_chains import rank_chain_outcomes
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS


def _spec(method, width, **tree):
    t, d = demo_paths(method)
    cfg = SpecConfig(method=method, ahead_width=width, **tree)
    return LocalSpeculator(t, d, cfg, max_slots=4, max_len=256)


def _general(d, rid):
    """The general path's outcome cache for `rid`'s tree being verified, forks freed after."""
    forks: list[str] = []
    try:
        fill_outcomes(d, [rid], forks)
    finally:
        for f in reversed(forks):
            d.proposer.remove(f)
    req = d.requests[rid]
    cache, req.outcomes = req.outcomes, None
    return {key: tree.token_ids[row].tolist() for key, (tree, row) in cache[1].items()}


def _one_pass(d, rid):
    in_flight = d.requests[rid].in_flight
    m = sum(in_flight[3]) - 1
    chain = in_flight[1][1: m + 1]
    cache = d.proposer.ahead_chains([d.requests[rid]], [chain], d.cfg.ahead_width)[0]
    return {key: tree.token_ids[row].tolist() for key, (tree, row) in cache.items()}


@pytest.mark.parametrize("method,width,tree", [
    ("eagle3", 5, dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle", 3, dict(num_steps=3, topk=1, num_draft_tokens=4)),
])
def test_one_pass_outcomes_equal_the_general_path(method, width, tree):
    spec = _spec(method, width, **tree)
    v, d = spec.verifier, spec.drafter
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[1]).ids
    sp = SamplingParams(max_tokens=200)
    first = v.prefill(["r"], [prompt], [sp], [1])[0]
    d.add("r", prompt, first.first_token_id, sp, 1, first.features)
    compared = 0
    for _ in range(12):
        tree_msg = d.draft(["r"])
        d.flush_deferred(["r"])
        general = _general(d, "r")
        fast = _one_pass(d, "r")
        assert fast == general, (compared, fast, general)
        assert len(fast) == width
        compared += 1
        d.draft_ahead(["r"])     # the engine's own call, for the next round's hit or miss
        d.extend(v.verify(tree_msg))
    assert compared == 12 and d.ahead_hits > 0


def test_a_shifted_position_is_caught(monkeypatch):
    """Control: the comparison must see a layout error. With every outcome step's RoPE position
    one too far, the outcome caches differ from the general path's (in 2 of the first 4 rounds:
    the demo head is robust to a small shift, and one differing round fails the comparison)."""
    spec = _spec("eagle3", 5, num_steps=4, topk=1, num_draft_tokens=5)
    v, d = spec.verifier, spec.drafter
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[1]).ids
    sp = SamplingParams(max_tokens=200)
    first = v.prefill(["r"], [prompt], [sp], [1])[0]
    d.add("r", prompt, first.first_token_id, sp, 1, first.features)
    real_run = type(d.proposer.head).run

    def shifted(self, token_ids, hidden, positions, cache, mask, query_rows):
        if token_ids.shape[1] > 1:   # the outcome steps (forced steps feed one token per row)
            positions = positions + 1
        return real_run(self, token_ids, hidden, positions, cache, mask, query_rows)

    differ = 0
    for _ in range(4):
        tree_msg = d.draft(["r"])
        d.flush_deferred(["r"])
        general = _general(d, "r")
        with monkeypatch.context() as mp:
            mp.setattr(type(d.proposer.head), "run", shifted)
            fast = _one_pass(d, "r")
        differ += fast != general
        d.extend(v.verify(tree_msg))
    assert differ >= 1


def test_engine_takes_the_one_pass_path_for_chains_only(monkeypatch):
    calls = []
    real = ahead_chains.AheadChainGraphs._run   # both entries: with and without the catch-up inside
    monkeypatch.setattr(ahead_chains.AheadChainGraphs, "_run",
                        lambda self, *a, **k: calls.append((len(a[2]), len(a[2][0]))) or real(self, *a, **k))
    for tree, expect in ((dict(num_steps=3, topk=1, num_draft_tokens=4), True),
                         (dict(num_steps=3, topk=2, num_draft_tokens=6), False)):
        calls.clear()
        spec = _spec("eagle3", 4, **tree)
        prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:2]]
        spec.generate(prompts, [SamplingParams(max_tokens=16)] * 2, ahead=True)
        assert bool(calls) == expect, (tree, calls)
        assert spec.drafter.ahead_hits > 0
        if expect:   # both requests in one pass, chains of num_steps tokens
            assert any(shape == (2, 3) for shape in calls), calls


def test_rank_chain_outcomes():
    inf = float("-inf")
    chain = [10, 11]
    ranked = [{10: -0.1, 20: -1.0, 21: inf}, {11: -0.2, 30: -0.5}, {40: -0.3, 41: -0.3}]
    # Depth 0: 20 (-1.0); depth 1: reach -0.1, 30 (-0.6); depth 2: reach -0.3, 40 and 41 (-0.6 each).
    assert rank_chain_outcomes(chain, ranked, 4) == [(1, 30), (2, 40), (2, 41), (0, 20)]
    assert rank_chain_outcomes(chain, ranked, 2) == [(1, 30), (2, 40)]
    # A chain token the draft cannot propose: nothing past it is reachable.
    ranked[0].pop(10)
    assert rank_chain_outcomes(chain, ranked, 4) == [(0, 20)]
