"""A verdict's catch-up inside the next draft (`EagleProposer.catch_up_propose`, drafter/graphs.py:
ChainGraphs.propose_caught_up), fp32 on the CPU, on the demo heads, with the chain graphs' padded
computation run eagerly (graph=False; the GPU test runs the graphs).

Two engines in lockstep over the same rounds (draft, verify, extend), one deferring each
verdict's catch-up to the next draft and running both in one pass, one running the catch-up in
extend and drafting after it: the same trees, token for token, the same head-cache length and, up
to summation order, the same last hidden and logits. Controls: the one pass runs in every round
(the first with the prompt's catch-up, deferred from the prefill), and features shifted by one
pair make the trees differ.
"""

from __future__ import annotations

import pytest

from drafter.graphs import ChainGraphs
from spectandem.config import SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.drafter.lockstep import assert_same_head_state, prefilled, verify_and_extend
from tests.e2e.conftest import PROMPT_TEXTS


def _spec(method, **tree):
    t, d = demo_paths(method)
    spec = LocalSpeculator(t, d, SpecConfig(method=method, ahead_width=0, **tree), max_slots=4, max_len=256)
    p = spec.drafter.proposer
    p.chain = ChainGraphs(p.head, p.cache, graph=False)   # the GPU's chain path, eagerly
    return spec


def _lockstep(method, tree, rounds, prompts, patch=None):
    """-> (rounds, rounds that ran the one pass, rounds whose trees differed)."""
    fused, split = _spec(method, **tree), _spec(method, **tree)
    split.drafter.proposer.has_catch_up_propose = False     # the engine catches up in extend, as before
    rids = prefilled((fused, split), prompts)
    chain = fused.drafter.proposer.chain
    real, calls = chain.propose_caught_up, []

    def counted(slots, base, token_ids, features, *rest):
        calls.append(1)
        if patch is not None:
            features = patch(features)
        return real(slots, base, token_ids, features, *rest)

    chain.propose_caught_up = counted
    used = differ = 0
    for _ in range(rounds):
        before = len(calls)
        trees = [spec.drafter.draft(rids) for spec in (fused, split)]
        used += len(calls) > before
        if trees[0].token_ids.tolist() != trees[1].token_ids.tolist():
            differ += 1
            assert patch is not None, (trees[0].token_ids, trees[1].token_ids)
            break
        assert_same_head_state(fused, split, rids)
        verify_and_extend(fused, split, trees)
        deferred = [{rid for rid, r in s.drafter.requests.items() if r.deferred is not None} for s in (fused, split)]
        assert deferred == [set(rids), set()]
    return rounds, used, differ


@pytest.mark.parametrize("method,tree,n", [
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5), 1),
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5), 3),
    ("eagle", dict(num_steps=3, topk=1, num_draft_tokens=4), 2),
])
def test_catch_up_inside_the_draft_equals_catch_up_then_draft(method, tree, n):
    rounds, used, differ = _lockstep(method, tree, 10, PROMPT_TEXTS[:n])
    assert differ == 0 and used == rounds    # every round, the first too (the prompt's catch-up inside it)


def test_shifted_features_are_caught():
    """Control: each request's catch-up features rolled by one pair (or negated when it has one)."""
    shift = lambda feats: [f.roll(1, 0) if f.shape[0] > 1 else -f for f in feats]
    _, used, differ = _lockstep("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5), 6, PROMPT_TEXTS[:1], shift)
    assert used >= 1 and differ == 1, (used, differ)


def test_a_request_without_a_deferred_catch_up_leaves_the_others_one_pass():
    """A batch where one request's catch-up already ran (a request just prefilled whose catch-up
    could not wait, say): the others still catch up inside their draft, in one pass of their own,
    the first drafts alone; the trees are those of the engine that catches up in extend."""
    tree = dict(num_steps=4, topk=1, num_draft_tokens=5)
    fused, split = _spec("eagle3", **tree), _spec("eagle3", **tree)
    split.drafter.proposer.has_catch_up_propose = False
    rids = prefilled((fused, split), PROMPT_TEXTS[:3])
    chain = fused.drafter.proposer.chain
    real, batches = chain.propose_caught_up, []

    def counted(slots, *rest):
        batches.append(len(slots))
        return real(slots, *rest)

    chain.propose_caught_up = counted
    for _ in range(3):
        fused.drafter.flush_deferred([rids[0]])   # its catch-up now, on its own
        trees = [spec.drafter.draft(rids) for spec in (fused, split)]
        assert trees[0].token_ids.tolist() == trees[1].token_ids.tolist()
        assert_same_head_state(fused, split, rids)
        verify_and_extend(fused, split, trees)
    assert batches == [2, 2, 2], batches   # never the whole batch caught up apart


def test_a_prompt_catch_up_and_a_plain_round_after_it_run_inside_the_first_draft():
    """A request admitted beside a draft: its prompt's catch-up is deferred at the prefill, and the
    verdict of its plain round comes before its first draft. Both catch-ups wait for that draft and
    run in its one pass (nothing caught up apart); the trees are those of the engine that catches
    up in extend. Control: features of the plain round shifted make them differ."""
    from spectandem.messages import root_only_tree

    for shifted in (False, True):
        tree = dict(num_steps=4, topk=1, num_draft_tokens=5)
        fused, split = _spec("eagle3", **tree), _spec("eagle3", **tree)
        split.drafter.proposer.has_catch_up_propose = False
        rids = prefilled((fused, split), PROMPT_TEXTS[:2])
        prompt_pairs = [fused.drafter.requests[r].deferred[0] for r in rids]
        proposer, chain = fused.drafter.proposer, fused.drafter.proposer.chain
        apart, passes = [], []
        real_catch_up, real_pass = proposer.catch_up, chain.propose_caught_up
        proposer.catch_up = lambda reqs, *a: (apart.append(len(reqs)), real_catch_up(reqs, *a))[1]

        def one_pass(slots, base, token_ids, features, *rest):
            passes.append([len(t) for t in token_ids])
            return real_pass(slots, base, token_ids, features, *rest)

        chain.propose_caught_up = one_pass
        plain = []
        for spec in (fused, split):
            held = [spec.drafter.requests[r] for r in rids]
            verdicts = spec.verifier.verify(root_only_tree(rids, [h.committed_len for h in held],
                                                           [h.token_ids[-1] for h in held]))
            plain.append(verdicts)
        if shifted:
            for v in plain[0]:
                v.features = -v.features
        fused.drafter.extend(plain[0])
        split.drafter.extend(plain[1])
        assert [fused.drafter.requests[r].deferred[0] for r in rids] == [n + 1 for n in prompt_pairs]
        trees = [spec.drafter.draft(rids) for spec in (fused, split)]
        assert apart == [] and passes == [[n + 1 for n in prompt_pairs]], (apart, passes)
        same = trees[0].token_ids.tolist() == trees[1].token_ids.tolist()
        if shifted:
            assert not same
            continue
        assert same
        assert_same_head_state(fused, split, rids)
