"""Where a served round goes: `spectandem serve` in this process, driven by `spectandem bench
serve` (a separate process, over gRPC) at each `--concurrency`, with every thread's Python stack
sampled while the measured run lasts.

    python benchmarks/profile_serve.py --concurrency 16,64 -- --backend local --target T --draft H \
        --benchmark-acceptance-rate 0.8

Arguments after `--` are serve's. Per concurrency it prints bench serve's figures, and:
- engines: for the in-process backend, the share of the measured wall time each engine spent
  inside its calls, by kind (router/local_base.py busy_s: a verify's host preparation, its
  forward and its results on the host);
- threads: for each thread, the share of samples by (innermost project function, innermost
  frame), the top `--top`; a thread waiting (the event loop in its selector, a worker on its
  queue) shows where it waits. Samples are taken every `--interval-ms` (1 by default) with
  sys._current_frames, which needs the interpreter lock: a thread that holds it for long is
  sampled when it lets go, so shares are of lock turns rather than of time.
- router: the wall time inside each of the router's steps (router/loop.py: `_round`, `_draft`,
  `_verify`, `_apply`, `_admit`, ...), as a share of the measured run; nested steps count in
  their callers too, and an await's time includes the wait for the event loop to resume it;
- idle: for the in-process backend, the measured run's time in which neither engine was inside
  a call (the GPU waits for the host there: every call ends with its stream done), split by
  the innermost router step running at the time ("between steps" where none was), with the
  number of such gaps of 1 ms or more;
- engine calls: for the in-process backend, each kind of call's count and mean and median length;
- decode ahead: with `--decode-ahead` on the in-process backend, how many decodes took a queued
  one and how many queued ones were forgotten unused (verifier/engine.py);
- CPU: each kind of thread's CPU time over the measured run, as a share of one core (`thread_cpu`):
  how much of the time the event loop's thread, the engines' workers and the rest ran;
- `--sample-engines`: the engine processes serve starts (gRPC services, Ray actors) sampled the
  same way by a thread of their own (benchmarks/engine_sampler), each thread's share of samples
  and the chains of project frames where they were not waiting;
- `--time module:qualname,...`: wall time inside those functions (benchmarks/profile_router.py
  `Timers`, no device synchronization), per verify call;
- `--gpu-trace S`: on CUDA, S seconds of the measured run traced by torch.profiler (device
  activity only) and summarized by benchmarks/gpu_gaps.py: how busy the GPU was. With
  `--trace-host` the trace also records the host's torch calls with their Python stacks, which
  slows the host: on one H100 at 64 running requests the served rate halved (2,239 tok/s at
  a = 0.8 sequential, 2,707 plain), so its gaps say where the host held the GPU up, not for how
  long.

With `--learn` (controlled acceptance), one unmeasured pass over the prompts first lets the
drafter learn each prompt's greedy continuation, and a second one, and each concurrency's prompts
once before they are measured, let `--pipeline auto` measure its modes with drafts that are
accepted, as benchmarks/serve_matrix.py does.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import json
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.request_path import PARTS, project_file  # noqa: E402  (after the path: run as a script)
from benchmarks.serve_matrix import bench_serve  # noqa: E402


def _project(filename: str) -> str | None:
    return project_file(filename, PARTS + ("benchmarks",))


class StackSampler:
    """Every `interval` seconds while `active()` holds, each other thread's (name, innermost
    project function, innermost frame) counted."""

    def __init__(self, interval: float, active):
        self.interval, self.active = interval, active
        self.counts: Counter = Counter()
        self.samples = 0
        self._on = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stack-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me = threading.get_ident()
        paths: dict[str, str | None] = {}
        while not self._stop.is_set():
            time.sleep(self.interval)
            if not self._on.is_set() or not self.active():
                continue
            names = {t.ident: t.name for t in threading.enumerate()}
            self.samples += 1
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                leaf = f"{Path(frame.f_code.co_filename).name}:{frame.f_code.co_name}"
                inner = "-"
                f = frame
                while f is not None:
                    fn = f.f_code.co_filename
                    if fn not in paths:
                        paths[fn] = _project(fn)
                    if paths[fn] is not None:
                        inner = f"{paths[fn]}:{f.f_code.co_qualname}"
                        break
                    f = f.f_back
                self.counts[(_thread_kind(names.get(ident, "?")), inner, leaf)] += 1

    def start(self) -> None:
        self.counts.clear()
        self.samples = 0
        self._on.set()

    def pause(self) -> None:
        self._on.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def report(self, top: int) -> str:
        by_thread: dict[str, Counter] = {}
        for (thread, inner, leaf), n in self.counts.items():
            by_thread.setdefault(thread, Counter())[(inner, leaf)] += n
        lines = [f"  {self.samples} samples"]
        for thread, c in sorted(by_thread.items(), key=lambda kv: -sum(kv[1].values())):
            total = sum(c.values())
            lines.append(f"  thread {thread}: {total} samples")
            for (inner, leaf), n in c.most_common(top):
                lines.append(f"    {100 * n / total:5.1f}%  {inner}  [{leaf}]")
        return "\n".join(lines)


def _engine_files_report(folder: Path, files_of, heading: str, wait_s: float) -> list[str]:
    """The report files the engine processes (benchmarks/engine_sampler) wrote for the measured run
    that just ended, `files_of(folder)` of them: each writes its own once the run's marker is gone;
    a pair's two are waited for (a plain server's one: until `wait_s` runs out). Each file's lines
    under "engine process <name><heading>:"; taken, then removed."""
    deadline = time.monotonic() + wait_s
    files = []
    while time.monotonic() < deadline:
        time.sleep(0.2)
        files = files_of(folder)
        if len(files) >= 2:
            time.sleep(0.2)
            files = files_of(folder)
            break
    lines = []
    for f in files:
        lines.append(f"  engine process {f.stem}{heading}:")
        lines += [f"    {line}" for line in f.read_text().splitlines() if line.strip()]
        f.unlink()
    return lines


def engine_samples_report(folder: Path, wait_s: float = 2.0) -> str:
    """What the engine processes' samplers wrote for the measured run that just ended."""
    lines = _engine_files_report(folder, lambda d: sorted(f for f in d.glob("*.txt") if not f.name.startswith("cprofile-")),
                                 "", wait_s)
    return "\n".join(lines) if lines else "  engine processes: no samples (a process of its own per engine is needed)"


