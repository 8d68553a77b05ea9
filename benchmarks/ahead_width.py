"""How often the outcome cache of draft ahead holds the round's outcome, by its width, on the
demo pair with its real EAGLE-3 head (no controlled drafter).

Draft ahead (drafter/ahead.py) caches a next tree for each of the `ahead_width` likeliest
outcomes (accepted path, bonus token) of the round being verified, ranked by the head's own
log-probabilities. The share of verdicts it holds decides how many rounds must draft after the
verdict (a miss). `spectandem bench`'s controlled drafter fixes that share at the acceptance rate
a (drafter/controlled.py: its second guess is right with probability a, and it has no
third); a real head's share depends on the width. The share does not depend on the device or on
timing, so this runs anywhere; the cost of a wider cache (more forks to draft) is the GPU's.

    python benchmarks/ahead_width.py --corpus CORPUS    # e.g. the demo pair's: python-stdlib-3.11.txt.xz

Each prompt is a held-out window (as benchmarks/acceptance.py), generated greedily at batch 1
through the router in "ahead" mode over in-process links (spectandem serve --backend local).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from acceptance import held_out_prompts  # noqa: E402

from benchmarks.bench.pipeline import _complete, _settle, demo_engines  # noqa: E402
from spectandem.config import SamplingParams, SpecConfig  # noqa: E402


async def hit_share(width: int, num_steps: int, prompts_count: int, prompt_len: int, max_tokens: int,
                    corpus: str) -> dict:
    from router.links_local import LocalDrafterLink, LocalVerifierLink
    from router.loop import Router, RouterConfig

    cfg = SpecConfig(method="eagle3", num_steps=num_steps, topk=1, num_draft_tokens=num_steps + 1, ahead_width=width)
    verifier, drafter, lookahead, eos, tokenizer = demo_engines(2, None, "cpu", "cpu", cfg=cfg)
    vlink, dlink = LocalVerifierLink(verifier), LocalDrafterLink(drafter)
    router = Router(vlink, dlink, tokenizer, RouterConfig(
        max_len=verifier.max_len, eos_token_ids=eos, lookahead=lookahead, want_features=True, max_running=1,
        pipeline="ahead", draft_sampling_min_temperature=drafter.cfg.draft_sampling_min_temperature))
    router.start()
    try:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for p in held_out_prompts(corpus, tokenizer, prompts_count, prompt_len):   # batch 1: one at a time
            await _complete(router, [p], params)
            await _settle((vlink, dlink))
        c = dataclasses.asdict(router.counters)
    finally:
        await router.stop()
    hits, misses, drafts = c["draft_ahead_hits"], c["draft_ahead_misses"], c["num_drafts"]
    return dict(ahead_width=width, num_steps=num_steps, hits=hits, misses=misses,
                hit_share=round(hits / max(hits + misses, 1), 4),
                accept_length=round((c["accepted_tokens"] + drafts) / max(drafts, 1), 4),
                prompts=prompts_count, max_tokens=max_tokens)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--widths", default="1,2,4,5,8,12,16")
    ap.add_argument("--num-steps", type=int, default=4, help="drafts per chain")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args()
    records = []
    print(f"{'width':>5} {'hits':>6} {'misses':>6} {'hit share':>9} {'accept len':>10}")
    for w in (int(x) for x in args.widths.split(",")):
        r = asyncio.run(hit_share(w, args.num_steps, args.prompts, args.prompt_len, args.max_tokens, args.corpus))
        print(f"{w:>5} {r['hits']:>6} {r['misses']:>6} {r['hit_share']:>9.3f} {r['accept_length']:>10.3f}", flush=True)
        records.append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(records, indent=2))


if __name__ == "__main__":
    main()
