"""A request that reaches the end of its context while others speculate: its last rows have no
room for the round's tree width (its plain row would be padded to it), yet the round goes on and
every token equals plain decoding's. Real engines (demo EAGLE-3 pair, CPU, fp32) behind in-process
links, sequential rounds."""

from __future__ import annotations

import asyncio

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.local import LocalSpeculator
from router.loop import Router
from router.requests import RouterConfig
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.router.link_harness import PROMPT_TEXTS, collect, drained

MAX_LEN = 96


def test_a_request_at_its_context_end_beside_drafted_ones_decodes_its_last_tokens():
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=4, max_len=MAX_LEN)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=4, max_len=MAX_LEN)
    tok = spec.tokenizer
    long = (tok.encode(PROMPT_TEXTS[0] * 40).ids)[: MAX_LEN - 24]   # its context ends after about 24 tokens
    prompts = [long, tok.encode(PROMPT_TEXTS[1]).ids]
    params = [SamplingParams(max_tokens=60, ignore_eos=True)] * 2   # the long one stops at the context's end
    expected = [c.token_ids for c in plain.generate(prompts, params)]
    assert len(prompts[0]) + len(expected[0]) == MAX_LEN and len(expected[1]) == 60

    async def main():
        r = Router(LocalVerifierLink(spec.verifier), LocalDrafterLink(spec.drafter), tok, RouterConfig(
            max_len=MAX_LEN, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
            pipeline="sequential"))
        r._switch.off = lambda round_number: False   # the short one drafts in every round
        r.start()
        try:
            done = await asyncio.gather(*(collect(r, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return [toks for toks, _ in done], [req.status.value for _, req in done], r.counters.num_drafts
        finally:
            await r.stop()

    got, statuses, drafts = asyncio.run(main())
    assert statuses == ["finished", "finished"] and drafts > 0
    assert got == expected
