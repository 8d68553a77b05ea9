"""Chained verifies when a request joins mid-stream (router/loop.py, router/links_local.py):
a request submitted from the verifier link's worker right after a chained launch or a miss, before
the router has that verdict. The next round drafts both requests, so the drafter's pre-call the
verdict started answers no call; no catch-up is absorbed twice and both requests get plain
decoding's tokens. Real demo engines on the CPU (fp32)."""

from __future__ import annotations

import asyncio

import pytest

from router.links_local import LocalDrafterLink, LocalVerifierLink
from spectandem.config import SamplingParams
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.link_harness import collect, drained
from tests.router.test_chained_verify import _pair, _router


def _join_mid_stream(make_vlink, ahead_after_miss: bool = False):
    """Request a (64 tokens) through the router in "ahead", and request b (24) submitted from the
    verifier link's worker (`make_vlink(engine, join)` decides when it calls join()), on the
    event loop before the router has that verdict. Both get plain decoding's tokens, the drafter
    stays up (no catch-up absorbed twice: a stale tag would take it down), and everything is
    released -> (speculator, drafter link, verifier link)."""
    spec, plain = _pair()
    a, b = (spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:2])
    pa, pb = SamplingParams(max_tokens=64, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)
    expected = [plain.generate([a], [pa])[0].token_ids, plain.generate([b], [pb])[0].token_ids]
    dlink = LocalDrafterLink(spec.drafter)
    dlink.ahead_after_miss = ahead_after_miss
    joined: list = []

    async def main():
        loop = asyncio.get_running_loop()
        join = lambda: loop.call_soon_threadsafe(lambda: joined.append(asyncio.ensure_future(collect(router, b, pb))))
        vlink = make_vlink(spec.verifier, join)
        router = _router(spec, vlink, dlink)
        try:
            first = await collect(router, a, pa)
            got = [first[0], (await joined[0])[0]]
            await drained(spec)
            return got, router.drafter_up, vlink
        finally:
            await router.stop()

    got, drafter_up, vlink = asyncio.run(main())
    assert got == expected
    assert drafter_up, "the drafter was taken down"
    assert not dlink._absorbed and not spec.verifier.requests and not spec.drafter.requests
    return spec, dlink, vlink


class _JoinAfterLaunch(LocalVerifierLink):
    """Calls `join()` from its worker right after its `join_at`-th chained launch (and the
    pre-ahead that launch starts), before the router has that verdict."""

    def __init__(self, engine, join_at: int, join):
        super().__init__(engine, chain=True)
        self.join_at, self.join = join_at, join

    def arm_next(self, tags, then=None, missed=None):
        def then_and_join(results):
            out = then(results) if then is not None else None
            if self.chained_launches == self.join_at:
                self.join()
            return out
        return super().arm_next(tags, then_and_join, missed)


def test_pre_ahead_not_claimed_when_a_request_joins():
    """A request that arrives right after a chained launch: the next round drafts both afresh,
    so the drafter's pre-ahead that launch started answers no call. The catch-up it absorbed is
    not absorbed again (that would be a stale tag and take the drafter down), and both
    requests still get plain decoding's tokens."""
    spec, dlink, vlink = _join_mid_stream(lambda engine, join: _JoinAfterLaunch(engine, 3, join))
    assert vlink.chained_launches >= 3 and 0 < dlink.pre_ahead_used < vlink.chained_launches


class _JoinAfterMiss(LocalVerifierLink):
    """Calls `join()` from its worker right after the first armed verdict with no tree (and the
    pre-draft it starts), before the router has that verdict."""

    def __init__(self, engine, join):
        super().__init__(engine, chain=True)
        self.join, self.missed = join, 0

    def arm_next(self, tags, then=None, missed=None):
        def missed_and_join(results):
            out = missed(results) if missed is not None else None
            self.missed += 1
            if self.missed == 1:
                self.join()
            return out
        return super().arm_next(tags, then, missed_and_join)


@pytest.mark.parametrize("ahead_after_miss", [False, True], ids=["pre-draft", "ahead-after-miss"])
def test_pre_draft_not_claimed_when_a_request_joins(ahead_after_miss):
    """A request that arrives right after a miss: the next round drafts both, so the pre-draft the
    miss started answers no call. Its catch-up is not absorbed again (a stale tag would take the
    drafter down), the draft runs afresh, and both requests get plain decoding's tokens. The
    pre-ahead queued behind that pre-draft (ahead_after_miss) answers no call either."""
    spec, dlink, vlink = _join_mid_stream(_JoinAfterMiss, ahead_after_miss)
    assert vlink.missed >= 1 and dlink.pre_draft_used < dlink.pre_drafts
    assert dlink.ahead_after_miss_used < dlink.pre_drafts
