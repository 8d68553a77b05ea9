"""The benchmark's controlled-acceptance drafts: the plan, and the proposer that swaps them into
a real proposer's chains (drafter/controlled.py)."""

import math

import pytest
import torch

from drafter.proposers import DraftRequest, Proposer
from drafter.tree import DraftNodes
from drafter.controlled import ControlledProposer, expected_accept_length, expected_ahead_hit_rate, plan_drafts
from spectandem.config import SamplingParams, SpecConfig

VOCAB = 50


def test_plan_keeps_the_prompt_and_replaces_at_the_planned_rate():
    truth = [i % VOCAB for i in range(5000)]
    assert plan_drafts(truth, 10, 1.0, VOCAB, "s").drafts == tuple(truth)
    none = plan_drafts(truth, 10, 0.0, VOCAB, "s").drafts
    assert none[:10] == tuple(truth[:10]) and all(d != t for d, t in zip(none[10:], truth[10:]))
    plan = plan_drafts(truth, 10, 0.7, VOCAB, "s")
    kept = sum(d == t for d, t in zip(plan.drafts[10:], truth[10:])) / (len(truth) - 10)
    assert 0.67 < kept < 0.73
    assert all(0 <= d < VOCAB for d in plan.drafts)
    assert plan == plan_drafts(truth, 10, 0.7, VOCAB, "s") != plan_drafts(truth, 10, 0.7, VOCAB, "t")
    with pytest.raises(ValueError, match="acceptance rate"):
        plan_drafts(truth, 10, 1.5, VOCAB, "s")


def test_expected_accept_length():
    assert expected_accept_length(0.8, 4) == pytest.approx(1 + 0.8 + 0.64 + 0.512 + 0.4096)
    assert expected_accept_length(1.0, 4) == 5 and expected_accept_length(0.0, 4) == 1


class _ScriptedProposer(Proposer):
    """A chain proposer that drafts token 0 at every node and records its calls."""

    feature_layers = (1, 2, 3)

    def __init__(self, cfg):
        self.cfg, self.calls = cfg, []

    def catch_up(self, reqs, num_new, features):
        self.calls.append(("catch_up", [r.request_id for r in reqs], list(num_new)))

    def propose(self, reqs, num_steps=None):
        self.calls.append(("propose", [r.request_id for r in reqs], num_steps))
        m = num_steps or self.cfg.num_steps
        return DraftNodes(token_ids=torch.zeros(len(reqs), m, dtype=torch.long),
                         parents=torch.arange(m).expand(len(reqs), m).clone(), scores=torch.zeros(len(reqs), m))

    def kv_stats(self):
        return {"used_blocks": 1}

    def remove(self, request_id):
        self.calls.append(("remove", request_id))


def _req(rid, tokens, temperature=0.0):
    params = SamplingParams(temperature=temperature)
    return DraftRequest(rid, list(tokens), params, 0, sample_drafts=temperature > 0)


def test_proposer_runs_the_inner_one_and_drafts_the_plan():
    inner = _ScriptedProposer(SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4))
    truth = list(range(10, 30))
    plans = {"a": plan_drafts(truth, 4, 1.0, VOCAB, "a"), "b": plan_drafts(truth, 4, 0.0, VOCAB, "b")}
    p = ControlledProposer(inner, plans)
    assert p.feature_layers == (1, 2, 3) and p.kv_stats() == {"used_blocks": 1}
    reqs = [_req("a", truth[:6]), _req("b", truth[:6])]
    p.catch_up(reqs, [5, 5], [None, None])
    tree = p.propose(reqs)
    # committed_len 6: the chain drafts positions 6, 7, 8.
    assert tree.token_ids[0].tolist() == truth[6:9]
    assert tree.token_ids[1].tolist() == list(plans["b"].drafts[6:9]) and all(
        d != t for d, t in zip(tree.token_ids[1].tolist(), truth[6:9]))
    assert p.propose(reqs, num_steps=2).token_ids[0].tolist() == truth[6:8]
    assert [c[0] for c in inner.calls] == ["catch_up", "propose", "propose"] and inner.calls[2][2] == 2
    assert not p.diverged
    reqs[1].token_ids.append(99)   # a committed token the truth does not have
    p.catch_up(reqs[1:], [1], [None])
    assert p.diverged == {"b"}
    p.remove("a")
    assert inner.calls[-1] == ("remove", "a")


