"""Host time of a verify step's input preparation on the tree-attention path
(verifier.graphs.tree_verify_inputs: tree shapes, physical rows, block tables, the packed buffer)
for a decode step, a 5-node chain and a 16-node tree at batch 1 and 16, with the cache layout of
the 8B shape (8 KV heads, head_dim 128, block 16, 2048 entries). Runs on the CPU; on a GPU host
the same work also pays kernel launches where it uses device tensors.

    python benchmarks/host_prep_timing.py [--iters 300]
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench.llama8b import TREE16_PARENTS
from spectandem.kv_cache import PagedKVCache
from verifier.tree_inputs import tree_verify_inputs


def median_us(fn, iters: int) -> float:
    for _ in range(20):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    cache = PagedKVCache(2, 64, 8, 2048, 128, torch.bfloat16, "cpu", block_size=16)
    print(f"{'batch':>5} {'shape':8} {'us':>8}")
    for b in (1, 16):
        for slot in range(b):
            cache.reserve(slot, 600)
        for name, parents in (("decode", (-1,)), ("chain5", (-1, 0, 1, 2, 3)), ("tree16", TREE16_PARENTS)):
            n = len(parents)
            step = (cache, list(range(b)), [512] * b, torch.randint(0, 1000, (b, n)), torch.tensor([parents] * b),
                    torch.ones(b, n, dtype=torch.bool), b)
            print(f"{b:5d} {name:8} {median_us(lambda: tree_verify_inputs(*step), args.iters):8.1f}")


if __name__ == "__main__":
    main()
