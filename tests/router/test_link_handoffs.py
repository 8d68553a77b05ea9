"""A pre-ahead's trees reach the router's stager exactly once, as soon as they are on the host,
whichever comes first: the trees (from the drafter's thread) or the router's claim."""

import asyncio
import threading

from router.link_handoffs import PreAhead
from spectandem.protocol import AheadReply, Tag


def _job() -> PreAhead:
    return PreAhead([Tag("a", 0, 5)], [])


def test_trees_before_the_claim_are_given_at_the_claim():
    job, got = _job(), []
    job.trees_ready([{(1,): "tree"}])
    job.finish(AheadReply([True], [{(1,): "tree"}], []))
    reply = asyncio.run(job.result(got.append))
    assert got == [[{(1,): "tree"}]] and reply.hits == [True]


def test_a_claim_before_the_trees_gets_them_from_the_call_before_it_is_done():
    job, got = _job(), []
    seen_done = []

    async def main():
        def stage(trees):
            got.append(trees)
            seen_done.append(job.done)
        task = asyncio.ensure_future(job.result(stage))
        await asyncio.sleep(0.01)                 # the claim is registered, the call still runs
        assert got == []
        worker = threading.Thread(target=lambda: (job.trees_ready([{(2,): "t"}]),
                                                  job.finish(AheadReply([False], [{(2,): "t"}], []))))
        worker.start()
        reply = await task
        worker.join()
        return reply

    reply = asyncio.run(main())
    assert got == [[{(2,): "t"}]]                 # once, not again at the finish
    assert seen_done == [False]                   # staged before the call was done
    assert reply.hits == [False]


def test_a_failed_call_stages_nothing():
    job, got = _job(), []

    async def main():
        task = asyncio.ensure_future(job.result(got.append))
        await asyncio.sleep(0.01)
        job.finish(None)
        return await task

    assert asyncio.run(main()) is None and got == []


# A pre-call says when its drafting is on the device (`wait_queued`): the verifier's worker
# holds the verdict back from the router until then (router/links_local.py DRAFTER_FIRST_S).

def test_wait_queued_waits_for_the_mark_or_the_finish():
    job = _job()
    assert job.wait_queued(0.01) is False          # neither yet: it times out
    job.mark_queued()
    assert job.wait_queued(0.0) is True and not job.done
    other = _job()
    other.finish(None)                              # a call that ends (or fails) unmarked counts too
    assert other.wait_queued(0.0) is True


def test_when_queued_runs_once_at_the_mark_or_the_finish():
    job, calls = _job(), []
    job.when_queued(lambda: calls.append("a"))
    assert calls == []
    job.mark_queued()
    job.mark_queued()                               # a second mark runs nothing again
    assert calls == ["a"]
    job.when_queued(lambda: calls.append("b"))      # already queued: at once
    assert calls == ["a", "b"]
    other = _job()
    other.when_queued(lambda: calls.append("c"))
    other.finish(None)                              # ended unmarked (or failed): it runs then
    assert calls == ["a", "b", "c"]


class _Drafter:
    """A drafter engine stand-in for the link's pre-call thread: its draft ahead queues its
    device work (`device_work_queued`, as the draft graphs do), then blocks until released."""

    def __init__(self):
        self.requests, self.release = {"a": object()}, threading.Event()

    def check_tag(self, request_id, epoch, committed_len):
        return None

    def draft_ahead(self, ids):
        from spectandem.devices import device_work_queued

        device_work_queued()
        assert self.release.wait(5)
        return [True]

    def outcome_trees(self, ids):
        return [None] * len(ids)


def test_a_pre_ahead_is_queued_before_it_is_done():
    from router.links_local import LocalDrafterLink

    engine = _Drafter()
    link = LocalDrafterLink(engine)
    job = link.pre_ahead([Tag("a", 0, 5)], [])
    assert job.wait_queued(5) and not job.done      # marked from inside the engine call
    engine.release.set()
    assert asyncio.run(job.result()).hits == [True]


