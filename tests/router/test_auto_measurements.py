"""Router logic: what "auto" counts as a measurement of a pipeline mode. A speculating round that
drafted for no request (here: the acceptance switch has speculation off) decoded plainly; counted
as the speculating mode's, plain decoding's rate would stand for that mode, and "auto" would keep
plain decoding once drafts are accepted again. And a mode that prefills new requests apart
(ping-pong, ahead) pays for that prefill in its measurement, as sequential and plain pay for the
prompts they carry in the verify step. Real engines (demo EAGLE-3 pair, CPU, fp32) behind
in-process links; greedy tokens must equal plain decoding's throughout."""

from __future__ import annotations

import asyncio

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.local import LocalSpeculator
from router.loop import Router
from router.requests import RouterConfig
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.link_harness import collect, drained


def _pair(n: int):
    """The demo EAGLE-3 pair, n greedy requests of 40 tokens -> (the pair, prompts, params, plain
    decoding's tokens of each)."""
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:n]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * n
    return spec, prompts, params, [c.token_ids for c in plain.generate(prompts, params)]


def _auto_router(spec, verifier_link) -> tuple[Router, list[tuple[str, float]]]:
    """An "auto" router over the pair -> (it, the (mode, seconds) of each round it gives "auto"
    as a measurement, appended as they come)."""
    r = Router(verifier_link, LocalDrafterLink(spec.drafter), spec.tokenizer, RouterConfig(
        max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline="auto"))
    measured, record = [], r._modes.record
    r._modes.record = lambda mode, tokens, seconds, *rest, **kw: (measured.append((mode, seconds)),
                                                                  record(mode, tokens, seconds, *rest, **kw))
    return r, measured


def _serve(speculation_off: bool):
    """Four greedy requests through an "auto" router; -> (the modes of the rounds "auto" was
    given as measurements, whether any round drafted). Their tokens must equal plain decoding's."""
    spec, prompts, params, expected = _pair(4)

    async def main():
        r, measured = _auto_router(spec, LocalVerifierLink(spec.verifier))
        if speculation_off:
            r._switch.off = lambda round_number: True
        r.start()
        try:
            done = await asyncio.gather(*(collect(r, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return [toks for toks, _ in done], [m for m, _ in measured], r.counters.num_drafts
        finally:
            await r.stop()

    got, measured, drafts = asyncio.run(main())
    assert got == expected
    return measured, drafts


def test_rounds_without_drafts_measure_no_speculating_mode():
    """Every round decodes plainly; "auto" stays on its first candidate's measurement (it has
    nothing to choose between while speculation is off) instead of taking those rounds for it."""
    measured, drafts = _serve(speculation_off=True)
    assert drafts == 0 and not set(measured) - {"plain"}


def test_rounds_with_drafts_measure_their_mode():
    """The control: with the switch left alone, speculating rounds are measurements."""
    measured, drafts = _serve(speculation_off=False)
    assert drafts > 0 and set(measured) - {"plain"}


PREFILL_DELAY_S = 1.0   # far beyond a round of the demo pair on a loaded CPU (tens of ms)


def _admission_measured(mode: str) -> tuple[list[tuple[str, float]], int]:
    """Two greedy requests running in `mode` (chosen by "auto" every round), a third arriving
    while they run, every verifier prefill taking PREFILL_DELAY_S longer -> (the (mode, seconds)
    of the rounds "auto" was given as measurements, how many prefills the verifier ran).
    Greedy tokens must equal plain decoding's."""
    spec, prompts, params, expected = _pair(3)

    async def main():
        link = LocalVerifierLink(spec.verifier)
        prefill, prefills = link.prefill, []

        async def slow_prefill(*args, **kwargs):
            prefills.append(1)
            await asyncio.sleep(PREFILL_DELAY_S)
            return await prefill(*args, **kwargs)

        link.prefill = slow_prefill
        r, measured = _auto_router(spec, link)
        r._modes.choose = lambda num_running, drafter_up: mode
        r.start()
        try:
            first = [asyncio.ensure_future(collect(r, p, sp)) for p, sp in zip(prompts[:2], params[:2])]
            while r.counters.rounds < 3:   # the two run; the third arrives among their rounds
                await asyncio.sleep(0.005)
            done = await asyncio.gather(*first, collect(r, prompts[2], params[2]))
            await drained(spec)
            return [toks for toks, _ in done], measured, len(prefills)
        finally:
            await r.stop()

    got, measured, prefills = asyncio.run(main())
    assert got == expected
    return measured, prefills


def test_a_pingpong_round_measures_the_admission_it_makes_apart():
    """Ping-pong prefills a request that arrives among its rounds before the round (sequential
    carries it in the verify step, inside its measurement): that round's measurement includes
    the prefill, so "auto" does not take ping-pong for faster by what it leaves out."""
    measured, prefills = _admission_measured("pingpong")
    assert prefills == 2   # the first two together, then the third
    assert measured and {m for m, _ in measured} == {"pingpong"}
    assert sum(s >= PREFILL_DELAY_S for _, s in measured) == 1   # the round that admitted the third



GAP_S = 0.5   # far beyond a round of the demo pair on a loaded CPU


def test_a_round_measures_the_host_work_since_the_last_round_but_not_an_idle_wait():
    """A round is timed from the end of the round before, where the router went straight on: the
    work between two rounds (here made long once) is in the next round's measurement, as a
    decode the verifier queued ahead would otherwise hide it. A wait for requests is not."""
    spec, prompts, params, expected = _pair(2)

    async def main():
        r, measured = _auto_router(spec, LocalVerifierLink(spec.verifier))
        r._modes.choose = lambda num_running, drafter_up: "sequential"
        settle, slowed = r._settle, []

        async def slow_settle():
            if r.counters.rounds == 4 and not slowed:
                slowed.append(len(measured))   # the next measurement is of the round after the gap
                await asyncio.sleep(GAP_S)
            return await settle()

        r._settle = slow_settle
        r.start()
        try:
            await asyncio.sleep(GAP_S)   # idle: nothing to run
            done = await asyncio.gather(*(collect(r, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return [toks for toks, _ in done], measured, slowed
        finally:
            await r.stop()

    got, measured, slowed = asyncio.run(main())
    assert got == expected
    assert slowed and len(measured) > slowed[0] + 1
    seconds = [s for _, s in measured]
    assert seconds[slowed[0]] >= GAP_S
    assert sum(s >= GAP_S for s in seconds) == 1   # neither the idle wait nor any other round
