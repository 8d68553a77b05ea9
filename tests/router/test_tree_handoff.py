"""The tree channel of one process (spectandem/channel/trees.py TreeHandOff): serve --backend
local with a worker thread for each engine sends a sequential round's draft and verify together,
the drafter's thread handing the trees to the verifier's. Real demo engines behind the in-process
links (each with a thread of its own, here on the CPU): greedy tokens equal plain decoding's,
every drafted round's trees go through the hand-off, a failing draft leaves its verify without
trees at once, and a shared worker thread, where the verify would keep the draft from running,
is refused. The same rounds over sockets: test_tree_channel_router.py (fakes) and
test_links_grpc.py."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.local import LocalSpeculator
from router.loop import Router
from router.requests import RouterConfig
from router.serve import resolve_serve_flags, tree_channel
from spectandem.channel import TreeHandOff
from spectandem.cli import build_parser
from spectandem.config import Platform, SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.protocol import DraftHandle, Tag, TreeRoute
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.test_plain_steps import _serve


@pytest.fixture(scope="module")
def plain():
    return LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)


def _spec():
    return LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=256)


def _router(spec, trees, pipeline="sequential", tree_channel=True):
    vlink = LocalVerifierLink(spec.verifier, trees=trees)
    dlink = LocalDrafterLink(spec.drafter, trees=trees)
    return Router(vlink, dlink, spec.tokenizer, RouterConfig(
        max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline=pipeline, tree_channel=tree_channel)), vlink, dlink


@pytest.mark.parametrize("pipeline", ["sequential", "auto"])
def test_rounds_through_the_hand_off_give_the_targets_tokens(plain, pipeline):
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:5]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 7, 33, 40, 19)]
    want = [c.token_ids for c in plain.generate(prompts, params)]
    trees = TreeHandOff()
    router, vlink, dlink = _router(spec, trees, pipeline)
    got = _serve(router, prompts, params, engines=(spec.verifier, spec.drafter))
    assert [t for t, _, _ in got] == want
    c = router.counters
    assert c.num_drafts > 0 and c.stale_dropped == 0 and c.fallback_rounds == 0
    assert c.posted_trees > 0 and trees.trees_taken > 0 and trees.trees_missed == 0
    if pipeline == "sequential":   # every drafted request-round's tree went through the hand-off
        assert c.posted_trees == c.num_drafts
    assert vlink.clock.stats()["count"].get("verify.tree_wait", 0) > 0
    assert not spec.verifier.requests and not spec.drafter.requests


def test_without_the_channel_the_trees_go_with_the_handle(plain):
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:2]]
    params = [SamplingParams(max_tokens=24, ignore_eos=True)] * 2
    trees = TreeHandOff()
    router, _, _ = _router(spec, trees, tree_channel=False)
    got = _serve(router, prompts, params)
    assert [t for t, _, _ in got] == [c.token_ids for c in plain.generate(prompts, params)]
    assert router.counters.posted_trees == 0 and trees.trees_posted == 0 and router.counters.num_drafts > 0


async def _prefilled(vlink, dlink, tokenizer, request_id="r"):
    """A request prefilled on both engines -> its tag and first token."""
    from spectandem.protocol import DrafterPrefillItem, VerifierPrefillItem

    prompt = tokenizer.encode(PROMPT_TEXTS[0]).ids
    params = SamplingParams(max_tokens=8, seed=0)
    (res,) = await vlink.prefill([VerifierPrefillItem(Tag(request_id, 0, len(prompt)), prompt, params, 0)], True)
    if dlink is not None:
        assert await dlink.prefill([DrafterPrefillItem(res.tag, prompt, res.first_token_id, params, 0,
                                                       res.features)]) == []
    return res.tag, res.first_token_id


def test_a_failing_draft_leaves_its_verify_without_trees_at_once():
    """The draft raises inside the drafter's thread: it hands off "no tree" for its round before
    the error goes back, so the verify of that round goes on at once with its plain rows."""
    import asyncio

    from router.links import EngineUnavailable

    spec = _spec()
    trees = TreeHandOff()
    vlink, dlink = LocalVerifierLink(spec.verifier, trees=trees), LocalDrafterLink(spec.drafter, trees=trees)

    def broken(*a, **k):
        raise RuntimeError("a broken head")

    async def go():
        tag, _ = await _prefilled(vlink, dlink, spec.tokenizer)
        spec.drafter.draft = broken
        with pytest.raises(EngineUnavailable, match="a broken head"):
            await dlink.draft([tag], None, [], post_round=5)
    asyncio.run(go())
    t0 = time.monotonic()
    assert trees.take(5, 30.0) is None
    assert time.monotonic() - t0 < 5.0
    assert trees.trees_missed == 1


def test_the_hand_off_keeps_a_round_until_a_later_one_is_taken_and_times_out_alone():
    trees = TreeHandOff()
    assert trees.post(1, "tree-1", [Tag("a", 0, 3)])
    assert trees.take(1, 0.1) == ("tree-1", [Tag("a", 0, 3)])
    assert trees.take(1, 0.1) == ("tree-1", [Tag("a", 0, 3)])   # a verify sent again finds it
    trees.post(2, None, reason="no request left to draft for")
    assert trees.take(2, 5.0) is None
    t0 = time.monotonic()
    assert trees.take(3, 0.2) is None and time.monotonic() - t0 >= 0.2
    threading.Timer(0.1, trees.post, args=(4, "tree-4", [])).start()
    assert trees.take(4, 10.0) == ("tree-4", [])              # posted while the verify waits
    assert trees.take(1, 0.05) is None                        # taken round 4: round 1 is gone
    assert (trees.trees_posted, trees.trees_taken, trees.trees_missed) == (2, 3, 3)


def test_the_hand_off_serves_a_verify_only_the_early_trees_that_hold_its_round(caplog):
    """Early trees in one process: the trees posted on the verdicts of round 4 serve round 5's
    verify of b then a (those rows, in that order) where round 4's verdicts went to the drafter
    for both; a verify goes on without trees at once where those verdicts did not all go, where
    the early trees lack one of its tags or hold another committed length, and where the drafter
    made none; it never waits for round-own trees (none are posted for such a round): each such
    take ends on its reason, none on its timeout."""
    import logging

    import torch

    from spectandem.channel.trees import rows_held
    from spectandem.messages import DraftTree

    caplog.set_level(logging.INFO, logger="spectandem.channel")
    tree = DraftTree(request_ids=["a", "b"], committed_lens=[10, 20], token_ids=torch.tensor([[1, 2], [3, 4]]),
                     parents=torch.tensor([[-1, 0], [-1, 0]]), node_valid=torch.ones(2, 2, dtype=torch.bool),
                     scores=torch.zeros(2, 2))
    tags = [Tag("a", 0, 10), Tag("b", 0, 20)]
    trees = TreeHandOff()

    def take_early(round_id, timeout_s, early_after, want):   # as the verifier's link takes them
        return trees.take_early(round_id, timeout_s, early_after, want, lambda entry: rows_held(entry, want))
    trees.note_verdicts(4, ["a", "b"])
    threading.Timer(0.1, trees.post_early, args=(4, tree, tags)).start()
    got, got_tags = take_early(5, 30.0, 4, [Tag("b", 0, 20), Tag("a", 0, 10)])
    assert got_tags == [Tag("b", 0, 20), Tag("a", 0, 10)] and got.request_ids == ["b", "a"]
    assert got.token_ids.tolist() == [[3, 4], [1, 2]]
    assert (trees.early_taken, trees.early_rows_taken) == (1, 2)

    trees.note_verdicts(6, ["a"])                                   # "b"'s verdict did not go
    trees.post_early(6, tree, tags)
    assert take_early(7, 30.0, 6, tags) is None
    trees.note_verdicts(8, ["a", "b"])
    threading.Timer(0.1, trees.post_early, args=(8, tree, tags)).start()
    assert take_early(9, 30.0, 8, [Tag("a", 0, 11)]) is None  # another committed length
    trees.note_verdicts(10, ["a", "c"])
    trees.post_early(10, tree, tags)
    assert take_early(11, 30.0, 10, [Tag("c", 0, 5)]) is None  # no "c"
    trees.note_verdicts(12, ["a"])
    threading.Timer(0.1, trees.post_early, args=(12, None, [])).start()
    assert take_early(13, 30.0, 12, [Tag("a", 0, 10)]) is None  # none made
    assert (trees.early_taken, trees.trees_missed) == (1, 4)
    reasons = {r.getMessage() for r in caplog.records}
    held = "its trees on those verdicts do not hold the round"
    for round_id, why in ((7, "the verdicts of round 6 did not all go to the drafter"), (9, held), (11, held),
                          (13, held)):
        assert f"tree channel: the drafter has no tree for round {round_id} ({why})" in reasons, (round_id, reasons)
    assert not any("nothing came within" in m for m in reasons), reasons


def test_a_route_without_a_hand_off_verifies_the_plain_rows():
    """A verifier link without a hand-off finds no trees for a TreeRoute: its plain rows are
    verified, and the routed tags get no verdict."""
    import asyncio

    from spectandem.protocol import PlainItem

    spec = _spec()
    vlink = LocalVerifierLink(spec.verifier)

    async def go():
        tag, first = await _prefilled(vlink, None, spec.tokenizer, "plain")
        other, _ = await _prefilled(vlink, None, spec.tokenizer, "routed")
        handle = DraftHandle([Tag("routed", 0, other.committed_len)], TreeRoute(1, 0.1))
        return await vlink.verify(handle, [PlainItem(tag, first)], False)
    verdicts = asyncio.run(go())
    assert [v.tag.request_id for v in verdicts] == ["plain"] and verdicts[0].num_draft_tokens == 0


def test_a_drafter_link_without_a_hand_off_absorbs_the_catch_up_and_posts_nothing():
    """Asked to post without a hand-off, the drafter link drafts as without one: the handle says
    nothing went (the router then drafts apart for a while) and carries the trees."""
    import asyncio

    spec = _spec()
    vlink, dlink = LocalVerifierLink(spec.verifier), LocalDrafterLink(spec.drafter)

    async def go():
        tag, _ = await _prefilled(vlink, dlink, spec.tokenizer)
        return tag, await dlink.draft([tag], None, [], post_round=3)
    tag, handle = asyncio.run(go())
    assert handle.posted is False and handle.tags == [tag] and handle.payload is not None


def test_a_shared_worker_thread_is_refused():
    spec = _spec()
    shared = ThreadPoolExecutor(max_workers=1)
    try:
        with pytest.raises(ValueError, match="worker thread for each engine"):
            LocalVerifierLink(spec.verifier, thread=shared, trees=TreeHandOff())
        with pytest.raises(ValueError, match="worker thread for each engine"):
            LocalDrafterLink(spec.drafter, thread=shared, trees=TreeHandOff())
    finally:
        shared.shutdown()


def test_serve_hands_trees_off_in_process_only_where_each_engine_has_a_thread():
    def resolved(gpus, *argv):
        return tree_channel(resolve_serve_flags(build_parser().parse_args(["serve", *argv]), Platform(gpus=gpus)))

    assert resolved(1, "--backend", "local") is True                      # on the GPU: a thread each
    assert resolved(1, "--backend", "local", "--no-tree-channel") is False
    assert resolved(0, "--backend", "local") is False                     # the CPU: one shared thread
    with pytest.raises(ValueError, match="needs an engine on a GPU"):
        resolved(0, "--backend", "local", "--tree-channel")
    assert resolved(0, "--backend", "grpc") is True and resolved(0, "--backend", "ray") is True
