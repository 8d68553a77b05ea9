"""Where the router's rounds go at a large batch: the 8B-shaped bf16 target (or `--scale tiny` on
the CPU, a smoke test) behind the router over in-process links, `--batch` greedy requests at once,
in three setups:

    plain        the router without a drafter (the baseline of `spectandem bench --sections router8b`)
    spec-plain   the speculating router (drafter up, features requested) held in its "plain" mode
    sequential   the speculating router held in "sequential" at controlled acceptance `--rate`
    ahead        the same held in "ahead" (the drafter drafts ahead while the verifier verifies;
                 `--drafter-device cuda:1` puts the drafter on a GPU of its own)
    auto         the speculating router in "auto", choosing for itself (its first batch, untimed,
                 does the online measurement)

Per setup: ms per round, and the engines' busy ms per round by kind of call (busy_s of
router/links_local.py); wall ms per round inside chosen router, engine and runner functions (`TIMED`,
no synchronization added: a call that waits for the GPU includes the wait); then the host
functions that take the most time, from cProfile. On Python 3.12+ one profiler sees every
thread (the event loop and the links' worker threads together); on 3.11 the event loop's thread
and the engine calls are profiled apart.

    python benchmarks/profile_router.py [--batch 64] [--rate 0.8] [--setups plain,spec-plain,sequential]
    python benchmarks/profile_router.py --scale tiny --batch 8 --max-tokens 24
    python benchmarks/profile_router.py --batch 1 --setups sequential,ahead --drafter-device cuda:1
    python benchmarks/profile_router.py --batch 1 --setups ahead --drafter-device cuda:1 --trace 4

The head line (rate, ms per round, busy ms) and the functions' table are of the batch run under
cProfile, which slows every Python function (on one H100 at batch 64, a = 0.8, sequential, the
drafter's calls took 9.4 ms a round there against 4.1 ms in the engine loop and 6.1 ms served
with only timers and a 20 ms stack sampler on): compare them with each other, and take rates from
`--clean N`, which adds N unprofiled batches' wall and busy time first.

`--trace N` adds a batch with the timers on and no profiler, and prints N of its rounds as a
timeline: every timed call's start and end, by thread. `--kineto PATH` adds a batch under
torch.profiler (no timers), writes its Chrome trace to PATH and prints where each GPU idled
(benchmarks/gpu_gaps.py): the device's own timeline, not the host's view of it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import gc
import importlib
import inspect
import io
import pstats
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch

from router import links_local as router_links
from benchmarks.bench import router8b as br
from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target
from spectandem.config import GpuPaths

sys.path.insert(0, str(Path(__file__).parent))   # the sibling modules below
from profile_marks import MARKS, edges, round_marks  # noqa: E402  (a sibling module of this script)

SETUPS = ("plain", "spec-plain", "sequential", "ahead", "auto")
TIMED = ("router.loop:Router._schedule", "router.loop:Router._release", "router.loop:Router._commit",
         "router.loop:Router._draft", "router.loop:Router._verify", "router.loop:Router._apply",
         "router.loop:Router._extend", "router.loop:Router._resync",
         "verifier.service_core:verifier_verify", "verifier.engine:VerifierEngine.verify",
         "verifier.engine:VerifierEngine._accept", "verifier.engine:VerifierEngine.commit",
         "verifier.runner:NativeRunner.verify", "verifier.runner:NativeRunner.commit",
         "verifier.graphs:VerifyGraphs.run", "spectandem.kv_cache:PagedKVCache.reserve",
         "drafter.service_core:drafter_draft", "drafter.service_core:drafter_extend",
         "drafter.engine:DrafterEngine.draft", "drafter.engine:DrafterEngine.extend",
         "router.loop:Router._draft_ahead", "drafter.service_core:drafter_draft_ahead",
         "router.loop:Router._round", "verifier.engine:VerifierEngine._launch",
         "drafter.engine:DrafterEngine.draft_ahead", "drafter.engine:DrafterEngine.flush_deferred",
         "drafter.proposers:EagleProposer.ahead_chains", "drafter.proposers:EagleProposer.catch_up",
         "drafter.ahead_chains:ahead_inputs", "drafter.ahead_chains:AheadChainGraphs.run",
         "drafter.proposers:EagleProposer.catch_up_propose", "drafter.proposers:EagleProposer.catch_up_ahead_chains",
         "drafter.graphs:chain_inputs", "drafter.graphs:ChainGraphs.propose_caught_up",
         "drafter.ahead_chains:AheadChainGraphs.run_caught_up")


def resolve(name: str):
    """A "module:qualname" function's owner (its class, else its module) and its name there."""
    module, qual = name.split(":")
    cls_name, _, fn_name = qual.rpartition(".")
    owner = getattr(importlib.import_module(module), cls_name) if cls_name else importlib.import_module(module)
    return owner, fn_name


