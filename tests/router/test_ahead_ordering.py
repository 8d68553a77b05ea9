"""Router logic of "ahead" rounds over real engines behind in-process links (demo EAGLE-3 pair,
CPU, fp32): the drafter's call of a round (DraftAhead, carrying the catch-up held back from an
all-hit verdict) starts only once the verifier has queued its forward (VerifierLink.verify's
on_launch); a request whose verdict hit goes out with the tree the router held (no Draft call);
greedy tokens equal plain decoding's and both engines end holding nothing."""

from __future__ import annotations

import asyncio
import threading

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.link_harness import collect, drained


class Log:
    def __init__(self):
        self.events: list[str] = []
        self.lock = threading.Lock()

    def add(self, what: str) -> None:
        with self.lock:
            self.events.append(what)


class LoggingVerifier(LocalVerifierLink):
    def __init__(self, engine, log: Log):
        super().__init__(engine)
        self.log = log

    async def verify(self, draft, plain, want_features, on_launch=None):
        self.log.add("verify" if draft is not None else "plain")
        launch = None
        if on_launch is not None:
            def launch():
                self.log.add("launched")
                on_launch()
        return await super().verify(draft, plain, want_features, launch)


class LoggingDrafter(LocalDrafterLink):
    def __init__(self, engine, log: Log):
        super().__init__(engine)
        self.log = log

    async def draft(self, tags, num_steps=None, extend=()):
        self.log.add("draft")
        return await super().draft(tags, num_steps, extend)

    async def draft_ahead(self, tags, extend=()):
        self.log.add("ahead+extend" if extend else "ahead")
        return await super().draft_ahead(tags, extend)

    async def extend(self, items):
        self.log.add("extend")
        return await super().extend(items)


def test_ahead_rounds_order_and_ready_trees():
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4, ahead_width=4),
                           max_slots=4, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=4, max_len=256)
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[0]).ids
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    expected = plain.generate([prompt], [params])[0].token_ids
    log = Log()

    async def main():
        router = Router(LoggingVerifier(spec.verifier, log), LoggingDrafter(spec.drafter, log), spec.tokenizer,
                        RouterConfig(max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead,
                                     want_features=True, pipeline="ahead"))
        router.start()
        try:
            toks, _ = await collect(router, prompt, params)
            await drained(spec)
            return toks, router.counters
        finally:
            await router.stop()

    got, c = asyncio.run(main())
    assert got == expected
    ev = log.events
    # Split into rounds at each verify: a round's drafter work comes after its launch.
    starts = [i for i, e in enumerate(ev) if e == "verify"]
    assert starts and c.draft_ahead_hits > 0 and c.draft_ahead_misses > 0
    merged = 0
    for a, b in zip(starts, starts[1:] + [len(ev)]):
        round_ev = ev[a:b]
        assert round_ev[1] == "launched", round_ev
        # The drafter's call comes after the launch; after an all-hit verdict it carries that
        # verdict's held-back catch-up (one call), otherwise the catch-up went before the draft.
        assert round_ev[2] in ("ahead", "ahead+extend"), round_ev
        merged += round_ev[2] == "ahead+extend"
    assert merged == c.ready_trees   # batch 1: each router-held tree's round carried its catch-up
    # Batch 1: every hit's next round went out with the router's tree; a Draft call only after a miss
    # (and for the first round).
    assert c.ready_trees == c.draft_ahead_hits
    assert ev.count("draft") == 1 + c.draft_ahead_misses
    assert not spec.drafter.requests and spec.drafter.proposer.kv_stats()["used_blocks"] == 0
    assert not spec.verifier.requests
