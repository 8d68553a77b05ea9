"""Where a verify step of the 8B-shaped bf16 target spends its time, on the fast path (CUDA graphs
and the Triton tree attention), at batch 1 after --context tokens, for a one-token decode step, a
5-node chain and a 16-node tree:

- wall: the whole `NativeRunner.verify` call, synchronized before and after (median);
- host: the same call without the closing sync (input preparation and launches: the time the GPU
  waits for the host when the previous step's result was needed first);
- gpu: the sum of the step's CUDA kernel times (torch.profiler, over 5 steps);
- commit: `NativeRunner.commit` of the accepted path (the whole chain, the root alone for decode
  and tree), synchronized;
- the top kernels of each shape.

    python benchmarks/profile_verify.py [--context 512] [--top 10]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench.llama8b import TREE16_PARENTS, llama8b_spec, random_target
from spectandem.config import GpuPaths
from verifier.runner import NativeRunner


def _median(fn, iters: int, sync_after: bool = True) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if sync_after:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return 1000 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--top", type=int, default=10)
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    model = random_target(llama8b_spec("full"), "cuda", torch.bfloat16, 0)
    paths = GpuPaths(cuda_graphs=True, triton_attention=True)
    runner = NativeRunner(model, None, max_slots=1, max_len=args.context + 64, **paths.runner_kwargs())
    g = torch.Generator().manual_seed(0)
    v = model.spec.vocab_size
    runner.prefill([0], [torch.randint(1, v, (args.context,), generator=g).tolist()])
    shapes = {"decode": (-1,), "chain5": (-1, 0, 1, 2, 3), "tree16": TREE16_PARENTS}
    rows, tables = [], []
    for name, parents in shapes.items():
        n = len(parents)
        step = ([0], [args.context], torch.randint(1, v, (1, n), generator=g), torch.tensor([parents]),
                torch.ones(1, n, dtype=torch.bool))
        accepted = torch.tensor([list(range(n)) if name == "chain5" else [0]])
        wall = _median(lambda: runner.verify(*step), args.iters)
        host = _median(lambda: runner.verify(*step), args.iters, sync_after=False)
        commit = _median(lambda: runner.commit([0], [args.context], accepted), args.iters)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.verify(*step)
            torch.cuda.synchronize()
        events = prof.key_averages()
        gpu = sum(e.self_device_time_total for e in events) / 5 / 1000
        rows.append((name, n, wall, host, gpu, commit))
        tables.append(f"\n== {name} ({n} nodes): top CUDA kernels over 5 steps\n"
                      + events.table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
    print(f"{torch.cuda.get_device_name()}, context {args.context}, bf16, fast path")
    print(f"{'shape':8} {'nodes':>5} {'wall ms':>8} {'host ms':>8} {'gpu ms':>8} {'commit ms':>9}")
    for name, n, wall, host, gpu, commit in rows:
        print(f"{name:8} {n:5d} {wall:8.3f} {host:8.3f} {gpu:8.3f} {commit:9.3f}")
    print("".join(tables))


if __name__ == "__main__":
    main()