def engine_cprofile_report(folder: Path, wait_s: float = 20.0) -> str:
    """The cProfile tables the engine processes (SPECTANDEM_ENGINE_CPROFILE) wrote for the
    measured run that just ended (a large profile takes seconds to write)."""
    lines = _engine_files_report(folder, lambda d: sorted(d.glob("cprofile-*.txt")), " under cProfile", wait_s)
    return "\n".join(lines) if lines else "  engine processes: no cProfile tables (a process of its own per engine is needed)"


def _engine_events(folder: Path, wait_s: float = 2.0) -> list[tuple[str, float, float]]:
    """The calls the engine processes recorded over the measured run that just ended
    (benchmarks/engine_sampler, SPECTANDEM_ENGINE_TIMELINE), merged; taken, then removed."""
    deadline = time.monotonic() + wait_s
    files = []
    while time.monotonic() < deadline:
        time.sleep(0.2)
        files = sorted(folder.glob("timeline-*.json"))
        if len(files) >= 2:
            time.sleep(0.2)
            files = sorted(folder.glob("timeline-*.json"))
            break
    events = []
    for f in files:
        events += [tuple(e) for e in json.loads(f.read_text())]
        f.unlink()
    return sorted(events, key=lambda e: e[1])


# A round's hand-offs, in the order they happen on a split pair's sequential round, each timed
# from the end of the last verify's forward (verify.engine): (label, where it is read).
ROUND_MARKS = (
    ("the verifier starts sending the verdicts (verify.verdicts)", "verify.verdicts.t0"),
    ("the verifier replies (its call ends)", "verifier"),
    ("the drafter starts on the verdict (draft_next)", "draft_next.t0"),
    ("the router has the reply (_verify ends)", "router_reply"),
    ("the router sends the draft call (_draft_call)", "router_draft"),
    ("the router sends the next verify (_verify)", "router_verify"),
    ("its gRPC call goes out (VerifierStub.Verify)", "router_verify_send"),
    ("the drafter has posted the next trees early (draft_next.post)", "draft_next.post.t1"),
    ("the drafter is done with the verdict", "draft_next.t1"),
    ("the drafter starts the draft call", "draft.t0"),
    ("the drafter has posted the trees (draft.post)", "draft.post.t1"),
    ("a handler thread of the verifier takes up the next verify (verify.queue)", "verify.queue.t0"),
    ("the verifier starts the next verify", "verify.t0"),
    ("the trees are in (verify.tree_wait ends)", "verify.tree_wait.t1"),
    ("the next forward starts (verify.engine)", "verify.engine.t0"),
)


# The legs of a round, each timed within the round from one ROUND_MARKS key to another: (label,
# from, to); from "both" is the later of the drafter's early post and the next verify's start.
ROUND_LEGS = (
    ("the verdicts to the drafter (sending starts -> the drafter starts)", "verify.verdicts.t0", "draft_next.t0"),
    ("the drafter on the verdict (it starts -> the next trees posted)", "draft_next.t0", "draft_next.post.t1"),
    ("the reply to the router (the verifier's call ends -> the router has it)", "verifier", "router_reply"),
    ("the router's turn (it has the reply -> it sends the next verify)", "router_reply", "router_verify"),
    ("the gRPC leg (the call goes out -> a verifier handler takes it up)", "router_verify_send", "verify.queue.t0"),
    ("the trees taken (the later of the post and the verify's start -> the tree wait ends)", "both",
     "verify.tree_wait.t1"),
)


