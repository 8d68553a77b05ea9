"""Where a plain decoding step of the 8B-shaped bf16 target spends its GPU time: the top CUDA
kernels of one `NativeRunner.verify` call (N = 1) at batch 1, eager and CUDA-graphed, CUDA-graphed
with the Triton paged tree attention (no span gather, no dense mask), and the batch-invariant path,
from torch.profiler; then `--chain` steps of `NativeRunner.decode_greedy` on the fast path (steps
chained on the device): wall and summed kernel time per step, and the kernels grouped by kind.
CUDA only.

    python benchmarks/profile_decode.py [--context 512] [--top 12] [--chain 16] [--only-chain]
"""

from __future__ import annotations

import argparse
import time

import torch

from graphs_timing import median_ms  # benchmarks/: this script's own folder
from benchmarks.bench.llama8b import llama8b_spec, random_target
from spectandem.config import GpuPaths
from verifier.runner import NativeRunner


def _runner(model, context: int, paths: GpuPaths) -> tuple[NativeRunner, tuple]:
    runner = NativeRunner(model, None, max_slots=1, max_len=context + 64, **paths.runner_kwargs())
    g = torch.Generator().manual_seed(0)
    runner.prefill([0], [torch.randint(1, model.spec.vocab_size, (context,), generator=g).tolist()])
    args = ([0], [context], torch.randint(1, model.spec.vocab_size, (1, 1), generator=g), torch.tensor([[-1]]),
            torch.ones(1, 1, dtype=torch.bool))
    return runner, args


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--only-chain", action="store_true")
    args = ap.parse_args()
    model = random_target(llama8b_spec("full"), "cuda", torch.bfloat16, 0)
    if not args.only_chain:
        _steps(model, args)
    _chained(model, args)


def _chained(model, args) -> None:
    paths = GpuPaths(cuda_graphs=True, triton_attention=True)
    runner = NativeRunner(model, None, max_slots=1, max_len=args.context + 8 * args.chain + 8, **paths.runner_kwargs())
    g = torch.Generator().manual_seed(0)
    runner.prefill([0], [torch.randint(1, model.spec.vocab_size, (args.context,), generator=g).tolist()])
    n, tok = args.context, 1

    def call():
        nonlocal n, tok
        out, _ = runner.decode_greedy([0], [n], [tok], args.chain)
        tok, n = int(out[0, -1]), n + args.chain
    for _ in range(2):
        call()
    torch.cuda.synchronize()
    walls = []
    for _ in range(3):
        t0 = time.perf_counter()
        call()
        walls.append((time.perf_counter() - t0) / args.chain * 1000)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events) / 1000 / args.chain
    kinds: dict[str, float] = {}
    for e in events:
        k = "matmul" if any(s in e.key for s in ("nvjet", "gemv", "gemm", "splitK", "cutlass")) else e.key[:48]
        kinds[k] = kinds.get(k, 0.0) + e.self_device_time_total / 1000 / args.chain
    print(f"\n== chained x{args.chain} (cuda-graphs+triton-attention): {sorted(walls)[1]:.3f} ms per step (median "
          f"wall of 3 calls), kernels {total:.3f} ms per step")
    for k, ms in sorted(kinds.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"   {ms:8.3f} ms/step  {k}")


def _steps(model, args) -> None:
    for name, paths in (("eager", GpuPaths()), ("cuda-graphs", GpuPaths(cuda_graphs=True)),
                        ("cuda-graphs+triton-attention", GpuPaths(cuda_graphs=True, triton_attention=True)),
                        ("batch-invariant", GpuPaths(batch_invariant=True))):
        runner, step_args = _runner(model, args.context, paths)
        ms = median_ms(lambda: runner.verify(*step_args), 30)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                runner.verify(*step_args)
            torch.cuda.synchronize()
        print(f"\n== {name}: {ms:.2f} ms per step (median wall), top CUDA kernels over 5 steps")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))
        runner.release(0)
        del runner
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
