"""Releases go to both engines at once (router/loop.py `_release`): a finished request's
verifier release does not wait for the drafter's, and both engines end up holding nothing. Fake engines (tests/router/fakes.py)."""

from __future__ import annotations

import asyncio

from router.loop import Router
from tests.router.fakes import OracleVerifier, ScriptedDrafter, Tokenizer, reference
from tests.router.test_router_fakes import GREEDY, PROMPTS, assert_clean, collect, config, run


class _SlowReleases(ScriptedDrafter):
    def __init__(self):
        super().__init__()
        self.releasing = 0

    async def release(self, request_ids, keep_draft=False, outputs=None):
        self.releasing += 1
        try:
            await asyncio.sleep(0.002)
            return await super().release(request_ids, keep_draft, outputs)
        finally:
            self.releasing -= 1


class _Watching(OracleVerifier):
    def __init__(self, drafter: _SlowReleases):
        super().__init__()
        self.drafter, self.overlapped = drafter, 0

    async def release(self, request_ids):
        await asyncio.sleep(0.001)
        self.overlapped += self.drafter.releasing > 0
        return await super().release(request_ids)


def _serve(learns: bool):
    drafter = _SlowReleases()
    verifier = _Watching(drafter)

    async def go():
        router = Router(verifier, drafter, Tokenizer(), config(drafter_learns_outputs=learns))
        router.start()
        try:
            outs = await asyncio.gather(*(collect(router.submit(p, GREEDY)) for p in PROMPTS))
            for _ in range(50):
                await asyncio.sleep(0.001)
        finally:
            await router.stop()
        return outs

    return verifier, drafter, run(go())


def test_releases_reach_both_engines_at_once():
    for learns in (False, True):
        verifier, drafter, outs = _serve(learns)
        for (tokens, _, reason), p in zip(outs, PROMPTS):
            assert tokens == reference(p, 40) and reason == "length"
        assert verifier.overlapped > 0
        assert_clean(verifier, drafter)
