"""Host time of the calls between a verdict and the next verify's forward (a prepared launch) on
the 8B-shaped bf16 target with CUDA graphs and the tree attention, in microseconds (median and
p90), each call timed in three states of the host and device:

    sleep   the device idle, the host back from a 2 ms sleep
    busy    the device still running about 9 ms of earlier work, the host hot
    sync    the host just back from a stream synchronize (as at a verdict)

    python benchmarks/launch_host_timing.py [--context 160] [--nodes 5] [--iters 60]

On the H200 `torch.cuda.Event.record()` without a stream costs 20-60 us (it asks for the current
stream; `record(stream)` 2-18 us); the copies' figures vary from run to run
(benchmarks/results/launch-host-timing-h200x2.txt, RESULTS.md).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.bench.llama8b import llama8b_spec, random_target
from verifier.runner import NativeRunner
from verifier.tree_inputs import host_tree_inputs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=160)
    p.add_argument("--nodes", type=int, default=5)
    p.add_argument("--iters", type=int, default=60)
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("launch_host_timing needs a CUDA device")
    model = random_target(llama8b_spec(), "cuda", torch.bfloat16, 0)
    layers = (2, 16, 29)   # three captured feature layers, as an EAGLE-3 head asks
    ctx, n = args.context, args.nodes
    runner = NativeRunner(model, layers, 1, ctx + 4 * n, cuda_graphs=True, triton_attention=True)
    g = torch.Generator().manual_seed(0)
    runner.prefill([0], [torch.randint(1, 1000, (ctx,), generator=g).tolist()])
    tok = torch.randint(1, 1000, (1, n), generator=g)
    par, val = (torch.arange(n) - 1)[None], torch.ones(1, n, dtype=torch.bool)
    runner.cache.reserve(0, ctx + n)
    pinned = host_tree_inputs(runner.cache, [0], [ctx], tok, par, val, 1)
    pageable = pinned.clone()
    for _ in range(3):
        runner.verify([0], [ctx], tok, par, val, flat=pinned)
    torch.cuda.synchronize()
    step = next(iter(runner.graphs._captured.values()))
    stream, event = torch.cuda.Stream(), torch.cuda.Event()

    def busy():
        step.graph.replay()
        step.graph.replay()

    def timed(fn, state: str) -> str:
        ts = []
        with torch.cuda.stream(stream):
            for _ in range(args.iters):
                torch.cuda.synchronize()
                if state == "sleep":
                    time.sleep(0.002)
                elif state == "busy":
                    busy()
                else:
                    busy()
                    stream.synchronize()
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return f"{1e6 * statistics.median(ts):7.1f} {1e6 * sorted(ts)[int(0.9 * len(ts))]:7.1f}"

    cases = {
        "graph replay": lambda: step.graph.replay(),
        "copy from pinned": lambda: step.flat.copy_(pinned, non_blocking=True),
        "copy from pageable": lambda: step.flat.copy_(pageable, non_blocking=True),
        "pinned copy + replay": lambda: (step.flat.copy_(pinned, non_blocking=True), step.graph.replay()),
        "pageable copy + replay": lambda: (step.flat.copy_(pageable, non_blocking=True), step.graph.replay()),
        "two replays": lambda: (step.graph.replay(), step.graph.replay()),
        "Event.record()": lambda: event.record(),
        "Event.record(stream)": lambda: event.record(stream),
        "torch.cuda.current_stream()": lambda: torch.cuda.current_stream(),
        "NativeRunner.verify(flat=)": lambda: runner.verify([0], [ctx], tok, par, val, flat=pinned),
        "PagedKVCache.reserve": lambda: runner.cache.reserve(0, ctx + n),
        "VerifyGraphs.run(flat=)": lambda: runner.graphs.run([0], [ctx], tok, par, val, layers, None, pinned),
    }
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, context {ctx}, {n} nodes, batch 1")
    print(f"{'us (median p90)':30s} {'sleep':>15s} {'busy':>15s} {'sync':>15s}")
    for name, fn in cases.items():
        print(f"{name:30s} " + "  ".join(timed(fn, s) for s in ("sleep", "busy", "sync")), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
