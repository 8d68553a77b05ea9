"""Ended requests are released without holding up the next round (router/loop.py
`_release_finished`, `_release_soon`): where the next round fits both KV pools with them still
held, the round's draft goes first and the releases run beside it; a prefill waits for them; where
the pools are too tight, they come first, as before. Fake engines (tests/router/fakes.py)."""

from __future__ import annotations

import asyncio

from router.loop import Router
from spectandem.config import SamplingParams
from tests.router.fakes import OracleVerifier, ScriptedDrafter, Tokenizer, reference
from tests.router.test_router_fakes import assert_clean, collect, config, run

SHORT, LONG = SamplingParams(max_tokens=6, ignore_eos=True), SamplingParams(max_tokens=40, ignore_eos=True)


class _Drafter(ScriptedDrafter):
    def __init__(self, log):
        super().__init__()
        self.log = log

    async def draft(self, tags, num_steps=None, extend=()):
        self.log.append(("draft", tuple(t.request_id for t in tags)))
        return await super().draft(tags, num_steps, extend)

    async def release(self, request_ids, keep_draft=False, outputs=None):
        self.log.append(("drafter release", tuple(request_ids)))
        await asyncio.sleep(0.002)
        return await super().release(request_ids, keep_draft, outputs)


class _Verifier(OracleVerifier):
    def __init__(self, log):
        super().__init__()
        self.log = log

    async def prefill(self, items, want_features):
        self.log.append(("prefill", tuple(i.tag.request_id for i in items)))
        # An id the verifier still holds, or a prefill while a release is under way, is an error.
        return await super().prefill(items, want_features)

    async def verify(self, draft, plain, want_features, on_launch=None):
        ids = (tuple(draft.tags) if draft is not None else ()) + tuple(i.tag for i in plain)
        self.log.append(("verify", tuple(t.request_id for t in ids)))
        return await super().verify(draft, plain, want_features, on_launch)

    async def release(self, request_ids):
        self.log.append(("verifier release", tuple(request_ids)))
        await asyncio.sleep(0.002)
        return await super().release(request_ids)


def _serve(tight: bool = False, more: bool = False):
    """Serves a short request beside a long one (and, with `more`, a third whose prompt arrives
    once the short one has ended) -> (the call log, the outputs, the engines)."""
    log: list = []
    verifier, drafter = _Verifier(log), _Drafter(log)

    async def go():
        router = Router(verifier, drafter, Tokenizer(), config())
        if tight:   # pools that cannot hold an ended request beside the running ones
            fits, release_finished = router.kv.fits, router._release_finished

            def no_room(*args):   # the check of `_release_finished`, once
                router.kv.fits = fits
                return False

            async def tight_release_finished():
                if any(r.done for r in router.running):
                    router.kv.fits = no_room
                await release_finished()
                router.kv.fits = fits
            router._release_finished = tight_release_finished
        router.start()
        try:
            short = router.submit([5, 9, 2], SHORT, "short")
            long = router.submit([1, 1, 4, 7, 3], LONG, "long")
            outs = [asyncio.ensure_future(collect(r)) for r in (short, long)]
            await outs[0]
            if more:
                outs.append(asyncio.ensure_future(collect(router.submit([60, 2], SHORT, "short"))))   # its id again
            outs = await asyncio.gather(*outs)
            for _ in range(50):
                await asyncio.sleep(0.001)
        finally:
            await router.stop()
        return outs

    return log, run(go()), verifier, drafter


def _after_last_verify_of(log, rid):
    last = max(i for i, (what, ids) in enumerate(log) if what == "verify" and rid in ids)
    return log[last + 1:]


def test_the_next_draft_goes_before_the_release_of_an_ended_request():
    log, outs, verifier, drafter = _serve()
    assert [o[0] for o in outs] == [reference([5, 9, 2], 6), reference([1, 1, 4, 7, 3], 40)]
    after = _after_last_verify_of(log, "short")
    assert after[0] == ("draft", ("long",)), after[:4]
    assert ("verifier release", ("short",)) in after and ("drafter release", ("short",)) in after
    assert_clean(verifier, drafter)


def test_a_prefill_waits_for_the_releases_and_an_id_waits_for_its_own():
    log, outs, verifier, drafter = _serve(more=True)
    assert [o[0] for o in outs] == [reference([5, 9, 2], 6), reference([1, 1, 4, 7, 3], 40), reference([60, 2], 6)]
    i = log.index(("prefill", ("short",)), 1)   # the second request named "short"
    before = log[:i]
    assert ("verifier release", ("short",)) in before and ("drafter release", ("short",)) in before
    assert verifier.errors == [] and drafter.errors == []
    assert_clean(verifier, drafter)


