"""A pre-ahead's trees reach the router's stager exactly once, as soon as they are on the host,
whichever comes first: the trees (from the drafter's thread) or the router's claim."""

import asyncio
import threading

from router.link_handoffs import PreAhead
from router.links import AheadReply, Tag


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
