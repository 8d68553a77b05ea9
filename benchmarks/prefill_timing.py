"""Milliseconds per verifier prefill (`NativeRunner.prefill`, EAGLE-3 features captured) of the
8B-shaped bf16 target on the fast path (CUDA graphs, Triton attention), by batch and prompt
length: the eager forward against the graphed one (the prefill run as a verify of one chain per
prompt, verifier/runner.py `_prefill_graphed`), with a plain decode step and a 5-node chain
verify at batch 16 for scale. Each figure is the median of `--iters` calls, synchronized.

    python benchmarks/prefill_timing.py [--lengths 64,128,256] [--batches 1,2,4] [--iters 10]

Which path serve takes (the last column) is `NativeRunner._graphed_prefill_nodes`: graphed up to
GRAPHED_PREFILL_MAX tokens and GRAPHED_PREFILL_ROWS rows (batch bucket x padded length), past
GRAPHED_PREFILL_FREE_ROWS rows only where the padding is at most PREFILL_PAD_SHARE of the tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, iters: int) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return 1000 * statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="64,128,256", help="prompt tokens (default: %(default)s)")
    ap.add_argument("--batches", default="1,2,4", help="prompts per call (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=10, help="calls timed per figure (default: %(default)s)")
    a = ap.parse_args()

    import verifier.runner as vr
    from benchmarks.bench.llama8b import llama8b_spec, random_target
    from spectandem.feature_layers import aux_layers_from_config

    spec = llama8b_spec("full")
    model = random_target(spec, "cuda", torch.bfloat16, 0)
    layers = aux_layers_from_config({}, spec.num_layers)
    lengths = [int(x) for x in a.lengths.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    max_slots = max(16, max(batches))
    runner = vr.NativeRunner(model, layers, max_slots=max_slots, max_len=max(lengths) + 64, cuda_graphs=True,
                             triton_attention=True)
    g = torch.Generator().manual_seed(0)

    def prefill(b: int, n: int):
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for _ in range(b)]
        slots = list(range(b))
        return lambda: (runner.prefill(slots, prompts), [runner.cache.free(s) for s in slots])

    print(f"{'batch':>5} {'tokens':>6} {'eager ms':>9} {'graphed ms':>10}  serve takes")
    saved = vr.GRAPHED_PREFILL_MAX, vr.GRAPHED_PREFILL_ROWS, vr.GRAPHED_PREFILL_FREE_ROWS
    for b in batches:
        for n in lengths:
            vr.GRAPHED_PREFILL_MAX = 0
            eager = _timed(prefill(b, n), a.iters)
            vr.GRAPHED_PREFILL_MAX = vr.GRAPHED_PREFILL_ROWS = vr.GRAPHED_PREFILL_FREE_ROWS = 1 << 20
            fn = prefill(b, n)
            fn()   # its graph captured
            graphed = _timed(fn, a.iters)
            vr.GRAPHED_PREFILL_MAX, vr.GRAPHED_PREFILL_ROWS, vr.GRAPHED_PREFILL_FREE_ROWS = saved
            path = "graphed" if runner._graphed_prefill_nodes([[0] * n] * b) else "eager"
            print(f"{b:5d} {n:6d} {eager:9.2f} {graphed:10.2f}  {path}", flush=True)

    slots = list(range(16))
    for s in slots:
        runner.cache.reserve(s, 200)
    for n in (1, 5):
        toks = torch.randint(0, spec.vocab_size, (16, n), generator=g)
        parents = torch.arange(-1, n - 1).expand(16, n)
        valid = torch.ones(16, n, dtype=torch.bool)
        step = lambda: runner.verify(slots, [128] * 16, toks, parents, valid)
        step()
        print(f"verify batch 16, {n}-node chain at 128 tokens: {_timed(step, a.iters):.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
