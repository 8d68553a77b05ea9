"""`spectandem generate`: one completion, in this process (no server address) with the demo
pair when no model flags are given, or from a server through the client SDK (`--address`)."""

from __future__ import annotations

import json
import sys

from spectandem.service_args import add_model_flags, spec_from_flags


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
        with Client(args.address, timeout=args.timeout, api_key=args.api_key) as client:
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
