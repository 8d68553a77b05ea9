"""Admission beside the draft (router/loop.py `_admits_beside_draft`): requests that arrive while
others run are prefilled on the verifier while the drafter drafts for the running ones, join
that round's verify as plain rows, and are prefilled on the drafter while the verifier verifies.
Mixed prefill (tests/router/test_mixed_prefill.py) is off here: it would take those requests.
Fake engines (tests/router/fakes.py): the drafter's draft takes a little while, and the verifier
notes whether a draft was in flight at each prefill; then the real demo pair."""

from __future__ import annotations

import asyncio
import threading
import time

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.local import LocalSpeculator
from router.loop import Router
from router.requests import Failure, RouterConfig
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.fakes import OracleVerifier, ScriptedDrafter, Tokenizer, reference
from tests.router.link_harness import collect as collect_one, drained
from tests.router.test_router_fakes import GREEDY, assert_clean, collect, config, run

EARLY = [[5, 9, 2], [1, 1, 4, 7, 3]]
LATE = [[60, 2], [8, 8, 8, 8], [33], [12, 40, 3, 9, 9, 1]]


class SlowDrafter(ScriptedDrafter):
    """Drafts take `delay` seconds; `drafting` says whether one is in flight."""

    def __init__(self, delay: float = 0.003, **kw):
        super().__init__(**kw)
        self.delay, self.drafting = delay, False

    async def draft(self, tags, num_steps=None, extend=()):
        self.drafting = True
        try:
            await asyncio.sleep(self.delay)
            return await super().draft(tags, num_steps, extend)
        finally:
            self.drafting = False


class WatchingVerifier(OracleVerifier):
    """Prefills take a millisecond; records, per prefill, whether the drafter was drafting then; `fail_prefill_beside_draft`: the
    first prefill made while the drafter drafts finds the verifier down."""

    def __init__(self, drafter: SlowDrafter, fail_prefill_beside_draft: bool = False):
        super().__init__()
        self.drafter, self.fail = drafter, fail_prefill_beside_draft
        self.prefills: list[tuple[list[str], bool]] = []   # (request ids, a draft was in flight)

    async def prefill(self, items, want_features):
        await asyncio.sleep(0.001)   # in flight a while, as a real prefill is
        beside = self.drafter.drafting
        self.prefills.append(([i.tag.request_id for i in items], beside))
        if beside and self.fail:
            self.down = True
        return await super().prefill(items, want_features)


async def _serve_staggered(verifier, drafter, cfg, late_params=GREEDY):
    """EARLY first; LATE once the early ones have run a few rounds. -> (router, early outs, late outs)."""
    router = Router(verifier, drafter, Tokenizer(), cfg)
    router.start()
    try:
        early = [router.submit(p, GREEDY, f"early-{i}") for i, p in enumerate(EARLY)]
        while router.counters.rounds < 3:
            await asyncio.sleep(0.001)
        late = [router.submit(p, late_params, f"late-{i}") for i, p in enumerate(LATE)]
        outs = await asyncio.gather(*(collect(r) for r in early + late))
        for _ in range(50):
            await asyncio.sleep(0)
    finally:
        await router.stop()
    return router, outs[: len(early)], outs[len(early):]


def _late_prefills(verifier) -> list[bool]:
    return [beside for ids, beside in verifier.prefills if any(i.startswith("late-") for i in ids)]


def test_late_requests_prefill_while_the_drafter_drafts_and_stay_exact():
    drafter = SlowDrafter()
    verifier = WatchingVerifier(drafter)
    router, early, late = run(_serve_staggered(verifier, drafter, config(admit_beside_draft=True, mixed_prefill=False)))
    for (tokens, _, reason), p in zip(early + late, EARLY + LATE):
        assert tokens == reference(p, 40) and reason == "length", p
    assert _late_prefills(verifier) and all(_late_prefills(verifier))
    assert router.counters.draft_tokens > 0
    # The new requests' plain row in the round they joined is a plain round, never a fallback,
    # whenever their drafter prefill lands; every round of the others and every later one of theirs drafted.
    assert router.counters.plain_rounds == len(LATE) and router.counters.fallback_rounds == 0
    assert_clean(verifier, drafter)


