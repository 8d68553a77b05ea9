"""Router logic: what "auto" counts as a measurement of a pipeline mode. A speculating round that
drafted for no request (here: the acceptance switch has speculation off) decoded plainly; counted
as the speculating mode's, plain decoding's rate would stand for that mode, and "auto" would keep
plain decoding once drafts are accepted again. Real engines (demo EAGLE-3 pair, CPU, fp32) behind
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


def _serve(speculation_off: bool):
    """Four greedy requests through an "auto" router; -> (their tokens, plain decoding's, the
    modes of the rounds "auto" was given as measurements, whether any round drafted)."""
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:4]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * 4
    expected = [c.token_ids for c in plain.generate(prompts, params)]

    async def main():
        r = Router(LocalVerifierLink(spec.verifier), LocalDrafterLink(spec.drafter), spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="auto"))
        if speculation_off:
            r._switch.off = lambda round_number: True
        measured, record = [], r._modes.record
        r._modes.record = lambda mode, *rest: (measured.append(mode), record(mode, *rest))
        r.start()
        try:
            done = await asyncio.gather(*(collect(r, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return [toks for toks, _ in done], measured, r.counters.num_drafts
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
