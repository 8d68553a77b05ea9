"""The router's logic on fake engines (tests/router/fakes.py): exact tokens whatever the drafts,
preemption and resume, drafter failure and recovery, verifier failure, request ids,
cancellation, EOS and stop strings. No model: each test runs in milliseconds."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.links import DuplicateRequest, EngineUnavailable
from router.loop import Router
from router.requests import Failure, RequestStatus, RouterConfig, StreamEvent
from spectandem.config import SamplingParams
from tests.router.fakes import VOCAB, OracleVerifier, ScriptedDrafter, Tokenizer, continuation, oracle, reference

PROMPTS = [[5, 9, 2], [1, 1, 4, 7, 3], [60, 2], [8, 8, 8, 8], [33], [12, 40, 3, 9, 9, 1]]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def config(**kw) -> RouterConfig:
    base = dict(max_len=256, eos_token_ids=(0,), lookahead=5, want_features=True, pipeline="sequential",
                drafter_timeout=0.05, probe_interval=0.005, adaptive_window=0)
    return RouterConfig(**{**base, **kw})


def wrong(context: list[int], depth: int) -> list[int]:
    return [(t + 1) % VOCAB for t in continuation(context, depth)]


def half_right(context: list[int], depth: int) -> list[int]:
    """Right for (sum of the context) % (depth + 1) tokens, then wrong."""
    good = continuation(context, depth)
    k = sum(context) % (depth + 1)
    return good[:k] + [(t + 1) % VOCAB for t in good[k:]]


async def collect(req) -> tuple[list[int], str, str | Failure]:
    """-> (tokens, text, finish reason or the Failure)."""
    tokens, text = [], ""
    while True:
        ev = await asyncio.wait_for(req.events.get(), 5)
        if isinstance(ev, Failure):
            return tokens, text, ev
        tokens += ev.token_ids
        text += ev.text
        if ev.finish_reason is not None:
            return tokens, text, ev.finish_reason


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


async def serve(verifier, drafter, prompts, params=GREEDY, cfg=None, on_event=None):
    """Serves `prompts` to the end; -> (router, [(tokens, text, reason)])."""
    router = Router(verifier, drafter, Tokenizer(), cfg or config())
    if on_event is not None:
        router.listeners.append(lambda ev, req, data: on_event(router, ev, req, data))
    router.start()
    try:
        reqs = [router.submit(p, params) for p in prompts]
        outs = await asyncio.gather(*(collect(r) for r in reqs))
        for _ in range(50):   # the last round's releases
            await asyncio.sleep(0)
    finally:
        await router.stop()
    return router, outs


def assert_exact(outs, prompts=PROMPTS, max_tokens=40):
    for (tokens, _, reason), p in zip(outs, prompts):
        assert tokens == reference(p, max_tokens), p
        assert reason == "length"


def assert_clean(verifier, drafter):
    assert verifier.errors == [] and verifier.ctx == {}
    if drafter is not None:
        assert drafter.errors == [] and drafter.ctx == {}


@pytest.mark.parametrize("propose", [continuation, wrong, half_right], ids=["accepted", "rejected", "partly"])
@pytest.mark.parametrize("pipeline", ["sequential", "pingpong", "ahead", "auto"])
def test_tokens_are_the_targets_whatever_the_drafts(propose, pipeline):
    v, d = OracleVerifier(), ScriptedDrafter(propose)
    router, outs = run(serve(v, d, PROMPTS, cfg=config(pipeline=pipeline, mode_window=2)))
    assert_exact(outs)
    assert_clean(v, d)
    c = router.counters
    assert c.draft_tokens > 0 and c.stale_dropped == 0
    if propose is continuation and pipeline != "auto":   # "auto" also measures plain rounds
        assert c.accepted_tokens == c.draft_tokens and c.rounds * 2 < sum(len(o[0]) for o in outs)
    if propose is wrong:
        assert c.accepted_tokens == 0


def test_plain_decoding_without_a_drafter_and_in_steps():
    for steps in (1, 3):
        v = OracleVerifier()
        router, outs = run(serve(v, None, PROMPTS, cfg=config(plain_steps=steps)))
        assert_exact(outs)
        assert_clean(v, None)
        assert router.counters.draft_tokens == 0


def test_preemption_resumes_with_the_same_tokens():
    # 12 blocks of 4 entries: six requests of up to 46 tokens cannot all run to the end.
    v, d = OracleVerifier(), ScriptedDrafter(half_right)
    cfg = config(kv_blocks=12, kv_block_size=4, draft_kv_blocks=14, draft_kv_block_size=4)
    router, outs = run(serve(v, d, PROMPTS, cfg=cfg))
    assert_exact(outs)
    assert_clean(v, d)
    c = router.counters
    assert c.preemptions > 0 and c.resumes == c.preemptions and c.requests_finished == len(PROMPTS)


def test_a_request_that_can_never_fit_fails_alone():
    v, d = OracleVerifier(), ScriptedDrafter()
    cfg = config(kv_blocks=4, kv_block_size=4)
    long_prompt = list(range(1, 30))

    async def go():
        router = Router(v, d, Tokenizer(), cfg)
        router.start()
        too_long, fine = router.submit(long_prompt, GREEDY), router.submit([5, 9], SamplingParams(max_tokens=6))
        outs = await asyncio.gather(collect(too_long), collect(fine))
        await router.stop()
        return too_long, outs

    too_long, (failed, ok) = run(go())
    assert isinstance(failed[2], Failure) and failed[2].code == "RESOURCE_EXHAUSTED"
    assert "--kv-blocks" in failed[2].message
    assert too_long.status is RequestStatus.FAILED
    assert ok[0] == reference([5, 9], 6)


@pytest.mark.parametrize("fault", ["fail", "hang"])
def test_drafter_failure_falls_back_then_speculation_resumes(fault):
    v, d = OracleVerifier(), ScriptedDrafter()
    seen = {"tokens": 0, "drafts_after": None}

    def cue(router, ev, req, data):
        if ev != "tokens":
            return
        seen["tokens"] += data["count"]
        if seen["tokens"] >= 30 and d.mode == "ok" and seen["drafts_after"] is None:
            d.mode = fault                       # the drafter goes away mid-stream ...
        elif d.mode == fault and router.counters.fallback_rounds >= 6:
            d.mode = "ok"                        # ... and comes back; the requests do not end
            seen["drafts_after"] = router.counters.num_drafts   # before the router has seen it back
            v.hold = lambda: not router.drafter_up

    router, outs = run(serve(v, d, PROMPTS, cfg=config(drafter_timeout=0.02), on_event=cue))
    assert_exact(outs)
    assert_clean(v, d)
    c = router.counters
    assert c.drafter_outages == 1 and c.fallback_rounds >= 6
    assert seen["drafts_after"] is not None and c.num_drafts > seen["drafts_after"]   # drafted again
    assert router.drafter_up


def test_stale_drafts_are_dropped_and_never_verified():
    v, d = OracleVerifier(), ScriptedDrafter(wrong)
    d.stale = True
    router, outs = run(serve(v, d, PROMPTS[:2]))
    assert_exact(outs, PROMPTS[:2])
    assert router.counters.stale_dropped > 0 and router.counters.draft_tokens == 0
    assert v.errors == []


def test_verifier_failure_fails_its_requests_then_serving_resumes():
    v, d = OracleVerifier(), ScriptedDrafter()
    states = []

    async def go():
        router = Router(v, d, Tokenizer(), config())
        router.on_serving_change = states.append
        router.start()
        req = router.submit(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        first = await asyncio.wait_for(req.events.get(), 5)
        v.down = True
        rest = await collect(req)
        with pytest.raises(EngineUnavailable):
            router.submit(PROMPTS[1], GREEDY)
        v.down = False
        while not router.serving:
            await asyncio.sleep(0.005)
        again = await collect(router.submit(PROMPTS[1], GREEDY))
        await router.stop()
        return first, rest, again

    first, rest, again = run(go())
    assert isinstance(first, StreamEvent) and first.token_ids
    assert isinstance(rest[2], Failure) and rest[2].code == "UNAVAILABLE"
    assert states == [False, True]
    assert again[0] == reference(PROMPTS[1], 40)
    assert_clean(v, d)


def test_a_refused_request_fails_alone():
    v, d = OracleVerifier(), ScriptedDrafter()

    async def go():
        router = Router(v, d, Tokenizer(), config())
        router.start()
        reqs = [router.submit(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(PROMPTS[:3])]
        v.refuse = {"r1"}
        outs = await asyncio.gather(*(collect(r) for r in reqs))
        await router.stop()
        return outs

    outs = run(go())
    assert isinstance(outs[1][2], Failure) and outs[1][2].code == "INVALID_ARGUMENT"
    assert_exact([outs[0], outs[2]], [PROMPTS[0], PROMPTS[2]])


def test_an_id_in_use_is_refused_and_free_once_its_request_ended():
    v, d = OracleVerifier(), ScriptedDrafter()

    async def go():
        router = Router(v, d, Tokenizer(), config())
        router.start()
        a = router.submit(PROMPTS[0], GREEDY, request_id="x")
        with pytest.raises(DuplicateRequest):
            router.submit(PROMPTS[1], GREEDY, request_id="x")
        other = router.submit(PROMPTS[1], GREEDY, request_id="y")
        first = await collect(a)
        assert not router.in_use("x")
        b = router.submit(PROMPTS[2], GREEDY, request_id="x")   # reused at once: admitted once released
        outs = [first, await collect(b), await collect(other)]
        await router.stop()
        return outs

    outs = run(go())
    assert_exact(outs, [PROMPTS[0], PROMPTS[2], PROMPTS[1]])
    assert_clean(v, d)


def test_cancel_stops_the_request_and_releases_it_on_both_engines():
    v, d = OracleVerifier(), ScriptedDrafter(half_right)

    async def go():
        router = Router(v, d, Tokenizer(), config())
        router.start()
        long = router.submit(PROMPTS[0], SamplingParams(max_tokens=10 ** 4, ignore_eos=True))
        waiting = router.submit(PROMPTS[1], GREEDY)
        other = router.submit(PROMPTS[2], GREEDY)
        got = (await asyncio.wait_for(long.events.get(), 5)).token_ids
        router.cancel(waiting)
        router.cancel(long)
        rest = await collect(long)
        done = await collect(other)
        for _ in range(50):
            await asyncio.sleep(0)
        held = dict(v.ctx), dict(d.ctx)
        await router.stop()
        return long, waiting, got, rest, done, held, router.counters

    long, waiting, got, rest, done, held, c = run(go())
    assert got and rest == ([], "", "abort")
    assert long.status is waiting.status is RequestStatus.CANCELLED
    assert held == ({}, {})
    assert done[0] == reference(PROMPTS[2], 40)
    assert c.requests_cancelled == 2


def test_eos_and_stop_strings_end_the_request():
    prompt = PROMPTS[3]
    ref = reference(prompt, 40)
    i = next(i for i in range(3, 40) if ref[i] not in ref[:i])   # a token first seen at i
    v, d = OracleVerifier(), ScriptedDrafter(half_right)
    _, [(tokens, _, reason)] = run(serve(v, d, [prompt], SamplingParams(max_tokens=40),
                                         cfg=config(eos_token_ids=(ref[i],))))
    assert tokens == ref[:i + 1] and reason == "stop"
    assert_clean(v, d)

    text = Tokenizer().decode(ref)
    stop = text[12:15]
    cut = text.index(stop)
    v, d = OracleVerifier(), ScriptedDrafter(half_right)
    _, [(tokens, out, reason)] = run(serve(v, d, [prompt], SamplingParams(max_tokens=40, ignore_eos=True,
                                                                          stop=(stop,))))
    assert out == text[:cut] and reason == "stop"
    assert tokens == ref[:len(tokens)] and len(tokens) >= cut
    assert_clean(v, d)


def test_oracle_is_not_trivial():
    # The fakes' target must vary with the context, or "exact" would prove nothing.
    assert len({oracle([t]) for t in range(VOCAB)}) > VOCAB // 2
    assert len(set(reference(PROMPTS[0], 40))) > 10


class RecordingDrafter(ScriptedDrafter):
    """Records the outputs the router sends with its releases: what a drafter that learns
    outputs (drafter/controlled.py) learns."""

    def __init__(self, propose=None):
        super().__init__(propose)
        self.learned: list[list[int]] = []

    async def release(self, request_ids, keep_draft=False, outputs=None):
        self.learned += [list(ids) for ids in (outputs or {}).values()]
        await super().release(request_ids, keep_draft, outputs)


@pytest.mark.parametrize("learns", [True, False])
def test_a_drafter_that_learns_outputs_gets_them_whole_with_the_release(learns):
    """Benchmark mode (drafter_learns_outputs): rejected drafts switch speculation off, so most
    rounds are plain and hold their catch-ups back; each request's whole output (prompt and every
    committed token) goes with its release, while the held-back catch-ups are dropped as in
    production. Without the mode (negative control) no output goes with a release."""
    v, d = OracleVerifier(), RecordingDrafter(wrong)
    cfg = config(pipeline="sequential", drafter_learns_outputs=learns, adaptive_window=12, adaptive_off_rounds=1000)
    router, outs = run(serve(v, d, PROMPTS, cfg=cfg))
    assert_exact(outs)
    assert router.counters.plain_rounds > 0
    whole = sorted(p + reference(p, 40) for p in PROMPTS)
    assert sorted(d.learned) == (whole if learns else [])


def test_sampled_requests_send_no_output_to_learn():
    """Only greedy outputs are truths (drafter/controlled.py plans greedy requests only)."""
    v, d = OracleVerifier(), RecordingDrafter()
    cfg = config(pipeline="sequential", drafter_learns_outputs=True)
    router, outs = run(serve(v, d, PROMPTS, SamplingParams(max_tokens=20, temperature=0.8, seed=7, ignore_eos=True), cfg=cfg))
    assert [len(tokens) for tokens, _, _ in outs] == [20] * len(PROMPTS)
    assert d.learned == []


def test_a_drafter_that_forgot_its_requests_reports_them_with_the_draft_and_they_are_prefilled_again():
    """The drafter restarts between rounds (it forgets every request): the next draft call's
    catch-up names them unknown, they decode plainly until the router prefills them again, and
    then speculate; the tokens stay the target's."""
    v, d = OracleVerifier(), ScriptedDrafter()
    seen = {"tokens": 0, "forgot": False, "prefills": 0}
    prefill = d.prefill

    async def counting_prefill(items):
        seen["prefills"] += len(items)
        return await prefill(items)
    d.prefill = counting_prefill

    def cue(router, ev, req, data):
        if ev == "tokens":
            seen["tokens"] += data["count"]
            if seen["tokens"] >= 30 and not seen["forgot"]:
                d.ctx.clear()                    # a restarted drafter holds nothing
                seen["forgot"] = True

    router, outs = run(serve(v, d, PROMPTS, cfg=config(pipeline="sequential"), on_event=cue))
    assert_exact(outs)
    assert_clean(v, d)
    assert seen["forgot"] and seen["prefills"] > len(PROMPTS)      # prefilled again after it forgot
    assert router.counters.drafter_outages == 0 and router.drafter_up
    assert d.calls.count("extend") == 0                           # catch-ups went with the drafts