def test_without_admit_beside_draft_admission_comes_first():
    """Negative control: the same run with the setting off never prefills beside a draft."""
    drafter = SlowDrafter()
    verifier = WatchingVerifier(drafter)
    _, early, late = run(_serve_staggered(verifier, drafter, config(admit_beside_draft=False, mixed_prefill=False)))
    for (tokens, _, _), p in zip(early + late, EARLY + LATE):
        assert tokens == reference(p, 40), p
    assert _late_prefills(verifier) and not any(_late_prefills(verifier))
    assert_clean(verifier, drafter)


async def _serve_behind(verifier, drafter, cfg, running: int):
    """`running` requests first (longer ones, so they still run), LATE once they ran a few rounds."""
    router = Router(verifier, drafter, Tokenizer(), cfg)
    router.start()
    long = SamplingParams(max_tokens=60, ignore_eos=True)
    try:
        early = [router.submit([3 + i % 50, 7, 1 + i % 9], long, f"early-{i}") for i in range(running)]
        while router.counters.rounds < 3:
            await asyncio.sleep(0.001)
        late = [router.submit(p, GREEDY, f"late-{i}") for i, p in enumerate(LATE)]
        outs = await asyncio.gather(*(collect(r) for r in early + late))
    finally:
        await router.stop()
    return router, outs[len(early):]


