"""A draft-sized CPU workload timed alone, right after a target-sized one in the same process, and
right after the same target-sized one in another process on the same core: whether what runs
before it on its core (a split pair's verify, then its draft) slows it, and whether the process
boundary adds to that.

    python benchmarks/after_forward.py --core 1 --calls 300 --repeats 3

"target": eight blocks of a norm and six 256 x 512 GEMMs over 20 rows and a 4096 x 256 head,
about the demo target's 24 MB of fp32 weights; "draft": six steps of six 256 x 256 GEMMs, a 2048 x
256 head and an argmax over one row, about the demo EAGLE-3 head's weights. One torch thread,
both on `--core`; the other process is driven through a pipe, one target pass per draft.
Reports the draft's CPU time a call (time.thread_time) in each arrangement, each repeat.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import time

import torch
import torch.nn.functional as F


def _target():
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(256, 512, generator=g) for _ in range(8 * 6)]
    head = torch.randn(4096, 256, generator=g)
    x = torch.randn(20, 256, generator=g)

    def forward():
        h = x
        for w in weights:
            h = (F.rms_norm(h, (256,)) @ w)[:, :256] * 0.1 + h
        return h @ head.T
    return forward


def _draft():
    g = torch.Generator().manual_seed(1)
    weights = [torch.randn(256, 256, generator=g) for _ in range(6)]
    head = torch.randn(2048, 256, generator=g)
    emb = torch.randn(4096, 256, generator=g)

    def draft():
        h = torch.zeros(1, 256)
        for step in range(6):
            h = h + emb[step:step + 1]
            for w in weights:
                h = F.rms_norm(h @ w, (256,)) + h
            int((h @ head.T).argmax(-1))
        return h
    return draft


def _other_process(conn, core: int) -> None:
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    forward = _target()
    while conn.recv():
        forward()
        conn.send(1)


def _timed(draft, before, calls: int) -> float:
    total = 0.0
    for _ in range(calls):
        before()
        start = time.thread_time()
        draft()
        total += time.thread_time() - start
    return 1e3 * total / calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--core", type=int, default=1)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    os.sched_setaffinity(0, {args.core})
    torch.set_num_threads(1)
    forward, draft = _target(), _draft()
    for _ in range(20):
        forward()
        draft()
    rows = {"alone": [], "after the target, this process": [], "after the target, another process": []}
    for _ in range(args.repeats):
        rows["alone"].append(_timed(draft, lambda: None, args.calls))
        rows["after the target, this process"].append(_timed(draft, forward, args.calls))
        mine, theirs = mp.Pipe()
        other = mp.Process(target=_other_process, args=(theirs, args.core))
        other.start()

        def remote() -> None:
            mine.send(1)
            mine.recv()
        for _ in range(20):
            remote()
        rows["after the target, another process"].append(_timed(draft, remote, args.calls))
        mine.send(0)
        other.join()
    print(f"the draft's CPU time a call, ms, core {args.core}, {args.calls} calls a repeat:")
    for name, values in rows.items():
        print(f"  {name:36s} " + "  ".join(f"{v:.3f}" for v in values))


if __name__ == "__main__":
    main()