def round_timeline_report(events: list[tuple[str, float, float]], steps: list[tuple[str, float, float]]) -> str:
    """Medians over the rounds of when each hand-off of ROUND_MARKS happens, from the end of the
    last verify's forward, from the engines' recorded calls (`events`) and the router's steps
    (`steps`, this process's clock: the same host clock). A round counts where the verifier's
    reply and its next forward are found; each mark is of the rounds it was found in (a draft call
    that took the early trees posts none; a round without early trees has no draft_next.post)."""
    by: dict[str, list[tuple[float, float]]] = {}
    for name, t0, t1 in events:
        by.setdefault(name, []).append((t0, t1))
    for name, t0, t1 in steps:
        by.setdefault("router" + name, []).append((t0, t1))
    engine = by.get("verify.engine", [])
    if len(engine) < 2:
        return "  round timeline: fewer than two verify forwards recorded (a split pair's engines are needed)"

    def first(name: str, lo: float, hi: float, end: bool = False):
        """The first interval of `name` starting (or, `end`, ending) within [lo, hi): its (t0, t1)."""
        for t0, t1 in by.get(name, []):
            if lo <= (t1 if end else t0) < hi:
                return t0, t1
        return None

    offsets: dict[str, list[float]] = {label: [] for label, _ in ROUND_MARKS}
    legs: dict[str, list[float]] = {label: [] for label, _, _ in ROUND_LEGS}
    rounds = drafter_last = 0
    for (_, e_end), (e_next, _) in zip(engine, engine[1:]):
        call = first("verify", e_end, e_next, end=True)
        nxt = first("verify", e_end, e_next + 1e-9)
        if call is None or nxt is None:
            continue
        rounds += 1
        draft_next = first("draft_next", e_end - 1e-3, e_next)
        found = {
            "verify.verdicts.t0": first("verify.verdicts", e_end, e_next, end=True),
            "verifier": call, "draft_next.t0": draft_next, "draft_next.t1": draft_next,
            "draft_next.post.t1": first("draft_next.post", e_end, e_next),
            "router_reply": (first("router_verify", e_end, e_next, end=True)
                             or first("router_verify_with_prefill", e_end, e_next, end=True)),
            "router_draft": first("router_draft_call", e_end, e_next),
            "router_verify": first("router_verify", e_end, e_next) or first("router_verify_with_prefill", e_end, e_next),
            "router_verify_send": first("router_verify_send", e_end, e_next),
            "draft.t0": first("draft", e_end, e_next), "draft.post.t1": first("draft.post", e_end, e_next),
            "verify.queue.t0": first("verify.queue", e_end, e_next), "verify.t0": nxt,
            "verify.tree_wait.t1": first("verify.tree_wait", e_end, e_next),
            "verify.engine.t0": (e_next, e_next)}
        ends = {"verifier", "draft_next.post.t1", "draft_next.t1", "router_reply", "draft.post.t1", "verify.tree_wait.t1"}
        at = {key: t[1 if key in ends else 0] for key, t in found.items() if t is not None}
        for label, key in ROUND_MARKS:
            if key in at:
                offsets[label].append(1e3 * (at[key] - e_end))
        if "draft_next.post.t1" in at and "verify.t0" in at:
            at["both"] = max(at["draft_next.post.t1"], at["verify.t0"])
            drafter_last += at["draft_next.post.t1"] > at["verify.t0"]
        for label, a, b in ROUND_LEGS:
            if a in at and b in at:
                legs[label].append(1e3 * (at[b] - at[a]))
    if not rounds:
        return "  round timeline: no round with the verifier's reply and its next forward recorded"
    lines = [f"  round timeline, {rounds} of {len(engine) - 1} rounds, ms after the last verify's forward "
             f"(median, p90, rounds with the mark):"]
    for label, _ in ROUND_MARKS:
        lines += _quantile_line(offsets[label], label)
    if any(legs.values()):
        lines.append("  each round's legs, ms (median, p90, rounds with both ends):")
        for label, _, _ in ROUND_LEGS:
            lines += _quantile_line(legs[label], label)
        if legs[ROUND_LEGS[-1][0]]:
            lines.append(f"  the drafter's early post came after the next verify started in {drafter_last} of "
                         f"{len(legs[ROUND_LEGS[-1][0]])} rounds")
    return "\n".join(lines)


