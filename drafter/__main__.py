"""python -m drafter: serve a draft head (or n-gram drafting) as the spectandem.v1.Drafter gRPC service."""

import argparse
import os
import sys

from drafter.service import add_drafter_args, run_drafter
from spectandem.channel import NCCL_ERROR_HANDLING
from spectandem.service_args import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m drafter", description=__doc__, formatter_class=HelpFormatter)
    add_drafter_args(p)
    args = p.parse_args(argv)
    os.environ.update(NCCL_ERROR_HANDLING)   # the feature channel's NCCL group: a dead peer aborts it only
    try:
        return run_drafter(args)
    except ValueError as exc:  # config and input errors: one clear line, no traceback
        print(f"drafter: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
