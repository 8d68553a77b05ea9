"""The router's rounds over a tree channel (RouterConfig.tree_channel: the draft call and the
verify go out together, the drafter posts the trees to the verifier), on the fake engines of
tests/router/fakes.py with a TreeBox between them: exact tokens whatever the drafts, and what
happens when the drafter fails, hangs, restarts or cannot post. The channel itself, with real
sockets: tests/spectandem/test_tree_channel.py; with real engines: test_links_grpc.py and
test_serve_backends.py."""

from __future__ import annotations

import pytest

from router.loop import TREE_RETRY_ROUNDS
from tests.router.fakes import OracleVerifier, ScriptedDrafter, TreeBox, continuation
from tests.router.test_router_fakes import PROMPTS, assert_clean, assert_exact, config, half_right, run, serve, wrong


def pair(propose=continuation):
    box = TreeBox()
    return box, OracleVerifier(box), ScriptedDrafter(propose, trees=box)


@pytest.mark.parametrize("propose", [continuation, wrong, half_right], ids=["accepted", "rejected", "partly"])
@pytest.mark.parametrize("pipeline", ["sequential", "ahead", "auto"])
def test_rounds_over_the_tree_channel_give_the_targets_tokens(propose, pipeline):
    box, v, d = pair(propose)
    router, outs = run(serve(v, d, PROMPTS, cfg=config(pipeline=pipeline, mode_window=2, tree_channel=True)))
    assert_exact(outs)
    assert_clean(v, d)
    c = router.counters
    assert c.draft_tokens > 0 and c.stale_dropped == 0
    # Every drafted request-round's tree went over the channel (these fakes hold no ready trees),
    # but ping-pong's, which "auto" also measures: its rounds send the trees through the router.
    assert c.num_drafts > 0
    assert c.posted_trees == c.num_drafts if pipeline != "auto" else 0 < c.posted_trees < c.num_drafts
    assert len(box.taken) > 0
    if propose is continuation and pipeline == "sequential":
        assert c.accepted_tokens == c.draft_tokens


def test_without_the_flag_trees_go_through_the_router():
    box, v, d = pair()
    router, outs = run(serve(v, d, PROMPTS, cfg=config()))
    assert_exact(outs)
    assert router.counters.posted_trees == 0 and box.trees == {} and router.counters.num_drafts > 0


@pytest.mark.parametrize("mode", ["fail", "hang"])
def test_a_drafter_that_fails_or_hangs_leaves_rounds_going_on_plainly(mode):
    """A failing drafter says so over the channel (the verifier gets a round without trees, not a
    wait); a hung one costs one wait of drafter_timeout plus the margin."""
    box, v, d = pair()

    def on_event(router, ev, req, data):
        if ev == "tokens" and router.counters.rounds == 3:
            d.mode = mode
    router, outs = run(serve(v, d, PROMPTS, cfg=config(tree_channel=True), on_event=on_event))
    assert_exact(outs)
    assert v.errors == [] and v.ctx == {}
    c = router.counters
    assert c.drafter_outages == 1 and c.fallback_rounds > 0
    assert (None in box.trees.values()) == (mode == "fail")


def test_a_drafter_that_cannot_post_sends_trees_through_the_router_for_a_while():
    box, v, d = pair(half_right)
    box.down = True   # no connection: posts fail, and the verifier does not wait
    router, outs = run(serve(v, d, PROMPTS, cfg=config(tree_channel=True)))
    assert_exact(outs)
    assert_clean(v, d)
    c = router.counters
    assert c.posted_trees == 0 and c.draft_tokens > 0
    assert router._trees_off_until > 0 and c.rounds < router._trees_off_until <= TREE_RETRY_ROUNDS + 1


@pytest.mark.parametrize("comes_back", [True, False], ids=["up-again", "still-down"])
def test_after_its_pause_the_channel_is_used_again_once_the_drafter_says_it_is_up(comes_back):
    box, v, d = pair()
    box.down = True
    cfg = config(tree_channel=True)

    async def main():
        from router.loop import Router
        from tests.router.fakes import Tokenizer
        from tests.router.test_router_fakes import GREEDY, collect

        router = Router(v, d, Tokenizer(), cfg)
        router.start()
        try:
            first = await collect(router.submit(PROMPTS[0], GREEDY))
            assert router.counters.posted_trees == 0 and router._trees_off_until > 0
            box.down = not comes_back
            router._trees_off_until = router.counters.rounds   # its pause is over
            posted_before = len(box.trees)
            second = await collect(router.submit(PROMPTS[1], GREEDY))
            return router, [first, second], posted_before
        finally:
            await router.stop()
    router, outs, posted_before = run(main())
    assert_exact(outs, PROMPTS[:2])
    if comes_back:
        assert router.counters.posted_trees > 0 and router._trees_off_until == 0
    else:   # asked, still down: no round was sent to wait for trees that cannot come
        assert router.counters.posted_trees == 0 and len(box.trees) == posted_before == 0
        assert router._trees_off_until > router.counters.rounds
        assert d.calls.count("info") == 1


def test_a_restarted_drafter_reports_its_requests_unknown_and_they_resync():
    box, v, d = pair()

    def on_event(router, ev, req, data):
        if ev == "tokens" and router.counters.rounds == 4 and d.ctx:
            d.ctx.clear()   # a restart: it holds nothing; the next catch-ups name them unknown
    router, outs = run(serve(v, d, PROMPTS, cfg=config(tree_channel=True), on_event=on_event))
    assert_exact(outs)
    assert_clean(v, d)
    assert router.counters.posted_trees > 0
