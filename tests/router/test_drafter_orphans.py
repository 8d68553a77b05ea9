"""Router logic: a drafter that was only slow still holds the requests the router gave up on.
Once it answers again, the router releases those that have finished, so its KV returns to
baseline. Real engines behind in-process links; the drafter link is made slow once (a fake
used only for this router-logic test)."""

from __future__ import annotations

import asyncio
import time

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.loop import Router
from router.requests import RouterConfig
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS


class SlowOnce(LocalDrafterLink):
    """Its third draft call takes longer than the router waits, and it answers nothing else
    (not even health probes) until that call is over."""

    def __init__(self, engine):
        super().__init__(engine)
        self.calls = 0
        self.stuck_until = 0.0

    @property
    def stuck(self) -> bool:
        return time.monotonic() < self.stuck_until

    async def draft(self, tags, num_steps=None, extend=()):
        self.calls += 1
        if self.calls == 3:
            self.stuck_until = time.monotonic() + 3.0
            await asyncio.sleep(3.0)          # the router stops waiting long before
        return await super().draft(tags, num_steps, extend)

    async def info(self):
        if self.stuck:
            await asyncio.sleep(1.0)
        return await super().info()


def test_finished_requests_are_released_on_a_drafter_that_comes_back():
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:3]]
    expected = spec.generate(prompts, [SamplingParams(max_tokens=16)] * 3)

    async def main():
        dlink = SlowOnce(spec.drafter)
        router = Router(LocalVerifierLink(spec.verifier), dlink, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="sequential", drafter_timeout=0.2, probe_interval=0.05))
        router.start()

        async def run(prompt):
            req = router.submit(prompt, SamplingParams(max_tokens=16))
            toks = []
            while True:
                ev = await req.events.get()
                toks += ev.token_ids
                if ev.finish_reason:
                    return toks
        try:
            got = await asyncio.gather(*(run(p) for p in prompts))
            assert router.counters.fallback_rounds > 0          # the slow call made the router go on without it
            held = set(spec.drafter.requests)
            assert held, "the slow drafter should still hold the requests it was given"
            assert dlink.stuck                                  # they all finished while it was stuck
            await asyncio.sleep(3.1)                            # the slow call finishes
            more = await run(prompts[0])                        # the next work probes the drafter again
            for _ in range(50):
                if not spec.drafter.requests:
                    break
                await asyncio.sleep(0.02)
            return got, more
        finally:
            await router.stop()

    got, more = asyncio.run(main())
    assert got == [e.token_ids for e in expected] and more == expected[0].token_ids
    assert not spec.drafter.requests and spec.drafter.proposer.kv_stats()["used_blocks"] == 0
