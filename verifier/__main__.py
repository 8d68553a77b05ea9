"""python -m verifier: serve the target model as the spectandem.v1.Verifier gRPC service."""

import argparse
import os
import sys

from verifier.service import add_verifier_args, run_verifier
from spectandem.channel import NCCL_ERROR_HANDLING
from spectandem.service_args import HelpFormatter


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verifier", description=__doc__, formatter_class=HelpFormatter)
    add_verifier_args(p)
    args = p.parse_args(argv)
    os.environ.update(NCCL_ERROR_HANDLING)   # the feature channel's NCCL group: a dead peer aborts it only
    try:
        return run_verifier(args)
    except ValueError as exc:  # config and input errors: one clear line, no traceback
        print(f"verifier: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
