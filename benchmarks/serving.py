"""Rounds and tokens per second of the served demo pair, with and without pipelining.

    python benchmarks/serving.py [--backend local] [--clients 16] [--max-tokens 64]
                                 [--modes sequential,ahead,pingpong,auto]

Starts `spectandem serve` in this process (engines in-process by default, so the drafter and the
verifier run in two threads), drives it with concurrent gRPC clients (greedy, ignore_eos), and
prints one row per pipeline mode (with the draft-ahead hit share where the outcome cache ran).
On the CPU the two engines share the machine's cores.
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

sys_path_root = __import__("pathlib").Path(__file__).resolve().parent.parent
__import__("sys").path.insert(0, str(sys_path_root))  # the repo root: tests/ holds the served-router helper

from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import Served, request
from spectandem.v1 import generation_pb2


def run(backend: str, pipeline: str, clients: int, max_tokens: int, rounds_per_client: int) -> dict:
    server = Served(["--backend", backend, "--pipeline", pipeline, "--max-running", str(clients),
                     "--max-len", "512"]).wait_ready(300)
    try:
        stub = server.stub

        def once(i):
            for _ in stub.Generate(request(text=PROMPT_TEXTS[i % len(PROMPT_TEXTS)], max_tokens=max_tokens,
                                           ignore_eos=True), timeout=600):
                pass
        once(0)  # warm-up
        before = stub.GetServerStats(generation_pb2.GetServerStatsRequest())
        t0 = time.perf_counter()
        threads = [threading.Thread(target=lambda i=i: [once(i) for _ in range(rounds_per_client)])
                   for i in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
        after = stub.GetServerStats(generation_pb2.GetServerStatsRequest())
        tokens = clients * rounds_per_client * max_tokens
        drafts = after.num_drafts - before.num_drafts
        acc = after.accepted_tokens - before.accepted_tokens
        hits = after.draft_ahead_hits - before.draft_ahead_hits
        looked = hits + after.draft_ahead_misses - before.draft_ahead_misses
        return {"backend": backend, "pipeline": pipeline, "clients": clients, "seconds": round(dt, 2),
                "verify_batches_per_s": round((after.rounds - before.rounds) / dt, 1),
                "tokens_per_s": round(tokens / dt, 1),
                "accept_length": round((acc + drafts) / drafts, 3) if drafts else 0.0,
                "ahead_hit_share": round(hits / looked, 3) if looked else None}
    finally:
        server.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="local")
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--requests-per-client", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per engine")
    ap.add_argument("--modes", default="sequential,ahead,pingpong,auto")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = [run(args.backend, mode, args.clients, args.max_tokens, args.requests_per_client)
            for mode in args.modes.split(",")]
    print(f"{'pipeline':<11} {'clients':>7} {'verify batches/s':>16} {'tokens/s':>9} {'accept_len':>10} "
          f"{'ahead hits':>10}")
    for r in rows:
        share = "" if r["ahead_hit_share"] is None else f"{r['ahead_hit_share']:.2f}"
        print(f"{r['pipeline']:<11} {r['clients']:>7} {r['verify_batches_per_s']:>16} {r['tokens_per_s']:>9} "
              f"{r['accept_length']:>10} {share:>10}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
