"""The skinny GEMM (spectandem/kernels/skinny.py) against cuBLAS (F.linear) on the 8B target's
weight shapes, bf16, at M = 1, 5 and 16 rows: microseconds per call (triton.testing.do_bench,
which clears the L2 cache before each call, so the weight comes from DRAM as in a decode step),
the fraction of the measured copy bandwidth, the best tile per shape, and the largest difference
from an fp32 reference next to cuBLAS's. CUDA only.

    python benchmarks/gemv_timing.py [--rows 1,5,16] [--shapes qkv,o,...,head_lm]
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
import triton

from benchmarks.bench.command import copy_bandwidth
from spectandem.kernels.skinny import skinny_linear_triton

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096),
          # the EAGLE-3 head of the 8B shape: q/k/v over [embedding, hidden], fc over three target
          # layers, its LM head over the 32k draft vocabulary (its o, gate/up and down are above)
          "head_qkv": (6144, 8192), "head_fc": (4096, 12288), "head_lm": (32000, 4096)}
CONFIGS = [(bn, bk, w, s) for bn, bk, w, s in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4))
           if not (w == 8 and bn == 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,5,16")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    args = ap.parse_args()
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
        floor_us = n * k * 2 / bw * 1e6
        for m in (int(r) for r in args.rows.split(",")):
            x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
            ref = x.float() @ w.float().t()
            cublas = triton.testing.do_bench(lambda: F.linear(x, w), warmup=10, rep=60)
            err_cublas = (F.linear(x, w).float() - ref).abs().max().item()
            best = None
            for cfg in CONFIGS:
                try:
                    t = triton.testing.do_bench(lambda: skinny_linear_triton(x, w, config=cfg), warmup=5, rep=30)
                except Exception as exc:   # a tile that does not fit the shared memory
                    print(f"   {name} M={m} {cfg}: {type(exc).__name__}")
                    continue
                if best is None or t < best[0]:
                    best = (t, cfg)
            t, cfg = best
            err = (skinny_linear_triton(x, w, config=cfg).float() - ref).abs().max().item()
            print(f"{name:8s} N={n:6d} K={k:5d} M={m:2d}  cuBLAS {cublas * 1000:7.1f} us ({floor_us / (cublas * 1000):.2f})  "
                  f"skinny {t * 1000:7.1f} us ({floor_us / (t * 1000):.2f}) {cfg}  max err {err:.3g} vs cuBLAS {err_cublas:.3g}")


if __name__ == "__main__":
    main()
