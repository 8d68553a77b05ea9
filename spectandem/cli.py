"""The `spectandem` command line."""

from __future__ import annotations

import argparse
import os
import sys


def _add_train_draft(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-3 (or EAGLE-1) head for a target by distillation")
    p.add_argument("--target", required=True, help="HuggingFace-format target directory")
    p.add_argument("--corpus", required=True, help="training text (.txt or .txt.xz; documents split by <|endoftext|>)")
    p.add_argument("--out", required=True, help="directory to write the head to")
    p.add_argument("--arch", choices=["eagle3", "eagle"], default="eagle3", help="head architecture")
    p.add_argument("--steps", type=int, default=2000, help="optimizer steps")
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per training sequence")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll depth")
    p.add_argument("--draft-vocab-size", type=int, default=2048,
                   help="EAGLE-3: the head predicts this many tokens, the corpus's most frequent")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's initialisation and the batches")
    p.add_argument("--draft-length", type=int, default=None,
                   help="draft tokens per round the head's config states (speculators' speculative_tokens), which "
                        "serve drafts by default (default: none stated; serve then drafts 4)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_train_draft)


def _train_draft(args) -> int:
    from drafter.train import TrainConfig, train_draft

    cfg = TrainConfig(arch=args.arch, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                      ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, seed=args.seed,
                      draft_length=args.draft_length)
    train_draft(args.target, args.corpus, args.out, cfg, device=args.device,
                log=lambda m: print(m, flush=True))
    return 0


def _add_services(sub) -> None:
    """`spectandem verifier` / `spectandem drafter`: the engines as gRPC services (the demo pair
    without model flags); the same flags as `python -m verifier` / `python -m drafter`."""
    from spectandem.service_args import add_drafter_args, add_verifier_args

    def run_verifier(args):
        from verifier.service import run_verifier as run

        return run(args)

    def run_drafter(args):
        from drafter.service import run_drafter as run

        return run(args)

    p = sub.add_parser("verifier", help="serve the target model as the Verifier gRPC service")
    add_verifier_args(p)
    p.set_defaults(func=run_verifier)
    p = sub.add_parser("drafter", help="serve a draft head (or n-gram drafting) as the Drafter gRPC service")
    add_drafter_args(p)
    p.set_defaults(func=run_drafter)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("spectandem")
    except PackageNotFoundError:   # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectandem", description=__doc__)
    parser.add_argument("--version", action="version", version=f"spectandem {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    from router.generate import add_generate

    add_generate(sub)
    from router.serve import add_serve

    add_serve(sub)
    _add_train_draft(sub)
    _add_services(sub)
    _add_stats(sub)
    from benchmarks.bench.command import add_bench

    add_bench(sub)
    from spectandem.service_args import HelpFormatter

    for p in sub.choices.values():   # each option's help shows its default
        p.formatter_class = HelpFormatter
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from spectandem.errors import ListenError

    if args.command == "generate" and args.api_key is None:   # the environment is read here, in the entry point
        args.api_key = os.environ.get("SPECTANDEM_API_KEY") or None

    try:
        return args.func(args)
    except ValueError as exc:  # config and input errors: one clear line, no traceback
        print(f"spectandem: error: {exc}", file=sys.stderr)
        return 2
    except ListenError as exc:  # a port in use: the same
        print(f"spectandem: error: {exc}", file=sys.stderr)
        return 1



def _add_stats(sub) -> None:
    p = sub.add_parser("stats", help="a running server's counters, queues and KV usage")
    p.add_argument("--address", default="localhost:50051", metavar="HOST:PORT", help="the server")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=10.0, help="deadline of the call in seconds")
    p.add_argument("--api-key", default=None,
                   help="bearer token for a server run with --api-key (default: $SPECTANDEM_API_KEY)")
    p.set_defaults(func=_stats)


def _stats(args) -> int:
    import json

    import grpc
    from google.protobuf.json_format import MessageToDict

    from spectandem.v1 import generation_pb2, generation_pb2_grpc

    with grpc.insecure_channel(args.address) as channel:
        try:
            import os

            key = args.api_key or os.environ.get("SPECTANDEM_API_KEY")
            stats = generation_pb2_grpc.GenerationStub(channel).GetServerStats(
                generation_pb2.GetServerStatsRequest(), timeout=args.timeout,
                metadata=(("authorization", f"Bearer {key}"),) if key else None)
        except grpc.RpcError as exc:
            print(f"spectandem: error: {args.address}: {exc.code().name}: {exc.details()}", file=sys.stderr)
            return 1
    d = MessageToDict(stats, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)

    def numbers(x):  # protobuf's JSON mapping writes 64-bit integers as strings; print numbers
        if isinstance(x, dict):
            return {k: numbers(v) for k, v in x.items()}
        if isinstance(x, list):
            return [numbers(v) for v in x]
        return int(x) if isinstance(x, str) and x.isdigit() else x
    d = numbers(d)
    if args.json:
        print(json.dumps(d))
        return 0
    al = (stats.accepted_tokens + stats.num_drafts) / stats.num_drafts if stats.num_drafts else 0.0
    print(f"rounds {stats.rounds}  drafts {stats.num_drafts}  draft tokens {stats.draft_tokens}  "
          f"accepted {stats.accepted_tokens}  accept length {al:.2f}")
    print(f"accepted per position {list(stats.accepted_per_pos)}")
    print("rounds by pipeline mode " + ("  ".join(f"{m} {n}" for m, n in sorted(stats.mode_rounds.items())) or "-"))
    print(f"preemptions {stats.preemptions}  resumes {stats.resumes}  stale dropped {stats.stale_dropped}  "
          f"fallback rounds {stats.fallback_rounds} (drafter unavailable; outages {stats.drafter_outages})  "
          f"plain rounds {stats.plain_rounds} (speculation off)  draft-ahead hits/misses {stats.draft_ahead_hits}/"
          f"{stats.draft_ahead_misses} (ready trees {stats.ready_trees})  trees posted {stats.posted_trees} "
          f"(early, no draft call: {stats.early_tree_rounds} rounds)  "
          f"decode ahead taken/forgotten {stats.decode_ahead_taken}/{stats.decode_ahead_forgotten}")
    print(f"requests admitted {stats.requests_admitted}  finished {stats.requests_finished}  failed "
          f"{stats.requests_failed}  cancelled {stats.requests_cancelled}  running {stats.running}  "
          f"waiting {stats.waiting}")
    for side in ("verifier_kv", "drafter_kv"):
        kv = getattr(stats, side)
        print(f"{side.split('_')[0]} KV blocks used {kv.used_blocks}/{kv.num_blocks} (block size {kv.block_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
