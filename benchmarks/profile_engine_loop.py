"""The engine loop (no router, no server: benchmarks/bench/llama8b.py `ControlledRuns`) at one
batch size and controlled acceptance rate, with the wall time inside chosen functions: the
reference for the same functions timed in a served round (`benchmarks/profile_serve.py --time`)
or in the router (`benchmarks/profile_router.py`).

    python benchmarks/profile_engine_loop.py --batch 64 --rate 0.8 \\
        --time verifier.tree_inputs:host_tree_inputs,drafter.engine:DrafterEngine.draft
    python benchmarks/profile_engine_loop.py --scale tiny --batch 8 --max-tokens 24   # the CPU, a smoke test

One untimed run first (graphs captured, allocator grown), then one timed run of `--batch`
requests; prints its rate, rounds and the functions' ms per round and per call (no device
synchronization added: a call that waits for the GPU includes the wait). The engines' cache holds
the runs' requests only (prompt, tokens and lookahead), where `serve` sizes its caches for the
target's whole context.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path: run as a script)

from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target  # noqa: E402
from benchmarks.profile_router import TIMED, Timers, profile_table, profiled  # noqa: E402
from spectandem.config import GpuPaths  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.8, help="controlled acceptance rate (default: %(default)s)")
    ap.add_argument("--steps", type=int, default=4, help="drafts per chain (default: %(default)s)")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--time", default=",".join(TIMED), metavar="FUNCS",
                    help="comma-separated module:qualname (default: profile_router.py's TIMED)")
    ap.add_argument("--gpu-trace", metavar="PATH", help="trace the timed run with torch.profiler (device and host, "
                    "with stacks) into PATH and report the drafter's bursts (benchmarks/engine_traces.py)")
    ap.add_argument("--cprofile", metavar="FUNC", help="module:qualname run under cProfile in the timed run: the "
                    "functions inside its calls by their own time (from Python 3.12, every thread's while it is on)")
    ap.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: a smoke test on the CPU")
    args = ap.parse_args()
    device, dtype = ("cuda", torch.bfloat16) if args.scale == "full" else ("cpu", torch.float32)
    model = random_target(llama8b_spec(args.scale), device, dtype, 0)
    head = random_eagle3_head(model, SHAPES[args.scale]["draft_vocab_size"], device, dtype, 0)
    gpu = GpuPaths(cuda_graphs=True, triton_attention=True) if device == "cuda" else GpuPaths()
    runs = ControlledRuns(model, head, device, max_slots=args.batch, num_prompts=args.batch,
                          prompt_len=args.prompt_len, max_tokens=args.max_tokens, num_steps=args.steps, seed=0, gpu=gpu)
    runs.run(args.batch, args.rate, "warm")
    timers = Timers(tuple(f for f in args.time.split(",") if f))
    profiler = profiled(args.cprofile) if args.cprofile else None
    timers.on = True
    if args.gpu_trace:
        acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        with torch.profiler.profile(activities=acts, with_stack=True) as prof:
            res = runs.run(args.batch, args.rate, "timed")
        prof.export_chrome_trace(args.gpu_trace)
    else:
        res = runs.run(args.batch, args.rate, "timed")
    timers.on = False
    outs = res["completions"]
    rounds = max(o.stats.num_rounds for o in outs)
    tokens = sum(len(o.token_ids) for o in outs)
    print(f"engine loop, batch {args.batch}, a = {args.rate}, context up to {runs.max_len}: {tokens} tokens in "
          f"{res['seconds']:.3f} s, {tokens / res['seconds']:.1f} tok/s, {rounds} rounds, "
          f"{1000 * res['seconds'] / rounds:.2f} ms a round, output equal to the target's: {res['matches_truth']}")
    print(timers.table(rounds))
    if profiler is not None:
        print(profile_table(profiler, args.cprofile, rounds))
    if args.gpu_trace:
        from benchmarks.engine_traces import loop_report
        print(loop_report(args.gpu_trace))


if __name__ == "__main__":
    main()
