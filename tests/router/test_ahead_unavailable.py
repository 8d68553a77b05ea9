""""auto" stops offering "ahead" when the drafter never drafts ahead (its draft_ahead replies
say neither hit nor miss, round after round), and keeps offering it when the drafter does. Real
engines: the tiny 8B-shaped target and EAGLE-3 head on the CPU, behind the router."""

from __future__ import annotations

import asyncio

import pytest
import torch

from benchmarks.bench import router8b as br


@pytest.fixture(scope="module")
def runs():
    from benchmarks.bench.llama8b import ControlledRuns, llama8b_spec, random_eagle3_head, random_target

    model = random_target(llama8b_spec("tiny"), "cpu", torch.float32, 0)
    head = random_eagle3_head(model, 256, "cpu", torch.float32, 0)
    return ControlledRuns(model, head, "cpu", 2, 2, 16, 48, 3, 0)


def _serve_one(s, runs) -> None:
    async def go():
        s.router.start()
        try:
            for k in range(2):
                await br._timed(s, runs, [f"r{k}"], [k % runs.num_prompts])
        finally:
            await s.router.stop()
    asyncio.run(go())


def test_a_drafter_that_never_drafts_ahead_loses_the_ahead_candidate(runs):
    from drafter.engine import DrafterEngine
    from router.links_local import LocalDrafterLink
    from drafter.controlled import ControlledProposer

    s = br._setup(runs, 0.8, "auto", 1)
    # A controlled proposer told not to draft ahead: its draft_ahead replies are all None.
    s.router.drafter = LocalDrafterLink(DrafterEngine(ControlledProposer(runs.inner, s.plans, ahead=False), runs.cfg))
    s.links = (s.links[0], s.router.drafter)
    assert "ahead" in s.router._modes.candidates(1)
    _serve_one(s, runs)
    assert s.router.counters.draft_ahead_hits == s.router.counters.draft_ahead_misses == 0
    assert s.router._modes.candidates(1) == ("sequential", "plain")


def test_a_drafter_that_drafts_ahead_keeps_it(runs):
    from drafter.engine import DrafterEngine
    from router.links_local import LocalDrafterLink

    s = br._setup(runs, 0.8, "auto", 1)
    # The same router over the real EAGLE-3 proposer (drafts ahead); its drafts are its own.
    s.router.drafter = LocalDrafterLink(DrafterEngine(runs.inner, runs.cfg))
    s.links = (s.links[0], s.router.drafter)
    s.acceptance_rate = None                       # no plans to write; tokens are still the target's

    async def go():
        from router.loop import StreamEvent

        s.router.start()
        try:
            for k in range(2):
                req = s.router.submit(runs.prompts[k], runs.params, request_id=f"a{k}")
                while not (ev := await req.events.get()).finish_reason:
                    assert isinstance(ev, StreamEvent)
        finally:
            await s.router.stop()
    asyncio.run(go())
    c = s.router.counters
    assert c.draft_ahead_hits + c.draft_ahead_misses > 0
    assert "ahead" in s.router._modes.candidates(1)