def test_the_chain_draft_ahead_marks_its_work_queued():
    """The real demo drafter (eagle3, fp32 on the CPU): a chain draft ahead runs its pass and
    marks it queued once, on the thread that set the hook."""
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths
    from spectandem.devices import on_queued
    from router.local import LocalSpeculator
    from tests.drafter.lockstep import prefilled
    from tests.e2e.conftest import PROMPT_TEXTS

    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3", num_steps=3, topk=1,
                                                              num_draft_tokens=4, ahead_width=4),
                           max_slots=2, max_len=256)
    rids = prefilled((spec,), PROMPT_TEXTS[:1])
    marks = []
    spec.drafter.draft(rids)
    with on_queued(lambda: marks.append(threading.current_thread().name)):
        spec.drafter.draft_ahead(rids)
    assert marks == [threading.current_thread().name]
    assert spec.drafter.requests[rids[0]].outcomes is not None     # it did draft ahead


class _MissDrafter(_Drafter):
    """The stand-in with a catch-up and a draft (a miss's pre-draft), each call logged; its
    draft waits for `drafting` (the test registers the verifier's taker first)."""

    def __init__(self):
        super().__init__()
        self.calls, self.drafting = [], threading.Event()

    def extend(self, outputs):
        self.calls.append(("extend", [o.request_id for o in outputs]))

    def draft(self, ids, num_steps=None, on_device=None):
        assert self.drafting.wait(5)
        self.calls.append(("draft", ids))
        return "tree"

    def draft_ahead(self, ids):
        self.calls.append(("ahead", ids))
        return super().draft_ahead(ids)


def _missed(launched: bool):
    """A miss's pre-draft on the link (ahead_after_miss on) whose tree the verifier's taker
    launches or not -> (engine, link, its tags, its catch-up item)."""
    from spectandem.protocol import ExtendItem
    from router.links_local import LocalDrafterLink

    engine = _MissDrafter()
    link = LocalDrafterLink(engine)
    link.ahead_after_miss = True
    tags, item = [Tag("a", 0, 5)], ExtendItem(Tag("a", 0, 5), [7, 8], None)
    job = link.pre_draft(tags, [item])
    job.on_ready(lambda tree: launched)         # LocalVerifierLink._launch_missed's answer
    engine.drafting.set()
    return engine, link, tags, item


def test_a_launched_miss_tree_gets_its_draft_ahead_from_the_worker():
    """The router's extend of the miss returns once the pre-draft absorbed it, while the
    pre-ahead queued behind it still runs; the router's draft and draft-ahead calls take the
    pre-calls' replies, and the engine ran each step once, in order."""
    engine, link, tags, item = _missed(launched=True)

    async def main():
        unknown = await asyncio.wait_for(link.extend([item]), 5)   # the pre-ahead is still blocked
        assert not link._last_pre.done and not engine.release.is_set()
        tree = (await link.draft(tags)).payload
        engine.release.set()
        reply = await link.draft_ahead(tags, [])
        return unknown, tree, reply

    unknown, tree, reply = asyncio.run(main())
    assert unknown == [] and tree == "tree" and reply.hits == [True]
    assert engine.calls == [("extend", ["a"]), ("draft", ["a"]), ("ahead", ["a"])]
    assert link.pre_draft_used == link.ahead_after_miss_used == 1 and link.pre_ahead_used == 0


def test_a_miss_tree_not_launched_gets_no_draft_ahead_from_the_worker():
    """Not launched at once (the router's verify launches it): the pre-ahead skips its work and
    the router's own draft-ahead call drafts ahead, once."""
    engine, link, tags, item = _missed(launched=False)
    engine.release.set()

    async def main():
        assert await link.extend([item]) == []
        await link.draft(tags)
        return await link.draft_ahead(tags, [])

    assert asyncio.run(main()).hits == [True]
    assert engine.calls == [("extend", ["a"]), ("draft", ["a"]), ("ahead", ["a"])]
    assert link.ahead_after_miss_used == 0 and link.pre_draft_used == 1