def _quantile_line(values: list[float], label: str) -> list[str]:
    """One report line: the median, the p90 and the count of `values`, then `label` (none if empty)."""
    d = sorted(values)
    return [f"    {d[len(d) // 2]:7.2f} {d[min(len(d) - 1, len(d) * 9 // 10)]:7.2f} {len(d):5d}  {label}"] if d else []


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user and system) each kind of thread of this process has used so far: Python
    threads by `_thread_kind` of their name, every other thread (gRPC's core, PyTorch's, ...) as
    "threads without Python". A thread running Python holds the interpreter lock, so a Python
    thread's CPU time bounds its turns at the lock from above (a call that lets the lock go, a
    device synchronize spinning say, counts too)."""
    tick = os.sysconf("SC_CLK_TCK")
    python = {t.native_id: _thread_kind(t.name) for t in threading.enumerate()}
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            stat = Path(f"/proc/self/task/{tid}/stat").read_text()
        except OSError:   # the thread ended meanwhile
            continue
        fields = stat[stat.rindex(")") + 2:].split()   # after the name, which may hold spaces
        kind = python.get(int(tid), "threads without Python")
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def cpu_report(before: dict[str, float], after: dict[str, float], wall: float) -> str:
    used = {k: after[k] - before.get(k, 0.0) for k in after}
    return "  CPU per thread kind, share of one core over the measured run: " + ", ".join(
        f"{k} {100 * v / wall:.1f}%" for k, v in sorted(used.items(), key=lambda kv: -kv[1]) if v > 0)


def _thread_kind(name: str) -> str:
    """A thread's name with pool indices dropped, so a pool's threads add up."""
    return name.rstrip("0123456789").rstrip("_-") or name


ROUTER_STEPS = ("_let_arrivals_land", "_settle", "_schedule", "_admit", "_prefill_verifier", "_drafter_prefill",
                "_round", "_resync", "_draft", "_draft_call", "_verify", "_verify_with_prefill", "_after_prefill", "_apply", "_extend", "_draft_ahead", "_release",
                "_commit")


class Timeline:
    """(name, start, end) of every router step and engine call while `on`; cleared by the caller."""

    def __init__(self):
        self.on = False
        self.steps: list[tuple[str, float, float]] = []
        self.calls: list[tuple[str, float, float]] = []

    def clear(self) -> None:
        self.steps, self.calls = [], []


def _time_router(router, timeline: Timeline) -> dict[str, float]:
    """Wraps the router's steps (ROUTER_STEPS) on each replica's Router with timers -> their
    accumulated seconds, by name (cleared by the caller); each step's interval goes to
    `timeline` while it is on."""
    import functools

    acc: dict[str, float] = dict.fromkeys(ROUTER_STEPS, 0.0)

    def done(name: str, t0: float) -> None:
        t1 = time.perf_counter()
        acc[name] += t1 - t0
        if timeline.on:
            timeline.steps.append((name, t0, t1))

    for r in getattr(router, "replicas", [router]):
        for name in ROUTER_STEPS:
            fn = getattr(r, name)
            if asyncio.iscoroutinefunction(fn):
                async def timed(*args, _fn=fn, _name=name, **kw):
                    t0 = time.perf_counter()
                    try:
                        return await _fn(*args, **kw)
                    finally:
                        done(_name, t0)
            else:
                def timed(*args, _fn=fn, _name=name, **kw):
                    t0 = time.perf_counter()
                    try:
                        return _fn(*args, **kw)
                    finally:
                        done(_name, t0)
            setattr(r, name, functools.wraps(fn)(timed))
        stub = getattr(getattr(r, "verifier", None), "stub", None)   # a gRPC verifier link: when its Verify goes out
        if stub is not None and hasattr(stub, "Verify"):
            send = stub.Verify

            def sending(*args, _send=send, **kw):
                t0 = time.perf_counter()
                call = _send(*args, **kw)
                done("_verify_send", t0)
                return call
            stub.Verify = sending
    acc["_verify_send"] = 0.0
    return acc


def _time_engine_calls(state: dict, timeline: Timeline) -> None:
    """Records each in-process engine call (router/local_base.py `_call`: from its start in the
    worker thread until its stream is done) on `timeline` while it is on."""
    from router.local_base import _LocalLink

    for role in ("verifier", "drafter"):
        link = state.get(role)
        if not isinstance(link, _LocalLink):   # another backend's links have no engine calls here
            continue

        def call(kind, fn, *args, _inner=link._call, _role=role):
            t0 = time.perf_counter()
            try:
                return _inner(kind, fn, *args)
            finally:
                if timeline.on:
                    timeline.calls.append((f"{_role}.{kind}", t0, time.perf_counter()))
        link._call = call


def idle_report(timeline: Timeline, start: float, end: float, top: int) -> str:
    """The time in [start, end] outside every engine call, by the innermost router step running
    then (the one that started last), and how many such gaps last 1 ms or more."""
    calls = sorted((t0, t1) for _, t0, t1 in timeline.calls if t1 > start and t0 < end)
    gaps, cur = [], start
    for t0, t1 in calls:
        if t0 > cur:
            gaps.append((cur, min(t0, end)))
        cur = max(cur, t1)
    if cur < end:
        gaps.append((cur, end))
    steps = sorted(timeline.steps, key=lambda s: s[1])
    starts = [s0 for _, s0, _ in steps]
    longest = max((s1 - s0 for _, s0, s1 in steps), default=0.0)
    by: Counter = Counter()
    for g0, g1 in gaps:
        # The steps that overlap the gap; the gap split at their boundaries, each piece going to
        # the innermost step running then.
        near = [s for s in steps[bisect.bisect_left(starts, g0 - longest): bisect.bisect_right(starts, g1)]
                if s[2] > g0]
        cuts = sorted({g0, g1, *(t for _, s0, s1 in near for t in (s0, s1) if g0 < t < g1)})
        for a, b in zip(cuts, cuts[1:]):
            mid = (a + b) / 2
            inner = max((s for s in near if s[1] <= mid < s[2]), key=lambda s: s[1], default=None)
            by[inner[0].lstrip("_") if inner else "between steps"] += b - a
    wall = end - start
    idle = sum(b - a for a, b in gaps)
    long = [b - a for a, b in gaps if b - a >= 1e-3]
    lines = [f"  idle (no engine call) {100 * idle / wall:.1f}% of the wall: {len(long)} gaps of 1 ms or more, "
             f"{1e3 * sum(long):.0f} ms in all" + (f", the longest {1e3 * max(long):.1f} ms" if long else "")]
    lines += [f"    {100 * v / wall:5.1f}%  {k}" for k, v in by.most_common(top)]
    return "\n".join(lines)


def calls_report(timeline: Timeline) -> str:
    """Each kind of engine call on `timeline`: how many, and their mean and median length."""
    by: dict[str, list[float]] = {}
    for name, t0, t1 in timeline.calls:
        by.setdefault(name, []).append(t1 - t0)
    parts = []
    for name, d in sorted(by.items(), key=lambda kv: -sum(kv[1])):
        d = sorted(d)
        parts.append(f"{name} {len(d)} x {1e3 * sum(d) / len(d):.2f} ms (p50 {1e3 * d[len(d) // 2]:.2f})")
    return "  engine calls: " + ", ".join(parts)


def _busy(state: dict) -> dict:
    """{role: {kind: seconds inside such calls}} of the in-process engines."""
    from router.local_base import _LocalLink

    return {role: dict(link.busy_s) for role in ("verifier", "drafter")
            if isinstance(link := state.get(role), _LocalLink)}


def _service_calls(state: dict) -> dict:
    """{role: (busy seconds by kind, calls by kind, counters)} of engines in processes of their
    own, as their services report them (EngineInfo.calls: spectandem/call_clock.py; the counters:
    EngineInfo.extra's numbers, such as the feature channel's messages by the way they went)."""

    from router.local_base import _LocalLink

    out = {}
    loop = state["router"]._task.get_loop()
    for role in ("verifier", "drafter"):
        link = state.get(role)
        if link is None or isinstance(link, _LocalLink):   # in-process: `_busy` and the timeline
            continue
        info = asyncio.run_coroutine_threadsafe(link.info(), loop).result(30)
        if info.calls:
            counters = {k: v for k, v in info.extra.items() if isinstance(v, int) and not isinstance(v, bool)}
            out[role] = (dict(info.calls["busy_s"]), dict(info.calls["count"]), counters)
    return out


def _ahead_counts(state: dict) -> tuple[int, int] | None:
    """The in-process verifier's decodes taken from a decode ahead and those forgotten unused
    (verifier/engine.py), or None (no such engine here)."""
    engine = getattr(state.get("verifier"), "engine", None)
    if engine is None or not getattr(engine, "decode_ahead", False):
        return None
    return engine.ahead_used, engine.ahead_dropped


def _bench(port: int, concurrency: int, num_prompts: int, max_tokens: int, out: Path, during=None) -> dict:
    """One `spectandem bench serve` run (benchmarks/serve_matrix.py), no warm-up requests."""
    return bench_serve(port, concurrency, num_prompts, max_tokens, 0, None, out, during)


class InProcessClient:
    """bench serve's requests (its prompts, seeds, timers and summary) submitted to the served
    router on its own event loop, as the public servicers submit them, with no gRPC between: what
    the public API's servicing costs the serving process is the difference from a gRPC run."""

    def __init__(self, router):
        self.router = router

    async def start(self) -> str:
        return "in-process"

    async def send(self, text: str, seed: int, result) -> None:
        from benchmarks.bench.serve import _Timer
        from router.server import encode_text
        from spectandem.config import SamplingParams
        from router.requests import Failure

        ids = await asyncio.to_thread(encode_text, self.router.tokenizer, text)
        req = self.router.submit(ids, SamplingParams(max_tokens=self.max_tokens, seed=seed, ignore_eos=True), None)
        timer = _Timer(result)
        while True:
            ev = await req.events.get()
            if isinstance(ev, Failure):
                raise RuntimeError(f"{ev.code}: {ev.message}")
            timer.tokens(ev.token_ids)
            if ev.finish_reason is not None:
                result.spec, result.prompt_tokens = ev.stats, len(ids)
                break
        timer.done()

    async def close(self) -> None:
        pass

    def run(self, concurrency: int, num_prompts: int, max_tokens: int, during=None) -> dict:
        """One run like `_bench`'s, on the served loop -> bench serve's summary."""
        from benchmarks.bench.datasets import DEFAULT_DATASET, load_prompts
        from benchmarks.bench.serve import ServeBenchConfig, _acceptance, _drive, _jobs, _Progress, summarize

        config = ServeBenchConfig(num_prompts=num_prompts, max_concurrency=concurrency, max_tokens=max_tokens,
                                  ignore_eos=True, num_warmups=0, progress=False)
        self.max_tokens = max_tokens
        prompts = load_prompts(DEFAULT_DATASET, seed=config.seed)
        jobs = _jobs(config, [p.text for p in prompts])

        async def drive():
            t0 = time.perf_counter()
            results = await _drive(self, jobs, config, None, _Progress(len(jobs), False, "bench"))
            return results, time.perf_counter() - t0

        future = asyncio.run_coroutine_threadsafe(drive(), self.router._task.get_loop())
        if during is not None:
            during()
        results, duration = future.result(1800)
        failed = [r for r in results if not r.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} in-process requests failed; the first: {failed[0].error}")
        out = summarize(config, results, duration, "in-process", prompts)
        out.update(_acceptance(config, results, None, None))
        return out


