"""Controlled acceptance while serving (drafter/controlled.py): the truth book, the plans drawn
from it, and the proposer that mixes planned and real drafts row by row."""

import pytest
import torch

from drafter.controlled import ControlledProposer, TruthBook, prefix_plan
from drafter.engine import DrafterEngine
from drafter.proposers import DraftRequest
from drafter.tree import DraftNodes
from spectandem.config import SamplingParams, SpecConfig

VOCAB = 50
CFG = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4)


class _Inner:
    """A chain proposer that drafts token 7 at every node and records its calls."""

    feature_layers = (1, 2, 3)
    supports_ahead = False

    def __init__(self, cfg=CFG):
        self.cfg, self.calls = cfg, []

    def catch_up(self, reqs, num_new, features):
        self.calls.append(("catch_up", [r.request_id for r in reqs]))

    def propose(self, reqs, num_steps=None):
        m = num_steps or self.cfg.num_steps
        return DraftNodes(token_ids=torch.full((len(reqs), m), 7, dtype=torch.long),
                          parents=torch.arange(m).expand(len(reqs), m).clone(), scores=torch.zeros(len(reqs), m))

    def kv_stats(self):
        return {}

    def remove(self, request_id):
        self.calls.append(("remove", request_id))


def _req(rid, tokens, temperature=0.0):
    return DraftRequest(rid, list(tokens), SamplingParams(temperature=temperature), 0, sample_drafts=temperature >= 0.5)


def test_prefix_plan_rates_and_prefix_stability():
    truth = [(i * 7919) % VOCAB for i in range(20000)]
    assert prefix_plan(truth, 1.0, VOCAB).drafts == tuple(truth)
    assert all(d != t for d, t in zip(prefix_plan(truth, 0.0, VOCAB).drafts, truth))
    plan = prefix_plan(truth, 0.8, VOCAB)
    kept = sum(d == t for d, t in zip(plan.drafts, truth)) / len(truth)
    assert 0.78 < kept < 0.82 and all(0 <= d < VOCAB for d in plan.drafts)
    wrong = [p for p in range(len(truth)) if plan.drafts[p] != truth[p]]
    assert 0.76 < sum(plan.seconds[p] == truth[p] for p in wrong) / len(wrong) < 0.84
    assert all(s != d and 0 <= s < VOCAB for s, d in zip(plan.seconds, plan.drafts))
    # A truth's plan over its first tokens is that of any truth with the same first tokens.
    short = prefix_plan(truth[:300], 0.8, VOCAB)
    assert short.drafts == plan.drafts[:300] and short.seconds == plan.seconds[:300]
    with pytest.raises(ValueError, match="acceptance rate"):
        prefix_plan(truth, 1.5, VOCAB)


def test_truth_book_keeps_the_longest_truth_and_forgets_the_oldest():
    book = TruthBook(1.0, VOCAB, capacity=2, key_len=4)
    book.record([1, 2, 3])
    book.record([1, 2, 3, 4, 5, 6])          # extends [1, 2, 3]: replaces it
    book.record([1, 2, 3, 4])                # a prefix of a recorded truth: nothing new
    assert len(book) == 1
    assert book.plan([1, 2]).truth == (1, 2, 3, 4, 5, 6) == book.plan([1, 2, 3, 4, 5]).truth
    assert book.plan([1, 2, 3, 4, 5, 6]) is None            # nothing left to draft from it
    assert book.plan([1, 2, 9]) is None and book.plan([9]) is None
    book.record([1, 2, 3, 4, 9, 9])          # same first tokens, another continuation: both kept
    assert book.plan([1, 2, 3, 4, 9]).truth == (1, 2, 3, 4, 9, 9) and book.plan([1, 2, 3, 4, 5]) is not None
    book.record([8, 8])                      # over capacity: the least recently used goes
    assert len(book) == 2 and book.plan([1, 2, 3, 4, 9]) is None and book.plan([8]).truth == (8, 8)