def profiled(name: str):
    """Wraps `name` (module:qualname) so each call runs under one cProfile.Profile -> it."""
    owner, fn_name = resolve(name)
    fn = getattr(owner, fn_name)
    prof = cProfile.Profile()

    @functools.wraps(fn)
    def wrapped(*a, **kw):
        prof.enable()
        try:
            return fn(*a, **kw)
        finally:
            prof.disable()
    setattr(owner, fn_name, wrapped)
    return prof


def profile_table(profiler, name: str, rounds: int, top: int = 30) -> str:
    """`profiled`'s functions by their own time and by their inclusive time, `top` of each."""
    out = []
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(top)
        out.append(f"cProfile inside {name}, over {rounds} rounds, by {order}:")
        out += [line for line in text.getvalue().splitlines()[4:] if line.strip()]
    return "\n".join(out)


class Timers:
    """Wall time inside each of TIMED (sync and async functions), summed per function."""

    def __init__(self, names: tuple[str, ...] = TIMED):
        self.ms: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.on = False
        self.trace: list | None = None    # (label, start, end, thread) of every timed call, when a list
        self._lock = threading.Lock()
        self._patched = []
        for name in names:
            owner, fn_name = resolve(name)
            if hasattr(owner, fn_name):   # (another tree, run to compare, may lack a function)
                self._patch(owner, fn_name, name.split(":")[1])

    def _add(self, label: str, t0: float) -> None:
        if self.on:
            t1 = time.perf_counter()
            with self._lock:
                self.ms[label] += 1000 * (t1 - t0)
                self.calls[label] += 1
                if self.trace is not None:
                    self.trace.append((label, t0, t1, threading.current_thread().name))

    def timeline(self, first: int, rounds: int) -> str:
        """The traced calls from round `first` (by Router._round's starts) for `rounds` rounds,
        in ms from that round's start, by start time: where a round's time goes, thread by thread."""
        starts = sorted(t0 for label, t0, _, _ in self.trace if label == "Router._round")
        if len(starts) <= first:
            return "   (too few rounds traced)"
        a = starts[first]
        b = starts[first + rounds] if len(starts) > first + rounds else float("inf")
        rows = [f"   {'start':>8s} {'end':>8s} {'ms':>6s}  {'thread':<18s} function"]
        for label, t0, t1, th in sorted(self.trace, key=lambda e: e[1]):
            if a <= t0 < b:
                rows.append(f"   {1000 * (t0 - a):8.3f} {1000 * (t1 - a):8.3f} {1000 * (t1 - t0):6.3f}  "
                            f"{th[:18]:<18s} {label}")
        return "\n".join(rows)

    def _patch(self, owner, fn_name: str, label: str) -> None:
        inner = getattr(owner, fn_name)
        if inspect.iscoroutinefunction(inner):
            @functools.wraps(inner)
            async def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return await inner(*args, **kwargs)
                finally:
                    self._add(label, t0)
        else:
            @functools.wraps(inner)
            def timed(*args, **kwargs):
                t0 = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self._add(label, t0)
        setattr(owner, fn_name, timed)
        self._patched.append((owner, fn_name, inner))
        if inspect.ismodule(owner):   # a function: the modules that imported it by name too
            for mod in list(sys.modules.values()):
                if mod is not owner and getattr(mod, fn_name, None) is inner:
                    setattr(mod, fn_name, timed)
                    self._patched.append((mod, fn_name, inner))

    def table(self, rounds: int) -> str:
        """Per function: calls, ms per round (the total over `rounds`) and ms per call."""
        rows = [f"   {'function':46s} {'calls':>6s} {'ms/round':>9s} {'ms/call':>8s}"]
        rows += [f"   {k:46s} {self.calls[k]:6d} {v / rounds:9.3f} {v / max(1, self.calls[k]):8.3f}" for k, v in
                 sorted(self.ms.items(), key=lambda kv: -kv[1])]
        return "\n".join(rows)

    def restore(self) -> None:
        for owner, fn_name, inner in reversed(self._patched):
            setattr(owner, fn_name, inner)