def test_pools_too_tight_to_hold_an_ended_request_release_it_first():
    log, outs, verifier, drafter = _serve(tight=True)
    assert [o[0] for o in outs] == [reference([5, 9, 2], 6), reference([1, 1, 4, 7, 3], 40)]
    after = _after_last_verify_of(log, "short")
    assert {after[0], after[1]} == {("verifier release", ("short",)), ("drafter release", ("short",))}, after[:4]
    assert after[2] == ("draft", ("long",)), after[:4]
    assert_clean(verifier, drafter)


def test_a_verify_carrying_prefills_waits_for_the_verifiers_releases_only():
    """The drafter's release of an ended request queues behind the round's draft on the drafter;
    a verify that prefills a new request needs only the verifier's KV freed. The drafter's own
    prefill of the new request still waits for the drafter's release."""
    log: list = []

    class SlowReleasingDrafter(_Drafter):
        async def release(self, request_ids, keep_draft=False, outputs=None):
            self.log.append(("drafter release", tuple(request_ids)))
            await asyncio.sleep(0.02)   # within config()'s drafter_timeout
            self.log.append(("drafter released", tuple(request_ids)))
            return await ScriptedDrafter.release(self, request_ids, keep_draft, outputs)

        async def prefill(self, items):
            self.log.append(("drafter prefill", tuple(i.tag.request_id for i in items)))
            return await super().prefill(items)

    verifier, drafter = _Verifier(log), SlowReleasingDrafter(log)

    async def go():
        router = Router(verifier, drafter, Tokenizer(), config())
        router.start()
        try:
            short = router.submit([5, 9, 2], SHORT, "short")
            long = router.submit([1, 1, 4, 7, 3], LONG, "long")
            outs = [asyncio.ensure_future(collect(r)) for r in (short, long)]
            await outs[0]
            while ("drafter release", ("short",)) not in log:
                await asyncio.sleep(0.001)
            outs.append(asyncio.ensure_future(collect(router.submit([60, 2], LONG, "third"))))
            outs = await asyncio.gather(*outs)
            await router._releases_landed()
        finally:
            await router.stop()
        return outs

    outs = run(go())
    assert [o[0] for o in outs] == [reference([5, 9, 2], 6), reference([1, 1, 4, 7, 3], 40), reference([60, 2], 40)]
    prefilled = log.index(("prefill", ("third",)))          # in the verify step (mixed prefill)
    released = log.index(("drafter released", ("short",)))
    assert log.index(("verifier release", ("short",))) < prefilled < released, log
    assert released < log.index(("drafter prefill", ("third",))), log
    assert_clean(verifier, drafter)


_LANDED_WAIT = """
import asyncio
import sys
from router.loop import Router
from tests.router.fakes import OracleVerifier, ScriptedDrafter, Tokenizer
from tests.router.test_router_fakes import config

if sys.version_info < (3, 12):
    # Python 3.12's gather: where every child is done, the outer future is done at once, so that
    # awaiting it does not yield to the event loop. Before 3.12 it always yielded.
    plain_gather = asyncio.gather

    def gather(*children, return_exceptions=False):
        if children and all(isinstance(c, asyncio.Future) and c.done() for c in children):
            outer = asyncio.get_running_loop().create_future()
            outer.set_result([c.exception() or c.result() if return_exceptions else c.result() for c in children])
            return outer
        return plain_gather(*children, return_exceptions=return_exceptions)

    asyncio.gather = gather

async def go():
    router = Router(OracleVerifier(), ScriptedDrafter(), Tokenizer(), config())
    loop = asyncio.get_running_loop()
    for side in ("verifier", "drafter", None):
        pending = router._releasing if side is None else router._releasing_on[side]
        landed = loop.create_future()
        pending.add(landed)
        landed.add_done_callback(pending.discard)
        landed.set_result(None)   # landed; the callback that takes it out of `pending` is still queued
        await router._releases_landed(side)
        assert not pending, (side, pending)
    print("returned")

asyncio.run(go())
"""


def test_waiting_for_releases_returns_when_they_landed_but_their_callbacks_are_queued():
    """A prefill waits for the releases under way on its engine (`_releases_landed`). A release
    that has just landed stays in the set until its done callback runs on the event loop; the
    wait must let that callback run rather than wait again on the done task, which returns
    without yielding to the loop and so would spin for good (a served GPU once stopped this way in
    its warm-up, every thread idle but the loop's). In a process of its own, bounded in time, with
    Python 3.12's gather on older Pythons."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    try:
        done = subprocess.run([sys.executable, "-c", _LANDED_WAIT], cwd=root, capture_output=True, text=True,
                              timeout=30)
    except subprocess.TimeoutExpired:
        raise AssertionError("the wait for landed releases never returned") from None
    assert done.returncode == 0 and done.stdout.strip() == "returned", done.stderr[-2000:]
