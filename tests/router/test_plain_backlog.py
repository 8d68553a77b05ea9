"""Router logic: while requests are decoded plainly (speculation switched off, or "plain" in
auto), their drafter catch-ups are held back and handed over in one call, in order, with the
request's next draft; the drafter's engine absorbs them in one forward. Real engines behind
in-process links (the drafter link only counts what it is sent); greedy tokens must equal plain
decoding's, and both engines end with nothing held."""

from __future__ import annotations

import asyncio

from dataclasses import replace

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.requests import RouterConfig
from router.loop import BACKLOG_ROUNDS, Router
from spectandem.channel import ChannelRef
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


class DroppingDrafter(CountingDrafter):
    """Catch-ups whose later rounds' features "did not come over the feature channel": in a
    call that carries several rounds of one request, the features of the last are a reference
    to a channel message this drafter never got."""

    def __init__(self, engine):
        super().__init__(engine)
        self.dropped = 0

    def _drop(self, items):
        items, seen = list(items), set()
        for k in reversed(range(len(items))):
            rid = items[k].tag.request_id
            if rid not in seen and sum(i.tag.request_id == rid for i in items) > 1:
                items[k] = replace(items[k], features=ChannelRef(10**9, 0))
                self.dropped += 1
            seen.add(rid)
        return items

    async def extend(self, items):
        return await super().extend(self._drop(items))

    async def draft(self, tags, num_steps=None, extend=()):
        return await super().draft(tags, num_steps, self._drop(extend))


def _serve(dlink_type, off_rounds: int, max_tokens: int = 40):
    """The demo pair behind a router whose speculation goes off after every 4 drafted
    request-rounds (an acceptance length no draft reaches) for `off_rounds` rounds, then is tried
    again -> (tokens, plain decoding's tokens, the drafter link, the counters), both engines
    checked empty."""
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:4]]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    expected = [c.token_ids for c in plain.generate(prompts, [params] * len(prompts))]

    async def main():
        dlink = dlink_type(spec.drafter)
        router = Router(LocalVerifierLink(spec.verifier), dlink, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="sequential", adaptive_window=4, adaptive_min_accept_length=99.0,
            adaptive_off_rounds=off_rounds))
        router.start()
        try:
            got = [toks for toks, _ in await asyncio.gather(*(collect(router, p, params) for p in prompts))]
            await drained(spec)
            return got, dlink, router.counters
        finally:
            await router.stop()

    got, dlink, counters = asyncio.run(main())
    assert not spec.drafter.requests and spec.drafter.proposer.kv_stats()["used_blocks"] == 0
    assert not spec.verifier.requests
    return got, expected, dlink, counters


def test_plain_rounds_hold_back_catch_ups_and_tokens_stay_exact():
    got, expected, dlink, counters = _serve(CountingDrafter, off_rounds=3)
    extends = dlink.extends
    assert got == expected
    assert counters.plain_rounds > 0, "speculation should have been off for some rounds"
    assert counters.fallback_rounds == 0, "the drafter never failed: no round is a fallback"
    held_back = [ids for ids in extends if len(ids) > len(set(ids))]
    assert held_back, "a request's plain rounds should reach the drafter together, in one call"


def test_a_long_plain_stretch_sends_its_catch_ups_every_backlog_rounds():
    """Held-back features wait in the feature channel's bounded mailbox: a request never has more
    than BACKLOG_ROUNDS rounds held back, however long speculation stays off."""
    got, expected, dlink, counters = _serve(CountingDrafter, off_rounds=4 * BACKLOG_ROUNDS, max_tokens=80)
    assert got == expected
    assert counters.plain_rounds >= 2 * BACKLOG_ROUNDS, "speculation should have been off for long stretches"
    per_call = [max(ids.count(r) for r in ids) for ids in dlink.extends if ids]
    assert max(per_call) == BACKLOG_ROUNDS, per_call


def test_a_catch_up_whose_later_round_did_not_come_resyncs_the_request():
    """A call with several rounds of one request, the features of one of them lost on the way
    (dropped by the channel's mailbox): the drafter forgets the request and reports it unknown,
    the router prefills it again; nothing fails and the tokens stay exact."""
    got, expected, dlink, counters = _serve(DroppingDrafter, off_rounds=3)
    assert dlink.dropped > 0
    assert got == expected
