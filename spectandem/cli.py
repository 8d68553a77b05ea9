"""The `spectandem` command line."""

from __future__ import annotations

import argparse
import sys


def _add_train_draft(sub) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE-3 (or EAGLE-1) head for a target by distillation")
    p.add_argument("--target", required=True, help="HuggingFace-format target directory")
    p.add_argument("--corpus", required=True, help="training text (.txt or .txt.xz; documents split by <|endoftext|>)")
    p.add_argument("--out", required=True, help="directory to write the head to")
    p.add_argument("--arch", choices=["eagle3", "eagle"], default="eagle3")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll depth")
    p.add_argument("--draft-vocab-size", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.set_defaults(func=_train_draft)


def _train_draft(args) -> int:
    from drafter.train import TrainConfig, train_draft

    cfg = TrainConfig(arch=args.arch, steps=args.steps, batch=args.batch, seq_len=args.seq_len, lr=args.lr,
                      ttt_steps=args.ttt_steps, draft_vocab_size=args.draft_vocab_size, seed=args.seed)
    train_draft(args.target, args.corpus, args.out, cfg, device=args.device,
                log=lambda m: print(m, flush=True))
    return 0


def _add_services(sub) -> None:
    """`spectandem verifier` / `spectandem drafter`: the engines as gRPC services (the demo pair
    without model flags); the same flags as `python -m verifier` / `python -m drafter`."""
    from drafter.service import add_drafter_args, run_drafter
    from verifier.service import add_verifier_args, run_verifier

    p = sub.add_parser("verifier", help="serve the target model as the Verifier gRPC service")
    add_verifier_args(p)
    p.set_defaults(func=run_verifier)
    p = sub.add_parser("drafter", help="serve a draft head (or n-gram drafting) as the Drafter gRPC service")
    add_drafter_args(p)
    p.set_defaults(func=run_drafter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="spectandem", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    from spectandem.generate_cli import add_generate

    add_generate(sub)
    from router.serve import add_serve

    add_serve(sub)
    _add_train_draft(sub)
    _add_services(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:  # config and input errors: one clear line, no traceback
        print(f"spectandem: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