def _launch_costs(repeats: int = 20) -> str:
    """For every captured CUDA graph alive in this process (found through the garbage collector),
    on its own device: the host time of `replay()`, the time from an idle device's `replay()`
    call to the graph's end, and the graph's device time alone (replays queued behind a sleep
    that outlasts their launches). Launch latency = the second less the third. Replaying writes
    the graphs' static outputs and the cache rows of their last inputs: run it when no request
    is live."""
    graphs = [o for o in gc.get_objects() if isinstance(o, torch.cuda.CUDAGraph)]
    rows = [f"   {'graph':>16s} {'device':>6s} {'host replay us':>15s} {'idle start->end us':>19s} "
            f"{'device us':>10s} {'latency us':>11s}"]
    results = []
    for g in graphs:
        dev = getattr(g, "device", None)
        for d in ([] if dev is None else [dev.index or 0]):
            with torch.cuda.device(d):
                host, idle = [], []
                for _ in range(repeats):
                    torch.cuda.synchronize()
                    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    e0.record()
                    t0 = time.perf_counter()
                    g.replay()
                    host.append(time.perf_counter() - t0)
                    e1.record()
                    torch.cuda.synchronize()
                    idle.append(e0.elapsed_time(e1) / 1000)
                torch.cuda.synchronize()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(2e9 * 0.02 * repeats))     # outlasts the launches below
                e0.record()
                for _ in range(repeats):
                    g.replay()
                e1.record()
                torch.cuda.synchronize()
                alone = e0.elapsed_time(e1) / 1000 / repeats
            med = lambda xs: sorted(xs)[len(xs) // 2]
            results.append((alone, f"   {id(g) % 10**8:16d} {d:6d} {1e6 * med(host):15.1f} {1e6 * med(idle):19.1f} "
                                   f"{1e6 * alone:10.1f} {1e6 * (med(idle) - alone):11.1f}"))
            break
    rows += [r for _, r in sorted(results, key=lambda x: -x[0])]
    return "\n".join(rows)


def _top(prof: cProfile.Profile, n: int) -> str:
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(n)
    lines = buf.getvalue().splitlines()
    start = next((i for i, line in enumerate(lines) if "ncalls" in line), 0)
    return "\n".join(lines[start:])


async def _profile(runs, setup: str, rate: float, batch: int, top: int, plain_steps: int = 1,
                   clean: int = 0, gc_freeze: bool = False, trace: int = 0, kineto: str | None = None,
                   launch_cost: bool = False, marks: bool = False, device_gaps: int = 0) -> str:
    forced = {"spec-plain": "plain", "sequential": "sequential", "ahead": "ahead"}.get(setup)
    s = br._setup(runs, None if setup == "plain" else rate, setup if setup in ("ahead", "auto") else "sequential",
                  batch, plain_steps)
    if forced is not None:   # hold the mode: this router's chooser answers `forced` from now on
        s.router._modes.choose = lambda num_running, drafter_up: forced
    shared = sys.version_info >= (3, 12)      # one profiler sees every thread
    engine_prof = None if shared else cProfile.Profile()
    calls = {"on": False}
    inner_call = router_links._LocalLink._call

    def profiled(self, kind, fn, *args, **kw):
        if not calls["on"] or engine_prof is None:
            return inner_call(self, kind, fn, *args, **kw)
        engine_prof.enable()
        try:
            return inner_call(self, kind, fn, *args, **kw)
        finally:
            engine_prof.disable()

    router_links._LocalLink._call = profiled
    timers = Timers()
    gc_s: dict[int, list] = {}            # generation -> [collections, seconds] in the batch
    gc_t0 = [0.0]

    def on_gc(phase, info):
        if phase == "start":
            gc_t0[0] = time.perf_counter()
        else:
            n_t = gc_s.setdefault(info["generation"], [0, 0.0])
            n_t[0] += 1
            n_t[1] += time.perf_counter() - gc_t0[0]
    gc.callbacks.append(on_gc)
    counter = iter(range(10**6))
    ids = lambda: ([f"p{next(counter)}-{i}" for i in range(batch)], [i % runs.num_prompts for i in range(batch)])
    s.router.start()
    try:
        # (a time limit: a failing round leaves its requests waiting, and the run must end)
        await asyncio.wait_for(br._timed(s, runs, *ids()), 300)     # warm: graphs captured, allocator grown
        if gc_freeze:
            gc.collect()
            gc.freeze()      # what survived the warm-up is left out of every later collection
        clean_rows = []
        for _ in range(clean):   # without any profiler: wall and busy seconds of whole batches
            gc_s.clear()
            c = await asyncio.wait_for(br._timed(s, runs, *ids()), 300)
            busy = {f"{link}.{k}": round(1000 * v, 1) for link, d in zip(("verifier", "drafter"), c["busy"])
                    for k, v in sorted(d.items()) if v}
            gcs = {g: f"{n} x, {1000 * t:.1f} ms" for g, (n, t) in sorted(gc_s.items())}
            clean_rows.append(f"   clean: {c['tokens'] / c['seconds']:.0f} tokens/s, {1000 * c['seconds']:.1f} ms, "
                              f"{c['counters']['rounds']} rounds, busy ms {busy}, gc by generation {gcs}, "
                              f"mode {c['mode']}")
        timeline = ""
        if trace:   # one batch with the timers on and no profiler: its rounds' timeline
            timers.on, timers.trace = True, []
            try:
                await asyncio.wait_for(br._timed(s, runs, *ids()), 300)
            finally:
                timers.on = False
            timeline = f"-- timeline of rounds 4-{3 + trace} of a traced batch\n{timers.timeline(4, trace)}\n"
            timers.trace = None
            timers.ms.clear()
            timers.calls.clear()
        if marks:   # one batch with a few calls timed: where a round's time goes, as offsets
            light = Timers(MARKS)
            light.on, light.trace = True, []
            try:
                await asyncio.wait_for(br._timed(s, runs, *ids()), 300)
            finally:
                light.on = False
                light.restore()
            timeline += f"-- offsets from each verify launch (ms; {len(MARKS)} calls timed)\n{round_marks(light.trace, slowest=6)}\n"
            timeline += f"-- the batch's start and end\n{edges(light.trace)}\n"
        for i in range(device_gaps):   # batches timed on the verifier's GPU clock (device_gaps.py)
            from device_gaps import DeviceGaps

            dg, inner_batch = DeviceGaps(runs.device), br._batch

            async def batch_then_end(*a, **kw):
                try:
                    return await inner_batch(*a, **kw)
                finally:
                    dg.finish()
            br._batch, dg.on = batch_then_end, True
            try:
                await asyncio.wait_for(br._timed(s, runs, *ids()), 300)
            finally:
                br._batch, dg.on = inner_batch, False
                dg.restore()
            timeline += f"-- the verifier's GPU, batch {i + 1} (device_gaps.py)\n{dg.report()}\n"
        if kineto:   # one batch under torch.profiler: the GPUs' own timelines
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as kprof:
                await asyncio.wait_for(br._timed(s, runs, *ids()), 300)
            path = kineto.replace("{setup}", setup)
            kprof.export_chrome_trace(path)
            from gpu_gaps import summarize

            timeline += f"-- GPU timelines of a profiled batch ({path})\n{summarize(path)}\n"
        loop_prof = cProfile.Profile()
        calls["on"] = timers.on = True
        loop_prof.enable()
        try:
            m = await asyncio.wait_for(br._timed(s, runs, *ids()), 300)
        finally:
            loop_prof.disable()
            calls["on"] = timers.on = False
        if launch_cost:
            timeline += f"-- CUDA graph launches (every captured graph, replayed alone)\n{_launch_costs()}\n"
    finally:
        gc.callbacks.remove(on_gc)
        router_links._LocalLink._call = inner_call
        timers.restore()
        await s.router.stop()
    rounds = m["counters"]["rounds"]
    busy = "  ".join(f"{link}.{k} {1000 * v / rounds:.2f}" for link, d in zip(("verifier", "drafter"), m["busy"])
                     for k, v in sorted(d.items()) if v)
    head = (f"== {setup}: {m['tokens']} tokens in {m['seconds']:.3f} s, {m['tokens'] / m['seconds']:.0f} tokens/s, "
            f"{rounds} rounds, {1000 * m['seconds'] / rounds:.2f} ms/round\n   busy ms/round: {busy}")
    text = (f"{head}\n" + "".join(r + "\n" for r in clean_rows) + timeline
            + f"-- wall ms per round inside\n{timers.table(rounds)}\n")
    if shared:
        return text + f"-- every thread (top {top} by own time)\n{_top(loop_prof, top)}\n", head
    return (text + f"-- event loop thread (top {top} by own time)\n{_top(loop_prof, top)}\n"
            f"-- engine calls (top {top} by own time)\n{_top(engine_prof, top)}\n"), head


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rate", type=float, default=0.8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--plain-steps", type=int, default=4, help="plain rounds' tokens per call (serve's --plain-steps)")
    ap.add_argument("--clean", type=int, default=0, help="timed batches without a profiler first (their wall and busy time)")
    ap.add_argument("--setups", default="plain,spec-plain,sequential")
    ap.add_argument("--trace", type=int, default=0, help="print the timeline of this many rounds of a traced batch")
    ap.add_argument("--kineto", default=None,
                    help="Chrome trace path of one torch.profiler batch ({setup} is replaced); prints GPU idle gaps")
    ap.add_argument("--marks", action="store_true",
                    help="a batch with a few calls timed: their offsets from each verify launch")
    ap.add_argument("--device-gaps", type=int, default=0,
                    help="batches timed by events on the verifier's GPU: its idle gaps by the path of each launch")
    ap.add_argument("--launch-cost", action="store_true",
                    help="after the batches, time every captured CUDA graph's launch (host and latency)")
    ap.add_argument("--gc-freeze", action="store_true", help="gc.freeze() after each setup's warm-up batch")
    ap.add_argument("--drafter-device", default=None, help="the drafter's device (default: the target's)")
    ap.add_argument("--scale", choices=("full", "tiny"), default="full", help="tiny: a smoke test on the CPU")
    args = ap.parse_args()
    setups = [x for x in args.setups.split(",") if x]
    if bad := [x for x in setups if x not in SETUPS]:
        raise SystemExit(f"--setups: unknown {bad}; choose from {', '.join(SETUPS)}")
    device, dtype = ("cuda", torch.bfloat16) if args.scale == "full" else ("cpu", torch.float32)
    model = random_target(llama8b_spec(args.scale), device, dtype, 0)
    head = random_eagle3_head(model, SHAPES[args.scale]["draft_vocab_size"], device, dtype, 0)
    fast = GpuPaths(cuda_graphs=True, triton_attention=True) if device == "cuda" else GpuPaths()
    runs = ControlledRuns(model, head, device, args.batch, min(args.batch, 16), args.prompt_len, args.max_tokens,
                          args.steps, 0, fast)
    if args.drafter_device:
        runs = runs.with_drafter_device(args.drafter_device)
    heads = []
    for setup in setups:
        text, head_line = asyncio.run(_profile(runs, setup, args.rate, args.batch, args.top, args.plain_steps,
                                               args.clean, args.gc_freeze, args.trace, args.kineto,
                                               args.launch_cost, args.marks, args.device_gaps))
        heads.append(head_line)
        print(text, flush=True)
    print("\n".join(heads))


if __name__ == "__main__":
    main()