def test_from_a_large_batch_new_requests_ride_in_the_verify_step_instead():
    """From LARGE_BATCH running requests on, admission goes into the round's verify step (mixed
    prefill), never beside a draft; below it (control) the same late requests are admitted beside
    drafts. Outputs stay exact either way."""
    from router.pipeline import LARGE_BATCH

    for running, beside in ((LARGE_BATCH, False), (LARGE_BATCH // 4, True)):
        drafter = SlowDrafter()
        verifier = WatchingVerifier(drafter)
        router, late = run(_serve_behind(verifier, drafter, config(admit_beside_draft=True, mixed_prefill=True),
                                         running))
        for (tokens, _, reason), p in zip(late, LATE):
            assert tokens == reference(p, 40) and reason == "length", p
        assert bool(router.counters.mixed_prefills) is not beside, running
        assert any(_late_prefills(verifier)) is beside, running
        assert_clean(verifier, drafter)


def test_a_request_that_ends_at_its_first_token_beside_a_draft():
    """max_tokens=1: the request ends at admission, is released, and is not in the round's verify."""
    drafter = SlowDrafter()
    verifier = WatchingVerifier(drafter)
    _, early, late = run(_serve_staggered(verifier, drafter, config(admit_beside_draft=True, mixed_prefill=False),
                                        SamplingParams(max_tokens=1, ignore_eos=True)))
    for (tokens, _, _), p in zip(early, EARLY):
        assert tokens == reference(p, 40)
    for (tokens, _, reason), p in zip(late, LATE):
        assert tokens == reference(p, 1) and reason == "length", p
    assert any(_late_prefills(verifier))
    assert_clean(verifier, drafter)


def test_the_verifier_failing_at_a_prefill_beside_a_draft_fails_every_request():
    drafter = SlowDrafter()
    verifier = WatchingVerifier(drafter, fail_prefill_beside_draft=True)
    router, early, late = run(_serve_staggered(verifier, drafter, config(admit_beside_draft=True, mixed_prefill=False)))
    for _, _, reason in early + late:
        assert isinstance(reason, Failure) and reason.code == "UNAVAILABLE"
    assert not router.serving and router.running == [] and router.waiting == []
    assert drafter.errors == [] and verifier.errors == []


def test_the_drafter_failing_during_the_draft_leaves_the_new_requests_plain_and_exact():
    """The draft beside the admission times out: the round goes on without drafts, the new
    requests are not prefilled on the drafter then, and every output is still the target's."""
    drafter = SlowDrafter()
    verifier = WatchingVerifier(drafter)

    async def go():
        router = Router(verifier, drafter, Tokenizer(), config(admit_beside_draft=True, mixed_prefill=False))
        router.start()
        try:
            early = [router.submit(p, GREEDY, f"early-{i}") for i, p in enumerate(EARLY)]
            while router.counters.rounds < 3:
                await asyncio.sleep(0.001)
            drafter.delay = 1.0   # past drafter_timeout (0.05 s)
            late = [router.submit(p, GREEDY, f"late-{i}") for i, p in enumerate(LATE)]
            while router.drafter_up:
                await asyncio.sleep(0.001)
            drafter.delay = 0.003
            outs = await asyncio.gather(*(collect(r) for r in early + late))
            for _ in range(50):
                await asyncio.sleep(0)
        finally:
            await router.stop()
        return router, outs

    router, outs = run(go())
    for (tokens, _, reason), p in zip(outs, EARLY + LATE):
        assert tokens == reference(p, 40) and reason == "length", p
    assert router.counters.drafter_outages >= 1
    assert any(_late_prefills(verifier))
    assert drafter.errors == [] and verifier.errors == []


class _DraftWatch(LocalDrafterLink):
    def __init__(self, engine):
        super().__init__(engine)
        self.drafting = self.started = 0

    async def draft(self, tags, num_steps=None, extend=()):
        self.drafting += 1
        self.started += 1
        try:
            return await super().draft(tags, num_steps, extend)
        finally:
            self.drafting -= 1


class _PrefillWatch(LocalVerifierLink):
    def __init__(self, engine, drafter: _DraftWatch):
        super().__init__(engine)
        self.drafter, self.beside = drafter, []

    async def prefill(self, items, want_features):
        """Records whether a draft was in flight at some time during the prefill."""
        drafting, started = self.drafter.drafting, self.drafter.started
        try:
            return await super().prefill(items, want_features)
        finally:
            self.beside.append(drafting > 0 or self.drafter.started > started)


def _real_engines_staggered(sampled: bool):
    """The demo EAGLE-3 pair (CPU, fp32) behind in-process links, admitting beside drafts: two
    greedy requests first, then four more one at a time while others run (greedy, or sampled with
    seeds) -> (expected tokens, served tokens, whether each prefill ran beside a draft, counters).
    Expected: plain greedy decoding, or the reference loop's seeded tokens (drafted every round)."""
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:6]]
    params = [SamplingParams(max_tokens=24 + 5 * i, ignore_eos=True) for i in range(6)]
    if sampled:
        params[2:] = [SamplingParams(max_tokens=24 + 5 * i, ignore_eos=True, temperature=0.9, seed=40 + i)
                      for i in range(2, 6)]
        expected = [c.token_ids for c in spec.generate(prompts, params)]
    else:
        plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
        expected = [c.token_ids for c in plain.generate(prompts, params)]

    async def main():
        dlink = _DraftWatch(spec.drafter)
        vlink = _PrefillWatch(spec.verifier, dlink)
        r = Router(vlink, dlink, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="sequential", adaptive_window=0, admit_beside_draft=True, mixed_prefill=False))
        r.start()
        try:
            first = [asyncio.ensure_future(collect_one(r, p, sp)) for p, sp in zip(prompts[:2], params[:2])]
            while r.counters.rounds < 2:
                await asyncio.sleep(0.001)
            rest = []
            for p, sp in zip(prompts[2:], params[2:]):   # one at a time, each while others run
                rest.append(asyncio.ensure_future(collect_one(r, p, sp)))
                seen = r.counters.rounds
                while r.counters.rounds < seen + 2:
                    await asyncio.sleep(0.001)
            done = await asyncio.gather(*first, *rest)
            await drained(spec)
            return done, vlink, r.counters
        finally:
            await r.stop()

    done, vlink, c = asyncio.run(main())
    assert not spec.verifier.requests and not spec.drafter.requests
    return expected, [toks for toks, _ in done], vlink.beside, c