class CountingVerifier(OracleVerifier):
    def __init__(self):
        super().__init__()
        self.prefills: list[int] = []      # requests in each prefill call

    async def prefill(self, items, want_features):
        self.prefills.append(len(items))
        return await super().prefill(items, want_features)


@pytest.mark.parametrize("gap_s", [0.0005, 0.05])
def test_a_wave_of_requests_landing_a_little_apart_is_prefilled_at_once(gap_s):
    """A client's concurrent calls land a little apart (here 0.5 ms): admission waits for the rest
    of the wave (ARRIVAL_GAP_S), so one prefill takes all six, not the first alone and the others a
    round later. Requests far apart (50 ms, the control) are prefilled as they come."""
    from router.loop import ARRIVAL_GAP_S

    assert gap_s < ARRIVAL_GAP_S or gap_s > 10 * ARRIVAL_GAP_S

    async def main():
        v, d = CountingVerifier(), ScriptedDrafter(wrong)
        router = Router(v, d, Tokenizer(), config())
        router.start()
        try:
            reqs, gaps = [], []
            for p in PROMPTS:
                reqs.append(router.submit(p, GREEDY))
                t0 = time.monotonic()
                await asyncio.sleep(gap_s)
                gaps.append(time.monotonic() - t0)
            outs = await asyncio.gather(*(collect(r) for r in reqs))
        finally:
            await router.stop()
        return v, outs, max(gaps[:-1])

    # A loaded machine may oversleep the short gap past ARRIVAL_GAP_S, which makes it another
    # wave: such a try does not count, and one of ten must land as a wave (on a busy 2-core machine
    # three tries in a row can oversleep).
    for _ in range(10):
        v, outs, widest = run(main())
        assert_exact(outs)
        if gap_s > ARRIVAL_GAP_S or widest < ARRIVAL_GAP_S:
            break
    if gap_s < ARRIVAL_GAP_S:
        assert widest < ARRIVAL_GAP_S, f"every try's gaps were wider than {ARRIVAL_GAP_S} s on this machine"
        assert v.prefills == [len(PROMPTS)], v.prefills
    else:
        assert len(v.prefills) == len(PROMPTS), v.prefills


