"""Microseconds per fused add + RMSNorm launch (spectandem/kernels/fused.py) at H = 4096, bf16, by
rows (1 a decode step, 5 a chain, 16 a tree, 64 a batch) and warps per program. CUDA only.

    python benchmarks/rmsnorm_timing.py [--iters 30] [--warps 1,2,4,8]

One CUDA graph replays 65 launches (a forward's norms) over distinct buffers; a number is the
median over --iters replays (CUDA events) divided by 65. The warps change no bits (the kernel's
order follows its lanes); this run also checks that the outputs equal the default's.
"""

from __future__ import annotations

import argparse

import torch

from spectandem.kernels import fused
from spectandem.kernels.fused import add_rmsnorm_triton, reduction_layout

LAUNCHES = 65


def time_launches(rows: int, hidden: int, iters: int) -> tuple[float, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(rows)
    xs = [torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(LAUNCHES)]
    ds = [torch.randn(rows, hidden, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(LAUNCHES)]
    w = torch.randn(hidden, generator=gen, device="cuda", dtype=torch.bfloat16)
    outs = []

    def body():
        outs.clear()
        for x, d in zip(xs, ds):
            outs.append(add_rmsnorm_triton(x, d, w, 1e-5)[1])
    body()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / LAUNCHES)
    return sorted(times)[len(times) // 2], outs[-1].clone()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--rows", default="1,5,16,64")
    args = ap.parse_args()
    warps = [int(w) for w in args.warps.split(",")]
    default = fused.rmsnorm_warps
    print(f"{torch.cuda.get_device_name()}: add_rmsnorm, H 4096 bf16, us per launch (median of {args.iters})")
    print("rows  lanes  " + "  ".join(f"warps={w:<3}" for w in warps) + "  default")
    for rows in (int(r) for r in args.rows.split(",")):
        lanes = reduction_layout(rows, 4096)[0]
        base_us, base = time_launches(rows, 4096, args.iters)
        cells = []
        for w in warps:
            fused.rmsnorm_warps = lambda lanes, w=w: w
            try:
                us, out = time_launches(rows, 4096, args.iters)
            finally:
                fused.rmsnorm_warps = default
            cells.append(f"{us:9.2f}" + ("" if torch.equal(out, base) else "!"))
        print(f"{rows:4d}  {lanes:5d}  " + "  ".join(f"{c:>9}" for c in cells) + f"  {base_us:7.2f}")


if __name__ == "__main__":
    main()