def test_served_proposer_mixes_planned_and_real_rows():
    book = TruthBook(1.0, VOCAB)
    truth = list(range(10, 30))
    book.record(truth)
    p = ControlledProposer(_Inner(), truths=book)
    reqs = [_req("seen", truth[:9]), _req("new", [40] * 9), _req("end", truth[:18]), _req("warm", truth[:9], 0.3)]
    p.catch_up(reqs, [9, 9, 18, 9], [None] * 4)
    tree = p.propose(reqs)
    assert tree.token_ids.tolist() == [truth[9:12], [7, 7, 7], truth[18:20] + [7], [7, 7, 7]]
    sampled = p.propose([_req("hot", truth[:9], 1.0)])     # sampled drafts: the head's
    assert sampled.token_ids.tolist() == [[7, 7, 7]]
    # A request whose committed tokens leave its truth drafts the head's tokens from then on.
    reqs[0].token_ids.append(0)
    p.catch_up(reqs[:1], [1], [None])
    assert p.diverged == {"seen"} and p.propose(reqs[:1]).token_ids.tolist() == [[7, 7, 7]]


def test_engine_records_truths_of_ended_greedy_requests():
    book = TruthBook(1.0, VOCAB)
    engine = DrafterEngine(ControlledProposer(_Inner(), truths=book), CFG)
    engine.add("a", list(range(10, 19)), 19, SamplingParams(), 0, None)
    engine.add("s", list(range(30, 39)), 39, SamplingParams(temperature=0.8, seed=1), 0, None)
    engine.remove("a")
    engine.remove("s")
    assert book.plan(list(range(10, 15))).truth == tuple(range(10, 20))
    assert book.plan(list(range(30, 35))) is None     # a sampled output is no truth
    # The next request with that prompt drafts the recorded output.
    engine.add("b", list(range(10, 15)), 15, SamplingParams(), 0, None)
    assert engine.draft(["b"]).token_ids[0].tolist() == [15, 16, 17, 18]


def test_a_released_output_is_learned_whether_the_drafter_held_the_request_or_not():
    """Benchmark mode: the router sends each ended greedy request's whole output with its release
    (drafter/service_core.py `drafter_release`); the drafter learns it even for a request it never
    held (admitted without the drafter), and beyond the tokens it last caught up on."""
    from drafter.service_core import drafter_release

    book = TruthBook(1.0, VOCAB)
    engine = DrafterEngine(ControlledProposer(_Inner(), truths=book), CFG)
    engine.add("held", list(range(10, 15)), 15, SamplingParams(), 0, None)
    known = drafter_release(engine, ["held", "never-held"], outputs={"held": list(range(10, 30)),
                                                                    "never-held": list(range(40, 60))})
    assert known == 1 and "held" not in engine.requests
    assert book.plan(list(range(10, 15))).truth == tuple(range(10, 30))
    assert book.plan(list(range(40, 45))).truth == tuple(range(40, 60))
    drafter_release(engine, ["other"])   # negative control: a release without outputs teaches nothing
    assert len(book) == 2


def test_outputs_cross_the_grpc_release():
    """The drafter's gRPC service takes the outputs of a release (ReleaseRequest.outputs) to the
    proposer: a real server on a free port, driven by the router's link."""
    import asyncio

    from drafter.service import start_drafter_server
    from router.links_grpc import GrpcDrafterLink

    book = TruthBook(1.0, VOCAB)
    engine = DrafterEngine(ControlledProposer(_Inner(), truths=book), CFG)
    server = start_drafter_server(engine, "127.0.0.1", 0, max_slots=4, max_len=64)

    async def release():
        link = GrpcDrafterLink(f"127.0.0.1:{server.port}", 10.0)
        try:
            await link.release(["gone"], outputs={"gone": list(range(20, 33))})
        finally:
            await link.close()

    try:
        asyncio.run(release())
        assert book.plan(list(range(20, 25))).truth == tuple(range(20, 33))
    finally:
        server.stop(0)