def test_proposer_refuses_trees_and_sampled_drafts():
    with pytest.raises(ValueError, match="topk 1"):
        ControlledProposer(_ScriptedProposer(SpecConfig(method="eagle3", num_steps=3, topk=2, num_draft_tokens=6)), {})
    p = ControlledProposer(_ScriptedProposer(SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4)),
                           {"a": plan_drafts(list(range(20)), 4, 1.0, VOCAB, "a")})
    with pytest.raises(ValueError, match="deterministic drafts"):
        p.propose([_req("a", range(6), temperature=1.0)])


def test_second_guesses_are_right_at_the_rate_where_the_first_is_wrong():
    truth = [i % VOCAB for i in range(20000)]
    plan = plan_drafts(truth, 10, 0.7, VOCAB, "s")
    assert plan.rate == 0.7 and len(plan.seconds) == len(truth)
    assert all(s != d for s, d in zip(plan.seconds[10:], plan.drafts[10:]))
    wrong = [p for p in range(10, len(truth)) if plan.drafts[p] != truth[p]]
    right2 = sum(plan.seconds[p] == truth[p] for p in wrong) / len(wrong)
    assert 0.67 < right2 < 0.73
    # A right first guess leaves the second wrong (it is never the first).
    assert all(plan.seconds[p] != truth[p] for p in range(10, len(truth)) if p not in set(wrong))
    # The drafts are those of the plan before second guesses existed (their own random stream).
    import random
    rng, old = random.Random("s"), list(truth)
    for p in range(10, len(truth)):
        if rng.random() >= 0.7:
            old[p] = (truth[p] + 1 + rng.randrange(VOCAB - 1)) % VOCAB
    assert plan.drafts == tuple(old)


def test_expected_ahead_hit_rate():
    assert expected_ahead_hit_rate(0.8, 4) == pytest.approx(0.8 ** 5 + (1 - 0.8 ** 4) * 0.8)
    assert expected_ahead_hit_rate(1.0, 4) == 1.0 and expected_ahead_hit_rate(0.0, 4) == 0.0


class _AheadScripted(_ScriptedProposer):
    supports_ahead = True

    def ahead_fork(self, src, dst):
        self.calls.append(("fork", src, dst))

    def ahead_absorb(self, reqs, num_new):
        self.calls.append(("absorb", [r.request_id for r in reqs], list(num_new)))

    def ahead_logprobs(self, request_ids):
        self.calls.append(("logprobs", list(request_ids)))
        return torch.zeros(len(request_ids), VOCAB)


def test_forks_rank_the_plans_first_then_second_guess():
    cfg = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4)
    truth = list(range(10, 40))
    plan = plan_drafts(truth, 4, 0.6, VOCAB, "a")
    p = ControlledProposer(_AheadScripted(cfg), {"a": plan})
    assert p.supports_ahead and not ControlledProposer(_AheadScripted(cfg), {}, ahead=False).supports_ahead
    assert not ControlledProposer(_ScriptedProposer(cfg), {}).supports_ahead     # inner cannot
    from drafter.ahead import AHEAD_SEP

    forks = [_req(f"a{AHEAD_SEP}ahead0", truth[:6]), _req(f"a{AHEAD_SEP}ahead2", truth[:6] + list(plan.drafts[6:8]))]
    p.ahead_fork("a", forks[0].request_id)
    p.ahead_absorb(forks, [0, 2])
    lp = p.ahead_logprobs([f.request_id for f in forks])
    for row, pos in zip(lp, (6, 8)):   # a fork predicts the position of its committed length
        finite = {int(t) for t in torch.nonzero(row > float("-inf")).flatten()}
        assert finite == {plan.drafts[pos], plan.seconds[pos]}
        assert row[plan.drafts[pos]] == pytest.approx(math.log(0.6))
        assert row[plan.seconds[pos]] == pytest.approx(math.log(0.4 * 0.6))
    assert ("logprobs", [f.request_id for f in forks]) in p.inner.calls    # the real head's cost is paid
    # A fork drafts its request's plan from its own committed length.
    assert p.propose([forks[1]]).token_ids[0].tolist() == list(plan.drafts[8:11])
    p.remove(forks[1].request_id)
    assert forks[1].request_id not in p._fork_len