def test_real_engines_admitted_beside_drafts_equal_the_target_alone():
    """Greedy requests arriving while others speculate are prefilled beside the drafts, and every
    output equals plain greedy decoding, token for token."""
    expected, got, beside, c = _real_engines_staggered(sampled=False)
    assert got == expected
    assert beside[0] is False and sum(beside) >= 3
    assert c.draft_tokens > 0


def test_real_engines_sampled_requests_admitted_beside_drafts_keep_their_seeded_tokens():
    """Sampled requests admitted beside a draft skip that round's verify (a plain row would draw
    other seeded tokens): each one's tokens are those of its seed alone."""
    expected, got, beside, _ = _real_engines_staggered(sampled=True)
    assert got == expected
    assert sum(beside) >= 3


def test_serve_overlap_admission_flag_reaches_the_router_and_stays_exact():
    """`serve --overlap-admission` (local backend, CPU): the router admits beside the draft, and
    requests sent while others run get the reference's greedy tokens over the public gRPC API."""
    from tests.router.conftest import Served, collect as collect_rpc, request

    reference = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=512)
    prompts = [reference.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:6]]
    expected = [c.token_ids for c in reference.generate(prompts, [SamplingParams(max_tokens=32)] * 6)]
    server = Served(["--backend", "local", "--max-len", "512", "--pipeline", "sequential",
                     "--overlap-admission", "--no-mixed-prefill"]).wait_ready()
    try:
        assert server.state["router"].cfg.admit_beside_draft is True
        got: dict[int, list[int]] = {}

        def one(i):
            got[i] = collect_rpc(server.stub, request(ids=prompts[i], max_tokens=32))[0]

        threads = []
        for i in range(len(prompts)):   # staggered: each arrives while the earlier ones run
            threads.append(threading.Thread(target=one, args=(i,)))
            threads[-1].start()
            time.sleep(0.03)
        for t in threads:
            t.join(120)
        assert [got.get(i) for i in range(len(prompts))] == expected
    finally:
        server.close()
    default = Served(["--backend", "local", "--max-len", "512"]).wait_ready()
    try:
        assert default.state["router"].cfg.admit_beside_draft is False   # off by default
    finally:
        default.close()
    off = Served(["--backend", "local", "--max-len", "512", "--no-overlap-admission"]).wait_ready()   # as the default
    try:
        assert off.state["router"].cfg.admit_beside_draft is False
    finally:
        off.close()


def test_a_batch_planned_beside_a_draft_is_admitted_when_the_running_requests_end_first():
    """The only running request is cancelled after the scheduler planned the new one beside its
    draft: with nothing left to draft beside, the new request is admitted before the round, and
    runs to the end (driven turn by turn, without the loop)."""
    drafter = SlowDrafter()
    verifier = WatchingVerifier(drafter)

    async def go():
        router = Router(verifier, drafter, Tokenizer(), config(admit_beside_draft=True, mixed_prefill=False))
        first = router.submit(EARLY[0], GREEDY, "first")
        await router._round(await router._schedule())
        second = router.submit(LATE[0], GREEDY, "second")
        batch = await router._schedule()
        assert [r.request_id for r in batch] == ["second"] and router._admits_beside_draft(batch)
        router.cancel(first)
        await router._round(batch)
        for _ in range(100):
            if second.done:
                break
            await router._settle()
            await router._round(await router._schedule())
        await router._settle()
        router._deliver()   # what the loop does once it has nothing left to run
        return second, await collect(second)

    second, (tokens, _, reason) = run(go())
    assert tokens == reference(LATE[0], 40) and reason == "length"
    assert_clean(verifier, drafter)
