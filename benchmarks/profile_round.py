"""Where a speculation round of the 8B-shaped bf16 target goes (batch 1, or `--batch` prompts at once): the controlled
acceptance run of `spectandem bench` (EAGLE-3 chain, the real head drafting, a = 0.8), on the
fast path, with each engine call timed between device synchronizations:

    verify   VerifierEngine.verify (the target's tree step, acceptance, commit)
    draft    DrafterEngine.draft (the head's chain of drafts)
    extend   DrafterEngine.extend (the head's catch-up over the accepted tokens)
    other    the rest of the loop (Python between the calls)

then the top CUDA kernels of a few rounds from torch.profiler. `--workload demo` does the same for
the demo pair's EAGLE-3 chain at `--batch` prompts at once (real acceptance), with plain decoding
of the same prompts for comparison.

    python benchmarks/profile_round.py [--rate 0.8] [--steps 4] [--max-tokens 96] [--top 15]
    python benchmarks/profile_round.py --workload demo --batch 4
    python benchmarks/profile_round.py --ahead     # each round also drafts ahead (drafter/ahead.py)

With --ahead, each round also runs DrafterEngine.draft_ahead (what the router overlaps with the
verify), timed as "ahead", with the proposer calls inside it timed on their own.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from drafter.engine import DrafterEngine
from drafter.controlled import ControlledProposer, plan_drafts
from spectandem.config import GpuPaths
from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target
from spectandem.reference import generate
from verifier.engine import VerifierEngine


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Timers:
    """Wraps engine methods: each call synchronized before and after, its wall time summed."""

    def __init__(self):
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._patched: list[tuple[type, str, object]] = []

    def wrap(self, cls: type, name: str, label: str) -> None:
        inner = getattr(cls, name)

        def timed(*args, **kwargs):
            _sync()
            t0 = time.perf_counter()
            out = inner(*args, **kwargs)
            _sync()
            self.ms[label] += 1000 * (time.perf_counter() - t0)
            self.calls[label] += 1
            return out
        setattr(cls, name, timed)
        self._patched.append((cls, name, inner))

    def restore(self) -> None:
        for cls, name, inner in reversed(self._patched):
            setattr(cls, name, inner)
        self._patched.clear()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: a smoke test on the CPU")
    ap.add_argument("--workload", choices=("llama8b", "demo"), default="llama8b")
    ap.add_argument("--batch", type=int, default=None, help="prompts at once (default: 1 for llama8b, 4 for demo)")
    ap.add_argument("--ahead", action="store_true", help="llama8b: draft ahead every round")
    args = ap.parse_args()
    if args.batch is None:
        args.batch = 4 if args.workload == "demo" else 1
    if args.workload == "demo":
        return demo(args)
    device, dtype = ("cuda", torch.bfloat16) if args.scale == "full" else ("cpu", torch.float32)
    model = random_target(llama8b_spec(args.scale), device, dtype, 0)
    head = random_eagle3_head(model, SHAPES[args.scale]["draft_vocab_size"], device, dtype, 0)
    fast = GpuPaths(cuda_graphs=True, triton_attention=True) if device == "cuda" else GpuPaths()
    b = args.batch
    runs = ControlledRuns(model, head, device, b, b, args.prompt_len, args.max_tokens, args.steps, 0, fast)
    plans = [plan_drafts(runs.truths[i], args.prompt_len, args.rate, runs.vocab_size, f"0:{i}") for i in range(b)]

    def once(tag: str):
        ids = [f"{tag}-{i}" for i in range(b)]
        drafter = DrafterEngine(ControlledProposer(runs.inner, dict(zip(ids, plans))), runs.cfg)
        return generate(runs.verifier, drafter, runs.prompts, [runs.params] * b, (), runs.lookahead, ids,
                        ahead=args.ahead)[0]

    report(once, device, args.rate, args.steps, args.top, args.ahead)


def demo(args) -> None:
    from benchmarks.bench.records import PROMPTS
    from spectandem.config import SamplingParams, SpecConfig
    from spectandem.demo import demo_paths
    from router.local import LocalSpeculator

    device = "cuda" if torch.cuda.is_available() else "cpu"
    fast = dict(cuda_graphs=True, triton_attention=True) if device == "cuda" else {}
    params = [SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)] * args.batch
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=args.batch, max_len=512,
                            device=device, **fast)
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3", num_steps=args.steps, topk=1,
                                                             num_draft_tokens=args.steps + 1),
                           max_slots=args.batch, max_len=512, device=device, **fast)
    prompts = [spec.tokenizer.encode(PROMPTS[i % len(PROMPTS)]).ids for i in range(args.batch)]
    for _ in range(2):
        plain.generate(prompts, params)
    _sync()
    t0 = time.perf_counter()
    out = plain.generate(prompts, params)
    _sync()
    steps = out[0].stats.num_rounds
    print(f"demo plain, batch {args.batch}: {1000 * (time.perf_counter() - t0) / steps:.3f} ms/step")
    report(lambda tag: spec.generate(prompts, params, [f"{tag}-{i}" for i in range(args.batch)])[0], device,
           None, args.steps, args.top)


def report(once, device: str, rate, steps: int, top: int, ahead: bool = False) -> None:
    """Times `once(tag)` (a generation whose completion it returns) part by part, then profiles it."""
    from drafter.proposers import EagleProposer

    once("warm")
    timers = Timers()
    timers.wrap(VerifierEngine, "verify", "verify")
    timers.wrap(DrafterEngine, "draft", "draft")
    timers.wrap(DrafterEngine, "extend", "extend")
    inside = ("ahead_chains", "ahead_fork", "ahead_absorb", "ahead_logprobs", "propose", "catch_up")
    if ahead:
        timers.wrap(DrafterEngine, "draft_ahead", "ahead")
        for name in inside:
            timers.wrap(EagleProposer, name, "  " + name)
    _sync()
    t0 = time.perf_counter()
    out = once("timed")
    _sync()
    total = 1000 * (time.perf_counter() - t0)
    timers.restore()
    rounds = out.stats.num_rounds
    print(f"a = {rate}, chain of {steps}: {len(out.token_ids)} tokens in {rounds} rounds, "
          f"accept length {len(out.token_ids) / rounds:.2f}, {total / len(out.token_ids):.2f} ms/token")
    print(f"{'part':<8} {'ms/round':>9}")
    parts = ("verify", "draft", "extend") + (("ahead",) if ahead else ())
    for label in parts:
        print(f"{label:<8} {timers.ms[label] / rounds:9.3f}")
    print(f"{'other':<8} {(total - sum(timers.ms[k] for k in parts)) / rounds:9.3f}")
    print(f"{'round':<8} {total / rounds:9.3f}")
    if ahead:
        print("proposer calls (inside draft, extend and ahead), ms/round and calls/round:")
        for name in inside:
            k = "  " + name
            print(f"  {name:<16} {timers.ms[k] / rounds:9.3f} {timers.calls[k] / rounds:6.1f}")

    # Unsynchronized wall time (what the bench measures) and the kernels of the whole loop.
    t0 = time.perf_counter()
    out = once("plain-wall")
    _sync()
    print(f"unsynchronized: {1000 * (time.perf_counter() - t0) / out.stats.num_rounds:.3f} ms/round")
    import cProfile
    import pstats

    prof_py = cProfile.Profile()
    prof_py.enable()
    out = once("cprofile")
    _sync()
    prof_py.disable()
    print(f"\nPython functions over {out.stats.num_rounds} rounds (cProfile, by own time)")
    pstats.Stats(prof_py).sort_stats("tottime").print_stats(top)
    pstats.Stats(prof_py).sort_stats("cumulative").print_stats(top + 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA if device == "cuda" else torch.profiler.ProfilerActivity.CPU]) as prof:
        out = once("profiled")
        _sync()
    print(f"\ntop CUDA kernels over {out.stats.num_rounds} rounds")
    print(prof.key_averages().table(sort_by="cuda_time_total" if device == "cuda" else "cpu_time_total", row_limit=top, max_name_column_width=70))


if __name__ == "__main__":
    main()