class _TwoPassScripted(_AheadScripted):
    """An inner proposer with chain draft ahead (the catch-up a call of its own)."""

    def supports_ahead_chains(self, batch):
        return True

    def ahead_chains(self, reqs, chains, width):
        self.calls.append(("ahead_chains", [r.request_id for r in reqs]))
        return [{} for _ in reqs]


class _OnePassScripted(_TwoPassScripted):
    """... and the catch-up inside the chain pass."""

    has_catch_up_ahead_chains = True

    def catch_up_ahead_chains(self, reqs, num_new, features, chains, width):
        self.calls.append(("catch_up_ahead_chains", [r.request_id for r in reqs], list(num_new)))
        return [{} for _ in reqs]


def _rows(caches):
    return [{key: tree.token_ids[row].tolist() for key, (tree, row) in c.items()} for c in caches]


def test_catch_up_inside_the_chain_pass_keeps_the_plan():
    """`catch_up_ahead_chains` runs the inner proposer's one pass (its cost is real), gives the
    plan's outcomes as `ahead_chains` does, and still sees a committed token off the truth; with
    an inner proposer without the one pass it runs the catch-up, then the chain pass."""
    cfg = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4)
    truth = list(range(10, 40))
    plan = plan_drafts(truth, 4, 0.6, VOCAB, "a")
    chain = list(plan.drafts[8:11])
    for inner, calls in ((_OnePassScripted(cfg), ["catch_up_ahead_chains"]),
                         (_TwoPassScripted(cfg), ["catch_up", "ahead_chains"])):
        p = ControlledProposer(inner, {"a": plan})
        req = _req("a", truth[:8])
        got = p.catch_up_ahead_chains([req], [2], [None], [chain], 3)
        assert [c[0] for c in inner.calls] == calls
        assert _rows(got) == _rows(p.ahead_chains([req], [chain], 3)) and len(got[0]) == 3
        assert not p.diverged
        req.token_ids.append(99)   # off the truth
        p.catch_up_ahead_chains([req], [1], [None], [chain], 3)
        assert p.diverged == {"a"}


class _CaughtUpScripted(_ScriptedProposer):
    """An inner proposer that drafts with the catch-up inside (token 0 at every node)."""

    has_catch_up_propose = True

    def catch_up_propose(self, reqs, num_new, features, num_steps=None):
        self.calls.append(("catch_up_propose", [r.request_id for r in reqs], list(num_new)))
        m = num_steps or self.cfg.num_steps
        return DraftNodes(token_ids=torch.zeros(len(reqs), m, dtype=torch.long),
                         parents=torch.arange(m).expand(len(reqs), m).clone(), scores=torch.zeros(len(reqs), m))


def test_catch_up_inside_the_draft_keeps_the_plan():
    """`catch_up_propose` runs the inner proposer's one pass and drafts the plan, as catch_up then
    propose do; a committed token off the truth is still seen; without the inner one pass it
    runs the two calls."""
    cfg = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4)
    truth = list(range(10, 30))
    plan = plan_drafts(truth, 4, 0.5, VOCAB, "a")
    for inner, calls in ((_CaughtUpScripted(cfg), ["catch_up_propose"]), (_ScriptedProposer(cfg), ["catch_up", "propose"])):
        p = ControlledProposer(inner, {"a": plan})
        req = _req("a", truth[:6])
        tree = p.catch_up_propose([req], [2], [None])
        assert [c[0] for c in inner.calls] == calls
        assert tree.token_ids[0].tolist() == list(plan.drafts[6:9]) and not p.diverged
        req.token_ids.append(99)
        p.catch_up_propose([req], [1], [None])
        assert p.diverged == {"a"}
    with pytest.raises(ValueError, match="deterministic drafts"):
        p.catch_up_propose([_req("a", truth[:6], temperature=1.0)], [1], [None])


def test_the_drafter_engine_computes_where_the_inner_proposer_does():
    """The link of a drafter engine over the controlled proposer finds the inner proposer's
    device (spectandem.devices.engine_device): on a GPU it gets its own CUDA stream and the
    holds, as the inner proposer alone would (the bench measures what serving runs)."""
    from drafter.engine import DrafterEngine
    from spectandem.devices import engine_device

    cfg = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4)
    inner = _ScriptedProposer(cfg)
    assert engine_device(DrafterEngine(ControlledProposer(inner, {}), cfg)) is None    # no device: none
    inner.device = torch.device("cpu")
    assert engine_device(DrafterEngine(ControlledProposer(inner, {}), cfg)) == torch.device("cpu")
