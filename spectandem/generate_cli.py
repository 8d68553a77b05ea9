"""`spectandem generate`: one completion, in this process (no server address) with the demo
pair when no model flags are given, or from a server through the client SDK (`--address`)."""

from __future__ import annotations

import argparse
import json
import sys
from spectandem.service_args import add_device_flags


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model and tree flags shared by every command that loads models."""
    p.add_argument("--target", default=None, help="target checkpoint directory (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft head / draft model directory (default: the demo's)")
    p.add_argument("--method", choices=["eagle", "eagle3", "draft-model", "ngram", "none"], default="eagle3",
                   help="how drafts are made: an EAGLE-1 or EAGLE-3 head, a small draft model, prompt-lookup "
                        "n-grams, or none (plain decoding)")
    p.add_argument("--num-steps", type=int, default=4, help="tree depth")
    p.add_argument("--topk", type=int, default=1, help="children expanded per node")
    p.add_argument("--num-draft-tokens", type=int, default=5, help="verified nodes per round, root included")
    p.add_argument("--fused", action="store_true", help="one draft token per round, verify+extend fused")
    p.add_argument("--draft-sampling-min-temperature", type=float, default=0.5,
                   help="below this temperature drafts are deterministic and verified without q")
    p.add_argument("--ahead-width", type=int, default=4,
                   help="draft ahead: outcomes of a round prepared while it is verified (0: never)")
    add_device_flags(p)
    p.add_argument("--max-len", type=int, default=None, help="context length (default: the target's)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="verifier KV pool in blocks (default: every slot at full context)")
    p.add_argument("--draft-kv-blocks", type=int, default=None,
                   help="drafter KV pool in blocks (default: every slot at full context)")
    p.add_argument("--block-size", type=int, default=16, help="cache entries per KV block (both sides)")


def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion (in this process, or from a server)")
    p.add_argument("prompt", help="prompt text")
    p.add_argument("--address", default=None, metavar="HOST:PORT",
                   help="ask this server instead of loading models here (the model flags are then ignored)")
    p.add_argument("--stream", action="store_true",
                   help="print text as it arrives (with --json: one JSON line per chunk, then the result); "
                        "needs --address")
    p.add_argument("--timeout", type=float, default=None, help="deadline in seconds (needs --address)")
    p.add_argument("--api-key", default=None,
                   help="bearer token for a server run with --api-key (default: $SPECTANDEM_API_KEY)")
    add_model_flags(p)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (0: greedy)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling: the smallest set of tokens of this mass")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest tokens (0: all)")
    p.add_argument("--seed", type=int, default=None, help="seed of the request's random numbers (default: a fresh one)")
    p.add_argument("--stop-token-ids", type=int, nargs="*", default=(), metavar="ID",
                   help="token ids that end the completion, besides the model's EOS (default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_generate)


def spec_from_flags(args):
    """The model flags -> (SpecConfig, target dir, draft dir or None); the demo pair by default."""
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths

    cfg = SpecConfig(method=args.method, num_steps=args.num_steps, topk=args.topk,
                     num_draft_tokens=args.num_draft_tokens, fused=args.fused,
                     draft_sampling_min_temperature=args.draft_sampling_min_temperature,
                     ahead_width=args.ahead_width,
                     benchmark_acceptance_rate=getattr(args, "benchmark_acceptance_rate", None))
    target, draft = args.target, args.draft
    if target is None:
        demo_target, demo_draft = demo_paths(args.method)
        target, draft = str(demo_target), (draft or (str(demo_draft) if demo_draft else None))
    elif draft is None and args.method in ("eagle", "eagle3", "draft-model"):
        raise ValueError(f"--method {args.method} with --target needs --draft")
    return cfg, target, draft


def build_local(args):
    from router.local import LocalSpeculator
    from spectandem.config import EngineConfig

    from spectandem.devices import resolve_flags

    cfg, target, draft = spec_from_flags(args)
    args = resolve_flags(args, target)
    return LocalSpeculator.from_config(EngineConfig.from_args(args, cfg, target, draft, max_slots=4))


def completion_json(text: str, c) -> dict:
    return {"text": text, "token_ids": c.token_ids, "finish_reason": c.finish_reason, "stats": c.stats.as_dict()}


def _generate(args) -> int:
    from spectandem.config import SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.seed, stop_token_ids=tuple(args.stop_token_ids))
    if args.address is not None:
        return _generate_remote(args, params)
    if args.stream or args.timeout is not None:
        raise ValueError("--stream and --timeout need --address (in-process generation runs to the end)")
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


def _generate_remote(args, params) -> int:
    from spectandem.client import Client, Completion, SpectandemError

    chunks = []
    if args.stream and not args.json:
        sys.stdout.write(args.prompt)
    try:
        import os

        api_key = args.api_key or os.environ.get("SPECTANDEM_API_KEY")
        with Client(args.address, timeout=args.timeout, api_key=api_key) as client:
            for chunk in client.stream(args.prompt, params):
                chunks.append(chunk)
                if args.stream and args.json:
                    print(json.dumps({"text": chunk.text, "token_ids": chunk.token_ids,
                                      "finish_reason": chunk.finish_reason, "stats": chunk.stats}), flush=True)
                elif args.stream:
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
        c = Completion.from_chunks(chunks)
    except SpectandemError as exc:  # one clear line, as for config errors
        print(f"spectandem: error: {args.address}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason,
                          "stats": c.stats}))
        return 0
    sys.stdout.write(("" if args.stream else args.prompt + c.text) + "\n")
    s = c.stats
    print(f"\n[{args.address}] {len(c.token_ids)} tokens, finish_reason={c.finish_reason}, "
          f"rounds={s['num_rounds']}, drafted={s['draft_tokens']}, accepted={s['accepted_tokens']}, "
          f"accept_length={s['accept_length']:.2f}", file=sys.stderr)
    return 0
