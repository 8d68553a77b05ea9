"""`spectandem generate`: one completion, in this process (no server address) with the demo
pair when no model flags are given."""

from __future__ import annotations

import argparse
import json
import sys


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model and tree flags shared by every command that loads models."""
    p.add_argument("--target", default=None, help="target checkpoint directory (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft head / draft model directory (default: the demo's)")
    p.add_argument("--method", choices=["eagle", "eagle3", "draft-model", "ngram", "none"], default="eagle3")
    p.add_argument("--num-steps", type=int, default=4, help="tree depth")
    p.add_argument("--topk", type=int, default=1, help="children expanded per node")
    p.add_argument("--num-draft-tokens", type=int, default=5, help="verified nodes per round, root included")
    p.add_argument("--fused", action="store_true", help="one draft token per round, verify+extend fused")
    p.add_argument("--draft-sampling-min-temperature", type=float, default=0.5,
                   help="below this temperature drafts are deterministic and verified without q")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    p.add_argument("--max-len", type=int, default=None, help="context length (default: the target's)")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion (in this process)")
    p.add_argument("prompt", help="prompt text")
    add_model_flags(p)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=())
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)


def build_local(args):
    import torch

    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths
    from spectandem.local import LocalSpeculator

    cfg = SpecConfig(method=args.method, num_steps=args.num_steps, topk=args.topk,
                     num_draft_tokens=args.num_draft_tokens, fused=args.fused,
                     draft_sampling_min_temperature=args.draft_sampling_min_temperature)
    target, draft = args.target, args.draft
    if target is None:
        demo_target, demo_draft = demo_paths(args.method)
        target, draft = demo_target, draft or demo_draft
    elif draft is None and args.method in ("eagle", "eagle3", "draft-model"):
        raise ValueError(f"--method {args.method} with --target needs --draft")
    return LocalSpeculator(target, draft, cfg, max_slots=4, max_len=args.max_len,
                           dtype=getattr(torch, args.dtype), device=args.device)


def completion_json(text: str, c) -> dict:
    return {"text": text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stats": c.stats.as_dict()}


def _generate(args) -> int:
    from spectandem.config import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_token_ids=tuple(args.stop_token_ids))
    spec = build_local(args)
    prompt_ids = spec.tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise ValueError("prompt is empty after tokenisation")
    (c,) = spec.generate([prompt_ids], [params])
    text = spec.tokenizer.decode(c.token_ids)
    if args.json:
        print(json.dumps(completion_json(text, c)))
    else:
        s = c.stats
        sys.stdout.write(args.prompt + text + "\n")
        print(f"\n[{args.method}] {len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
              f"rounds={s.num_rounds}, drafted={s.draft_tokens}, accepted={s.accepted_tokens}, "
              f"accept_length={s.accept_length:.2f}", file=sys.stderr)
    return 0
