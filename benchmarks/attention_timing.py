"""Microseconds per paged tree attention call (one layer) on Llama-3.1-8B attention shapes (32 heads,
8 kv heads, head_dim 128, block_size 16, bf16): the one-pass kernel (split_len None) against the
split-KV pair at the split_len PagedKVCache picks (`split_len_for`), by default at B in {1, 4, 16, 64},
T in {1, 5, 16} (a chain; 5 is serve's default tree of 4 drafts and its root), context in {256, 512,
2048}, tables as wide as a cache of context + 64 entries per request or of --capacity entries. CUDA only.

    python benchmarks/attention_timing.py [--iters 50] [--layers 32] [--split-lens 64,256] \
        [--contexts 256,512,2048] [--batches 1,4,16,64] [--tokens 1,5,16] [--capacity 131072]

One CUDA graph replays a call on each of --layers layers (distinct pools, as in a forward, so K/V do
not stay in L2 from one call to the next); a number is the median over --iters replays, each timed
by CUDA events, divided by --layers. Graphs because these kernels take a few microseconds, less than
the Python wrapper's launch: timed eagerly, the host would be measured.
"""

from __future__ import annotations

import argparse

import torch

from spectandem.block_manager import blocks_for
from spectandem.kernels.attention import paged_tree_attention_triton, split_len_for

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def attention_inputs(batch: int, num_tokens: int, context: int, layers: int, capacity: int | None = None) -> dict:
    """Request b holds `context` committed entries and T round entries on shuffled blocks; tables
    [B, width] as wide as the cache's (`capacity`, else context + 64 entries per request), -1 past
    the span."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    width = blocks_for((capacity or context + 64) + 1, BLOCK_SIZE)
    used = blocks_for(context + num_tokens, BLOCK_SIZE)
    order = torch.randperm(batch * used, generator=gen, device="cuda")
    tables = torch.full((batch, width), -1, dtype=torch.long, device="cuda")
    tables[:, :used] = order.view(batch, used)
    rows = batch * used * BLOCK_SIZE + 1
    pools = [tuple(torch.randn(rows, NUM_KV_HEADS, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
                   for _ in range(2)) for _ in range(layers)]
    q = torch.randn(batch, NUM_HEADS, num_tokens, HEAD_DIM, generator=gen, device="cuda", dtype=torch.bfloat16)
    prefix = torch.full((batch,), context, dtype=torch.long, device="cuda")
    return dict(q=q, pools=pools, tables=tables, prefix=prefix)


def call_us(inputs: dict, split_len: int | None, iters: int) -> float:
    """Median µs per call: a graph of one call per layer, replayed --iters times."""
    def forward() -> None:
        for k_pool, v_pool in inputs["pools"]:
            paged_tree_attention_triton(inputs["q"], k_pool, v_pool, inputs["tables"], inputs["prefix"], None,
                                        HEAD_DIM ** -0.5, BLOCK_SIZE, split_len=split_len)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()  # compiles
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    for _ in range(3):
        graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))  # ms
    return 1000 * sorted(times)[len(times) // 2] / len(inputs["pools"])


def _ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--split-lens", default="", help="comma-separated extra split_len columns, e.g. 64,256")
    p.add_argument("--contexts", default="256,512,2048", help="committed entries per request, comma-separated")
    p.add_argument("--batches", default="1,4,16,64", help="requests per call, comma-separated")
    p.add_argument("--tokens", default="1,5,16", help="query tokens per request (T), comma-separated")
    p.add_argument("--capacity", type=int, default=None,
                   help="entries per request of the cache whose tables are timed (default: context + 64; "
                        "serve's default for the 8B-shaped target: 131072)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("attention_timing needs a CUDA device")
    extra = [int(s) for s in args.split_lens.split(",") if s]
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, bf16, {NUM_HEADS} heads, "
          f"{NUM_KV_HEADS} kv heads, hd {HEAD_DIM}, block_size {BLOCK_SIZE}, {args.layers} layers per graph, "
          f"capacity {args.capacity or 'context + 64'}")
    header = f"{'context':>7} {'B':>3} {'T':>3} {'one-pass us':>11} {'split_len':>9} {'split us':>9} {'speed-up':>8}"
    print(header + "".join(f" {f'split {s} us':>13}" for s in extra))
    for context in _ints(args.contexts):
        for batch in _ints(args.batches):
            for num_tokens in _ints(args.tokens):
                inputs = attention_inputs(batch, num_tokens, context, args.layers, args.capacity)
                chosen = split_len_for(HEAD_DIM)
                one_pass = call_us(inputs, None, args.iters)
                split = call_us(inputs, chosen, args.iters)
                row = (f"{context:>7} {batch:>3} {num_tokens:>3} {one_pass:>11.2f} {chosen:>9} {split:>9.2f} "
                       f"{one_pass / split:>7.2f}x")
                print(row + "".join(f" {call_us(inputs, s, args.iters):>13.2f}" for s in extra), flush=True)
                del inputs
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
