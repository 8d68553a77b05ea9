"""Mean acceptance length of a draft method on held-out corpus text.

    python benchmarks/acceptance.py --corpus CORPUS    # e.g. the demo pair's: python-stdlib-3.11.txt.xz

Prompts are windows of held-out documents (drafter.data: the last 5% of files, which neither
the demo target nor its heads saw); each is continued greedily (or at --temperature) for
--max-tokens tokens. Accept length = committed tokens per verification round, bonus included.
"""

from __future__ import annotations

import argparse
import json
import time

from drafter.data import split_documents
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator

CONFIGS = {
    "chain s4": dict(num_steps=4, topk=1, num_draft_tokens=5),
    "chain s6": dict(num_steps=6, topk=1, num_draft_tokens=7),
    "tree s4 k2 n8": dict(num_steps=4, topk=2, num_draft_tokens=8),
    "tree s5 k4 n16": dict(num_steps=5, topk=4, num_draft_tokens=16),
    "fused n2": dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True),
}


def held_out_prompts(corpus: str, tokenizer, count: int, length: int) -> list[list[int]]:
    _, held = split_documents(corpus)
    prompts = []
    i = 0
    while len(prompts) < count and i < 10 * count:
        name, body = held[i % len(held)]
        ids = tokenizer.encode(body).ids
        start = (i // len(held)) * 3 * length
        if start + length <= len(ids):
            prompts.append(ids[start: start + length])
        i += 1
    return prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", required=True)
    ap.add_argument("--methods", default="eagle3,eagle,draft-model,ngram")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--json", default=None, help="also write the records here")
    args = ap.parse_args()
    records = []
    print(f"{'method':<12} {'config':<16} {'accept_len':>10} {'tok/s':>8}")
    for method in args.methods.split(","):
        for name in args.configs.split(","):
            kw = CONFIGS[name]
            if kw.get("fused") and method not in ("eagle", "eagle3"):
                continue
            target, draft = demo_paths(method)
            spec = LocalSpeculator(target, draft, SpecConfig(method=method, **kw), max_slots=args.prompts)
            prompts = held_out_prompts(args.corpus, spec.tokenizer, args.prompts, args.prompt_len)
            params = [SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=i, ignore_eos=True)
                      for i in range(len(prompts))]
            t0 = time.time()
            outs = spec.generate(prompts, params)
            dt = time.time() - t0
            rounds = sum(o.stats.num_rounds for o in outs)
            acc = sum(o.stats.accepted_tokens for o in outs)
            al = (acc + rounds) / rounds
            toks = sum(len(o.token_ids) for o in outs)
            print(f"{method:<12} {name:<16} {al:>10.3f} {toks / dt:>8.1f}", flush=True)
            records.append({"method": method, "config": name, **kw, "accept_length": round(al, 4),
                            "tokens_per_s": round(toks / dt, 1), "prompts": len(prompts),
                            "max_tokens": args.max_tokens, "temperature": args.temperature})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=2)


if __name__ == "__main__":
    main()