def test_a_bug_during_admission_fails_the_requests_being_admitted_instead_of_losing_them():
    """An unexpected exception in the verifier's prefill (a bug, not an engine failure) ends the
    round: the requests being admitted, already off the queue, fail with INTERNAL like the
    others, rather than waiting forever; the router then serves new requests."""

    async def main():
        verifier, drafter = OracleVerifier(), ScriptedDrafter()
        inner = verifier.prefill
        broken = {"on": True}

        async def prefill(items, want_features):
            if broken["on"]:
                broken["on"] = False
                raise TypeError("a bug in prefill")
            return await inner(items, want_features)

        verifier.prefill = prefill
        router = Router(verifier, drafter, Tokenizer(), config())
        router.start()
        try:
            first = router.submit(PROMPTS[0], GREEDY)
            tokens, _, reason = await collect(first)
            assert isinstance(reason, Failure) and reason.code == "INTERNAL", reason
            assert tokens == []
            again = router.submit(PROMPTS[1], GREEDY)
            tokens, _, reason = await collect(again)
            assert reason == "length" and tokens == reference(PROMPTS[1], GREEDY.max_tokens)
        finally:
            await router.stop()

    run(main())


def test_a_rounds_tokens_reach_their_stream_once_the_next_verify_is_launched():
    """The tokens a round commits wait in the router while the next round's draft runs (in one
    process the drafter's host code then has the Python lock to itself) and go to their stream
    once that round's verify is launched; the first token goes at once, the last ones when the
    loop has nothing left to run. What the client receives is unchanged."""
    queued_at_draft = []

    class CountingDrafter(ScriptedDrafter):
        async def draft(self, tags, num_steps=None, extend=()):
            queued_at_draft.append(req.events.qsize())   # nothing reads the stream until the end
            return await super().draft(tags, num_steps, extend)

    params = SamplingParams(max_tokens=12, ignore_eos=True)

    async def main():
        nonlocal req
        router = Router(OracleVerifier(), CountingDrafter(), Tokenizer(), config())
        router.start()
        try:
            req = router.submit(PROMPTS[0], params)
            while not req.done:
                await asyncio.sleep(0.001)
            await asyncio.sleep(0.01)
            return await collect(req)
        finally:
            await router.stop()

    req = None
    tokens, text, reason = run(main())
    assert reason == "length" and tokens == reference(PROMPTS[0], 12)
    assert text == Tokenizer().decode(tokens)
    # Draft k + 1 (k >= 1) sees the first token's event and those of rounds 1 to k - 1, each
    # delivered when the next round's verify was launched; round k's is held back.
    n = len(queued_at_draft)
    assert n >= 3
    assert queued_at_draft == [1] + list(range(1, n)), queued_at_draft


def test_a_warm_up_whose_requests_fail_says_so():
    """A warm-up request that fails (the verifier went away) ends the warm-up with an error that
    names it, instead of an AttributeError on the failure event."""

    async def main():
        verifier = OracleVerifier()
        router = Router(verifier, ScriptedDrafter(), Tokenizer(), config())
        router.start()

        async def broken(*args, **kwargs):
            raise EngineUnavailable("the verifier went away")

        verifier.verify = broken
        try:
            with pytest.raises(RuntimeError, match="a warm-up request did not finish .failed: UNAVAILABLE: "):
                await router.warm_up([2], VOCAB, max_tokens=8)
        finally:
            await router.stop()

    run(main())