def _device_trace(router, seconds: float, path: Path, host: bool = False) -> str:
    """A torch.profiler trace of the device (`host`: and of the host's torch calls with their
    Python stacks), `seconds` long from the first active request, summarized by
    benchmarks/gpu_gaps.py."""
    import torch

    from benchmarks.gpu_gaps import summarize

    acts = [torch.profiler.ProfilerActivity.CUDA] + ([torch.profiler.ProfilerActivity.CPU] if host else [])
    while router.num_active == 0:
        time.sleep(0.001)
    with torch.profiler.profile(activities=acts, with_stack=host) as prof:
        time.sleep(seconds)
    prof.export_chrome_trace(str(path))
    return summarize(str(path), top=8)


def _engine_trace_report(folder: Path, keep: Path, wait_s: float = 30.0) -> str:
    """benchmarks/engine_traces.py on the traces the engine processes wrote over the run that
    just ended, then moved to `keep`."""
    from benchmarks.engine_traces import served_report

    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not list(folder.glob("trace-drafter-*.json")):
        time.sleep(0.5)
    time.sleep(1.0)
    keep.mkdir(parents=True, exist_ok=True)
    for f in folder.glob("trace-*.json"):
        f.rename(keep / f.name)
    return served_report(keep) + f"\n    (traces in {keep})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ours, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="16", help="comma-separated (default: %(default)s)")
    ap.add_argument("--prompts-per-slot", type=int, default=3, help="measured prompts per unit of concurrency (default: 3)")
    ap.add_argument("--max-tokens", type=int, default=128, help="tokens per request (default: %(default)s)")
    ap.add_argument("--interval-ms", type=float, default=1.0, help="sampling interval (default: %(default)s)")
    ap.add_argument("--top", type=int, default=12, help="entries per thread (default: %(default)s)")
    ap.add_argument("--learn", action="store_true", help="one unmeasured pass first (controlled acceptance)")
    ap.add_argument("--gpu-trace", type=float, default=0.0, help="seconds of device trace per run (default: none)")
    ap.add_argument("--trace-host", action="store_true",
                    help="the device trace also records the host's torch calls with their Python stacks")
    ap.add_argument("--trace-dir", default=None, help="where the device traces are kept (default: a temporary folder)")
    ap.add_argument("--time", default="", metavar="FUNCS",
                    help="comma-separated module:qualname functions to time during the measured runs")
    ap.add_argument("--cprofile", metavar="FUNC", help="module:qualname (a function, not a coroutine) run under cProfile during the "
                    "measured runs (in this process), or \"all\": this process for the whole measured run: the "
                    "functions inside its calls by their own time (from Python 3.12 cProfile sees every "
                         "thread's calls while it is on: other threads' functions show among them)")
    ap.add_argument("--client", choices=("grpc", "in-process"), default="grpc",
                    help="grpc: `spectandem bench serve` in a process of its own; in-process: the same requests "
                         "submitted to the router on the serving event loop, without the public API "
                         "(InProcessClient) (default: %(default)s)")
    ap.add_argument("--sample-engines", action="store_true",
                    help="sample the stacks of the engine processes serve starts too (benchmarks/engine_sampler)")
    ap.add_argument("--engine-timeline", action="store_true",
                    help="record the engine processes' timed calls (benchmarks/engine_sampler) and report when each "
                         "hand-off of a round happens")
    ap.add_argument("--engine-trace", type=float, default=0.0, metavar="S",
                    help="on CUDA, S seconds of each engine process's device work traced, from a second into the "
                         "measured run (benchmarks/engine_sampler), reported by benchmarks/engine_traces.py")
    ap.add_argument("--engine-cprofile", action="store_true",
                    help="each engine process serve starts under cProfile during the measured run, every thread of it "
                         "from Python 3.12 (benchmarks/engine_sampler): its functions by own and inclusive time")
    ap.add_argument("--out", help="write the report here too")
    a = ap.parse_args(ours)

    from router.serve import configure_process
    from tests.router.conftest import Served

    concurrency = [int(x) for x in a.concurrency.split(",") if x]
    work = Path(tempfile.mkdtemp(prefix="profile-serve-"))
    engine_samples = None
    if a.sample_engines or a.engine_timeline or a.engine_trace or a.engine_cprofile:   # read by the engine processes serve starts, which inherit this environment
        engine_samples = work / "engine-samples"
        engine_samples.mkdir()
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(ROOT / "benchmarks" / "engine_sampler")] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])
        if a.sample_engines:
            os.environ["SPECTANDEM_ENGINE_SAMPLES"] = str(engine_samples)
        if a.engine_timeline:
            os.environ["SPECTANDEM_ENGINE_TIMELINE"] = str(engine_samples)
        if a.engine_cprofile:
            os.environ["SPECTANDEM_ENGINE_CPROFILE"] = str(engine_samples)
        if a.engine_trace:
            os.environ.update(SPECTANDEM_ENGINE_TRACE=str(engine_samples), SPECTANDEM_ENGINE_TRACE_S=str(a.engine_trace))
    # The process-wide settings `spectandem serve` makes (engine threads, switch interval).
    served = Served(serve_args, lambda args: configure_process(args, os.environ.get("OMP_NUM_THREADS"), os.environ)).wait_ready(600)
    router = served.state["router"]
    sampler = StackSampler(a.interval_ms / 1000, lambda: router.num_active > 0)
    timeline = Timeline()
    steps = _time_router(router, timeline)
    _time_engine_calls(served.state, timeline)
    timers = None
    if a.time:
        from benchmarks.profile_router import Timers
        timers = Timers(tuple(f for f in a.time.split(",") if f))
    profiler = None
    if a.cprofile == "all":   # the whole measured run (every thread from Python 3.12)
        import cProfile
        profiler = cProfile.Profile()
    elif a.cprofile:
        from benchmarks.profile_router import profiled
        profiler = profiled(a.cprofile)
    port = served.state["port"]
    bench = _bench
    if a.client == "in-process":
        client = InProcessClient(router)
        bench = lambda port, c, n, max_tokens, out, during=None: client.run(c, n, max_tokens, during)  # noqa: E731
    report = [f"--client {a.client}; serve {' '.join(serve_args)}"]
    try:
        if a.learn:
            n = a.prompts_per_slot * max(concurrency)
            bench(port, max(concurrency), n, a.max_tokens + 16, work / "learn.json")
            # Once more, as benchmarks/serve_matrix.py does: `auto` measured its modes while no draft
            # was accepted yet, and a measured run straight after would see it unlearn that.
            bench(port, max(concurrency), n, a.max_tokens, work / "settle.json")
        for c in concurrency:
            n = a.prompts_per_slot * c
            bench(port, c, n if a.learn else c, a.max_tokens, work / f"warm-c{c}.json")   # graphs, auto's first picks
            busy0 = _busy(served.state)
            remote0 = _service_calls(served.state)
            ahead0 = _ahead_counts(served.state)
            gpu = []
            trace_dir = Path(a.trace_dir) if a.trace_dir else work
            trace_dir.mkdir(parents=True, exist_ok=True)
            during = (lambda: gpu.append(_device_trace(router, a.gpu_trace, trace_dir / f"trace-c{c}.json", a.trace_host))
                      if a.gpu_trace > 0 else None)
            sampler.start()
            cpu0 = thread_cpu()
            steps.update(dict.fromkeys(steps, 0.0))
            counters = [r.counters for r in getattr(router, "replicas", [router])]
            mixed0, admitted0 = (sum(c.mixed_prefills for c in counters), sum(c.requests_admitted for c in counters))
            handed0 = sum(c.prefills_with_verdicts for c in counters)
            modes0 = [dict(c.mode_rounds) for c in counters]
            rounds0 = sum(c.rounds for c in counters)
            timeline.clear()
            timeline.on = True
            if timers:
                timers.ms.clear()
                timers.calls.clear()
                timers.on = True
            if profiler is not None:
                profiler.clear()
                if a.cprofile == "all":
                    profiler.enable()
            if engine_samples is not None:
                (engine_samples / "on").touch()
            res = bench(port, c, n, a.max_tokens, work / f"c{c}.json", during)
            if profiler is not None and a.cprofile == "all":
                profiler.disable()
            if engine_samples is not None:
                (engine_samples / "on").unlink()
            timeline.on = False
            if timers:
                timers.on = False
            wall = res["duration_s"]
            cpu1 = thread_cpu()
            sampler.pause()
            busy1 = _busy(served.state)
            report.append(f"\n== concurrency {c}: {res['output_throughput']:.1f} tok/s, ttft p50 {res['p50_ttft_ms']:.1f} ms, "
                          f"tpot p50 {res['p50_tpot_ms']:.2f} ms, itl p50/p99 {res['p50_itl_ms']:.2f}/{res['p99_itl_ms']:.2f} ms, "
                          f"accept {res.get('acceptance_length')}, {n} requests in {wall:.2f} s")
            for role, after in busy1.items():
                before = busy0.get(role, {})
                parts = {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}
                report.append(f"  {role} busy {100 * sum(parts.values()) / wall:.1f}% of the wall: " +
                              ", ".join(f"{k} {100 * v / wall:.1f}%" for k, v in sorted(parts.items(), key=lambda kv: -kv[1])))
            for role, (busy, count, numbers) in _service_calls(served.state).items():
                b0, n0, m0 = remote0.get(role, ({}, {}, {}))
                kinds = sorted(busy, key=lambda k: -(busy[k] - b0.get(k, 0.0)))
                report.append(f"  {role} (a process of its own), inside its calls: " + ", ".join(
                    f"{k} {count[k] - n0.get(k, 0)} x {1000 * (busy[k] - b0.get(k, 0.0)) / (count[k] - n0.get(k, 0)):.2f} ms"
                    for k in kinds if count[k] > n0.get(k, 0)))
                grown = {k: v - m0.get(k, 0) for k, v in numbers.items() if v != m0.get(k, 0)}
                if grown:
                    report.append(f"  {role}'s counters over the run: " + ", ".join(f"{k} +{v}" for k, v in sorted(grown.items())))
            ahead1 = _ahead_counts(served.state)
            if ahead0 is not None and ahead1 is not None:
                report.append(f"  decode ahead: {ahead1[0] - ahead0[0]} decodes took a queued one, "
                              f"{ahead1[1] - ahead0[1]} queued ones were forgotten unused")
            report.append(f"  admitted {sum(c.requests_admitted for c in counters) - admitted0}, of which sent with a "
                          f"verify step {sum(c.mixed_prefills for c in counters) - mixed0}, of which prefilled on the "
                          f"drafter with the verdicts {sum(c.prefills_with_verdicts for c in counters) - handed0}")
            modes = Counter()
            for cnt, m0 in zip(counters, modes0):
                modes.update({m: n - m0.get(m, 0) for m, n in cnt.mode_rounds.items()})
            report.append("  rounds by pipeline mode: " + ", ".join(f"{m} {n}" for m, n in modes.most_common() if n))
            report.append("  router: " + ", ".join(f"{k.lstrip('_')} {100 * v / wall:.1f}%" for k, v in steps.items()
                                                   if v > 0))
            if timeline.calls:   # the measured run: from the first engine call to the last one's end
                report.append(calls_report(timeline))
                report.append(idle_report(timeline, min(t0 for _, t0, _ in timeline.calls),
                                          max(t1 for _, _, t1 in timeline.calls), a.top))
            report.append(cpu_report(cpu0, cpu1, wall))
            report.append(sampler.report(a.top))
            if a.engine_timeline:
                report.append(round_timeline_report(_engine_events(engine_samples), timeline.steps))
            if a.sample_engines:
                report.append(engine_samples_report(engine_samples))
            if a.engine_cprofile:
                report.append(engine_cprofile_report(engine_samples))
            if a.engine_trace:
                report.append(_engine_trace_report(engine_samples, trace_dir / f"engine-traces-c{c}"))
            report += gpu
            if timers:
                # Rounds: the in-process verifier's verify calls, else the router's (engines elsewhere).
                rounds = (sum(name == "verifier.verify" for name, _, _ in timeline.calls)
                          or sum(c.rounds for c in counters) - rounds0)
                report.append(f"  timed functions (inclusive wall time, no device synchronization; per round, "
                              f"{rounds} of them, and per call):\n" + timers.table(max(1, rounds)))
            if profiler is not None:
                from benchmarks.profile_router import profile_table
                report.append(profile_table(profiler, a.cprofile, sum(cnt.rounds for cnt in counters) - rounds0))
            print("\n".join(report[-5:]), flush=True)
    finally:
        sampler.close()
        served.close()
    text = "\n".join(report) + "\n"
    if a.out:
        Path(a.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
