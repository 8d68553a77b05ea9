"""Router logic: while requests are decoded plainly (speculation switched off, or "plain" in
auto), their drafter catch-ups are held back and handed over in one call, in order, with the
request's next draft; the drafter's engine absorbs them in one forward. Real engines behind
in-process links (the drafter link only counts what it is sent); greedy tokens must equal plain
decoding's, and both engines end with nothing held."""

from __future__ import annotations

import asyncio

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.link_harness import collect, drained


class CountingDrafter(LocalDrafterLink):
    def __init__(self, engine):
        super().__init__(engine)
        self.extends: list[list[str]] = []      # request ids of each call's catch-up, in order

    async def extend(self, items):
        self.extends.append([i.tag.request_id for i in items])
        return await super().extend(items)

    async def draft(self, tags, num_steps=None, extend=()):
        if extend:
            self.extends.append([i.tag.request_id for i in extend])
        return await super().draft(tags, num_steps, extend)


def test_plain_rounds_hold_back_catch_ups_and_tokens_stay_exact():
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:4]]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [c.token_ids for c in plain.generate(prompts, [params] * len(prompts))]

    async def main():
        dlink = CountingDrafter(spec.drafter)
        # An acceptance length no draft reaches: speculation goes off after every 4 drafted
        # request-rounds, for 3 rounds, then is tried again.
        router = Router(LocalVerifierLink(spec.verifier), dlink, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="sequential", adaptive_window=4, adaptive_min_accept_length=99.0, adaptive_off_rounds=3))
        router.start()

        try:
            got = [toks for toks, _ in await asyncio.gather(*(collect(router, p, params) for p in prompts))]
            await drained(spec)
            return got, dlink.extends, router.counters
        finally:
            await router.stop()

    got, extends, counters = asyncio.run(main())
    assert got == expected
    assert counters.plain_rounds > 0, "speculation should have been off for some rounds"
    assert counters.fallback_rounds == 0, "the drafter never failed: no round is a fallback"
    held_back = [ids for ids in extends if len(ids) > len(set(ids))]
    assert held_back, "a request's plain rounds should reach the drafter together, in one call"
    assert not spec.drafter.requests and spec.drafter.proposer.kv_stats()["used_blocks"] == 0
    assert not spec.verifier.requests
