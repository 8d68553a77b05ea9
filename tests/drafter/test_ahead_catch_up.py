"""A hit's deferred catch-up inside the chain draft ahead (`EagleProposer.catch_up_ahead_chains`,
drafter/ahead_chains.py), fp32 on the CPU, on the demo heads.

Two engines in lockstep over the same rounds (draft, draft ahead, verify, extend), one taking the
one-pass path (catch-up inside the chain pass) and one running the catch-up and then the chain
pass. After every draft ahead both hold the same outcome caches (outcomes and next chains, token
for token), the same head-cache length and, up to summation order, the same last hidden and
logits. Controls: the one-pass path runs in most rounds, and features shifted by one pair (a
catch-up that absorbs the wrong rows) make the caches differ.
"""

from __future__ import annotations

import pytest

from drafter import ahead_chains
from spectandem.config import SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.drafter.lockstep import assert_same_head_state, prefilled, verify_and_extend
from tests.e2e.conftest import PROMPT_TEXTS


def _spec(method, width, **tree):
    t, d = demo_paths(method)
    return LocalSpeculator(t, d, SpecConfig(method=method, ahead_width=width, **tree), max_slots=4, max_len=256)


def _caches(d, rids):
    out = []
    for rid in rids:
        entry = d.requests[rid].outcomes
        out.append(None if entry is None else
                   (entry[0], {key: tree.token_ids[row].tolist() for key, (tree, row) in entry[1].items()}))
    return out


def _lockstep(method, width, tree, rounds, prompts, patch=None):
    """-> (rounds compared, rounds that took the one-pass catch-up, rounds whose caches differed)."""
    fused, split = _spec(method, width, **tree), _spec(method, width, **tree)
    split.drafter.proposer.has_catch_up_ahead_chains = False     # the engine then runs the two passes
    rids = prefilled((fused, split), prompts)
    used, differ = 0, 0
    real = ahead_chains.AheadChainGraphs.run_caught_up
    calls = []

    def counted(self, *a, **k):
        calls.append(1)
        return real(self, *a, **k) if patch is None else patch(real, self, *a, **k)

    for _ in range(rounds):
        trees = [spec.drafter.draft(rids) for spec in (fused, split)]
        assert trees[0].token_ids.tolist() == trees[1].token_ids.tolist()
        before = len(calls)
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(ahead_chains.AheadChainGraphs, "run_caught_up", counted)
            fused.drafter.draft_ahead(rids)
        split.drafter.draft_ahead(rids)
        used += len(calls) > before
        if _caches(fused.drafter, rids) != _caches(split.drafter, rids):
            differ += 1
            if patch is not None:   # the control: the engines' next trees differ from here on
                break
        if patch is None:
            assert_same_head_state(fused, split, rids)
        verify_and_extend(fused, split, trees)
    return rounds, used, differ


@pytest.mark.parametrize("method,width,tree,n", [
    ("eagle3", 5, dict(num_steps=4, topk=1, num_draft_tokens=5), 1),
    ("eagle3", 5, dict(num_steps=4, topk=1, num_draft_tokens=5), 2),
    ("eagle", 3, dict(num_steps=3, topk=1, num_draft_tokens=4), 1),
])
def test_catch_up_inside_the_chain_pass_equals_the_two_passes(method, width, tree, n):
    rounds, used, differ = _lockstep(method, width, tree, 14, PROMPT_TEXTS[1: 1 + n])
    assert differ == 0
    assert used >= rounds // 3, (used, rounds)   # the demo heads hit often: most rounds defer


def test_shifted_features_are_caught():
    """Control: each request's catch-up features rolled by one pair (the right rows, wrong order)."""
    def shifted(real, self, slots, base, token_ids, features, *rest):
        return real(self, slots, base, token_ids, [f.roll(1, 0) if f.shape[0] > 1 else -f for f in features], *rest)

    _, used, differ = _lockstep("eagle3", 5, dict(num_steps=4, topk=1, num_draft_tokens=5), 8,
                                PROMPT_TEXTS[1:2], patch=shifted)
    assert used >= 1 and differ >= 1, (used, differ)
