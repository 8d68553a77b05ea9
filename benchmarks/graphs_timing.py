"""Milliseconds per verify step at batch 1, eager vs CUDA graphs (verifier/graphs.py), for a chain
of N = 1 (plain decoding) and N = 16 nodes after a --context-token prompt: the demo target (fp32 and
bf16) and a Llama-3.1-8B-shaped bf16 target with random weights (benchmarks.bench.llama8b).
Also the demo EAGLE-3 argmax chain (drafter/graphs.py). CUDA only.

    python benchmarks/graphs_timing.py [--context 512] [--iters 50] [--skip-8b]

A step is the whole `NativeRunner.verify` call (reservation, input preparation, forward, copies of
the outputs), repeated at the same committed length; the median of --iters timed calls after
warm-up (the first graphed call captures).
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.bench.llama8b import llama8b_spec, random_target
from spectandem.demo import demo_paths
from spectandem.modeling.llama import load_llama
from verifier.runner import NativeRunner


def median_ms(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return 1000 * sorted(times)[len(times) // 2]


def verify_ms(model, n: int, context: int, iters: int, cuda_graphs: bool) -> float:
    runner = NativeRunner(model, None, max_slots=1, max_len=context + 64, cuda_graphs=cuda_graphs)
    g = torch.Generator().manual_seed(0)
    runner.prefill([0], [torch.randint(1, model.spec.vocab_size, (context,), generator=g).tolist()])
    tokens = torch.randint(1, model.spec.vocab_size, (1, n), generator=g)
    parents = (torch.arange(n) - 1)[None]                      # a chain: node j's parent is j - 1
    valid = torch.ones(1, n, dtype=torch.bool)
    return median_ms(lambda: runner.verify([0], [context], tokens, parents, valid), iters)


def chain_ms(context: int, iters: int, cuda_graphs: bool) -> float:
    from drafter.loader import load_head
    from drafter.proposers import DraftRequest, EagleProposer
    from spectandem.config import SamplingParams, SpecConfig

    target = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    head = load_head(demo_paths("eagle3")[1], target, kind="eagle3", dtype=torch.float32, device="cuda")
    cfg = SpecConfig(method="eagle3", num_steps=4, topk=1, num_draft_tokens=5)
    proposer = EagleProposer(head, cfg, max_slots=1, max_len=context + 64, cuda_graphs=cuda_graphs)
    g = torch.Generator().manual_seed(0)
    req = DraftRequest("r", torch.randint(1, 4096, (context,), generator=g).tolist(), SamplingParams(), 0, False)
    proposer.catch_up([req], [context - 1], [torch.randn(context - 1, head.spec.feature_size, device="cuda")])
    return median_ms(lambda: proposer.propose([req]), iters)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--skip-8b", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("graphs_timing needs a CUDA device")
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, context {args.context}, batch 1")
    print(f"{'target':<14} {'dtype':<9} {'N':>3} {'eager ms':>9} {'graph ms':>9} {'speed-up':>8}")
    targets = [("demo", lambda dt: load_llama(demo_paths("none")[0], dt, "cuda"), (torch.float32, torch.bfloat16))]
    if not args.skip_8b:
        targets.append(("llama8b-shape", lambda dt: random_target(llama8b_spec(), "cuda", dt, 0), (torch.bfloat16,)))
    for name, build, dtypes in targets:
        for dtype in dtypes:
            model = build(dtype)
            for n in (1, 16):
                eager = verify_ms(model, n, args.context, args.iters, cuda_graphs=False)
                graph = verify_ms(model, n, args.context, args.iters, cuda_graphs=True)
                print(f"{name:<14} {str(dtype).removeprefix('torch.'):<9} {n:>3} {eager:>9.3f} {graph:>9.3f} "
                      f"{eager / graph:>7.2f}x", flush=True)
            del model
            torch.cuda.empty_cache()
    eager, graph = chain_ms(args.context, args.iters, False), chain_ms(args.context, args.iters, True)
    print(f"{'demo eagle3':<14} {'float32':<9} {'S=4':>3} {eager:>9.3f} {graph:>9.3f} {eager / graph:>7.2f}x "
          "(draft chain)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
