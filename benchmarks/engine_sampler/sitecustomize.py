"""A stack sampler for the engine processes `spectandem serve` starts, for
benchmarks/profile_serve.py --sample-engines: that script puts this folder first on the
PYTHONPATH the engine processes inherit, and names a folder in SPECTANDEM_ENGINE_SAMPLES. Python
imports this module at the start of every process; in a drafter's or a verifier's process
(`python -m drafter` / `python -m verifier`, or a Ray worker, whose actor it cannot tell) a
thread then samples every other thread's Python stack every millisecond while the folder holds a
file named "on", and each time that file goes it writes the counts to <folder>/<kind>-<pid>.txt
(each run's counts on their own), where some thread ran project code (not an idle Ray worker). Nothing here runs in a process started without that variable.

Each sample counts, per thread, its innermost project frame and innermost frame, and the chain of
its last CHAIN project frames. The sampler needs the interpreter lock to look: a thread that holds
the lock for long is seen when it lets go, so shares are of the sampler's turns rather than of
time; a thread that waits without the lock (a device synchronize, a socket read) is seen where it
waits.

With SPECTANDEM_ENGINE_TIMELINE naming a folder (profile_serve.py --engine-timeline), an engine
process records instead each call and part of a call its CallClock times (spectandem/call_clock.py:
"verify", "verify.tree_wait", "draft_next", "draft.post", ...) as (kind, start, end) on the host's
monotonic clock, which every process shares, while that folder holds "on"; each time the file
goes it writes them to <folder>/timeline-<kind>-<pid>.json.

With SPECTANDEM_ENGINE_TRACE naming a folder (profile_serve.py --engine-trace S), an engine
process that has CUDA in use traces its own device work with torch.profiler (CUDA activity only)
for SPECTANDEM_ENGINE_TRACE_S seconds, starting SPECTANDEM_ENGINE_TRACE_DELAY_S seconds after the
folder's "on" appears, and writes the trace to <folder>/trace-<kind>-<pid>.json.

With SPECTANDEM_ENGINE_CPROFILE naming a folder (profile_serve.py --engine-cprofile), an engine
process runs under cProfile while that folder holds "on" (every thread's calls from Python 3.12)
and, each time the file goes, writes its functions by own time and by inclusive time to
<folder>/cprofile-<kind>-<pid>.txt."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import Counter

_FOLDER = os.environ.get("SPECTANDEM_ENGINE_SAMPLES")
_TIMELINE = os.environ.get("SPECTANDEM_ENGINE_TIMELINE")
_PROJECT = ("/drafter/", "/verifier/", "/spectandem/", "/router/")
CHAIN = 6
INTERVAL_S = 0.001


def _kind() -> str | None:
    """The engine process's kind from its command line (set only after this module runs)."""
    argv = " ".join(sys.argv)
    for kind in ("drafter", "verifier"):
        if f"{kind}/__main__.py" in argv or f"-m {kind}" in argv:
            return kind
    return "ray-worker" if "default_worker.py" in argv else None


def _where(frame) -> tuple[str, str, str]:
    """(innermost project frame, innermost frame, the chain of the last CHAIN project frames)."""
    leaf = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_code.co_name}"
    project = []
    while frame is not None:
        path = frame.f_code.co_filename
        if any(part in path for part in _PROJECT):
            project.append(f"{'/'.join(path.rsplit('/', 2)[-2:])}:{frame.f_code.co_name}:{frame.f_lineno}")
        frame = frame.f_back
    inner = project[0] if project else "-"
    return inner, leaf, " > ".join(reversed(project[:CHAIN]))


def _write(path: str, samples: int, counts: Counter, chains: Counter) -> None:
    per_thread = Counter()
    for (thread, _, _), n in counts.items():
        per_thread[thread] += n
    lines = [f"samples {samples}"]
    for thread, total in per_thread.most_common():
        lines.append(f"thread {thread}: {total}")
        for (t, inner, leaf), n in counts.most_common():
            if t == thread and n * 200 >= total:   # 0.5% of the thread's samples or more
                lines.append(f"  {100 * n / total:5.1f}%  {inner}  [{leaf}]")
    lines.append("chains (outer > inner), every thread, outside waits:")
    for (thread, chain), n in chains.most_common(60):
        lines.append(f"  {n:7d}  {thread}: {chain}")
    with open(path + ".tmp", "w") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(path + ".tmp", path)


def _run(folder: str) -> None:
    time.sleep(1.0)   # sys.argv is set after this module runs
    kind = _kind()
    if kind is None:
        return
    mark, me = os.path.join(folder, "on"), threading.get_ident()
    out = os.path.join(folder, f"{kind}-{os.getpid()}.txt")
    counts, chains, samples, on, checked = Counter(), Counter(), 0, False, 0.0
    while True:
        time.sleep(INTERVAL_S)
        now = time.monotonic()
        if now - checked > 0.02:
            checked, was = now, on
            on = os.path.exists(mark)
            if on and not was:
                counts, chains, samples = Counter(), Counter(), 0
            elif was and not on and any(inner != "-" for _, inner, _ in counts):   # not an idle Ray worker
                _write(out, samples, counts, chains)
        if not on:
            continue
        samples += 1
        names = {t.ident: t.name for t in threading.enumerate()}
        for ident, frame in sys._current_frames().items():
            if ident == me:
                continue
            thread = names.get(ident, str(ident))
            inner, leaf, chain = _where(frame)
            counts[(thread, inner, leaf)] += 1
            if chain and not leaf.endswith((":wait", ":_worker", ":recv_header", ":_read_exact", ":_serve")):
                chains[(thread, chain + f"  [{leaf}]")] += 1


def _record_calls(folder: str) -> None:
    """Patches CallClock.add, through which every timed call and part ends, to keep (kind, start,
    end) while the run's marker is there (time.perf_counter: CLOCK_MONOTONIC on Linux)."""
    time.sleep(1.0)   # sys.argv is set after this module runs; the engine imports the clock meanwhile
    kind = _kind()
    if kind is None:
        return
    from spectandem.call_clock import CallClock

    events: list[tuple[str, float, float]] = []
    state = {"on": False}
    add = CallClock.add

    def recording_add(self, name: str, seconds: float) -> None:
        add(self, name, seconds)
        if state["on"]:
            end = time.perf_counter()
            events.append((name, end - seconds, end))

    CallClock.add = recording_add
    mark = os.path.join(folder, "on")
    out = os.path.join(folder, f"timeline-{kind}-{os.getpid()}.json")
    while True:
        time.sleep(0.02)
        was, state["on"] = state["on"], os.path.exists(mark)
        if state["on"] and not was:
            events.clear()
        elif was and not state["on"] and events:
            taken = list(events)
            with open(out + ".tmp", "w") as f:
                json.dump(taken, f)
            os.replace(out + ".tmp", out)


def _each_run(folder: str, prefix: str, ext: str):
    """For a watcher thread of an engine process: each time the run's marker appears, (the marker,
    this process's output file <folder>/<prefix>-<kind>-<pid>.<ext>); the next once the marker
    has gone and come again. Nothing in a process that is no engine's."""
    time.sleep(1.0)   # sys.argv is set after this module runs
    kind = _kind()
    if kind is None:
        return
    mark, out = os.path.join(folder, "on"), os.path.join(folder, f"{prefix}-{kind}-{os.getpid()}.{ext}")
    while True:
        _until(mark, True)
        yield mark, out
        _until(mark, False)


def _until(mark: str, there: bool) -> None:
    """Returns once the run's marker is there (`there`) or gone."""
    while os.path.exists(mark) != there:
        time.sleep(0.02)


def _trace(folder: str, seconds: float, delay: float) -> None:
    """Each time the run's marker appears: `seconds` of this process's device work traced."""
    for _, out in _each_run(folder, "trace", "json"):
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            time.sleep(delay)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                time.sleep(seconds)
            prof.export_chrome_trace(out + ".tmp")
            os.replace(out + ".tmp", out)


def _cprofile(folder: str, top: int = 60) -> None:
    """Each time the run's marker is there: this process under cProfile (every thread's calls from
    Python 3.12, whose cProfile uses sys.monitoring; only this thread's before), its table
    written when the marker goes."""
    import cProfile
    import io
    import pstats

    for mark, out in _each_run(folder, "cprofile", "txt"):
        prof = cProfile.Profile()
        prof.enable()
        _until(mark, False)
        prof.disable()
        text = io.StringIO()
        if sys.version_info < (3, 12):
            text.write("(Python before 3.12: cProfile saw this watcher thread only)\n")
        for order in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).strip_dirs().sort_stats(order).print_stats(top)
        with open(out + ".tmp", "w") as f:
            f.write(text.getvalue())
        os.replace(out + ".tmp", out)


_TRACE = os.environ.get("SPECTANDEM_ENGINE_TRACE")
_CPROFILE = os.environ.get("SPECTANDEM_ENGINE_CPROFILE")
if _FOLDER:
    threading.Thread(target=_run, args=(_FOLDER,), name="engine-sampler", daemon=True).start()
if _TIMELINE:
    threading.Thread(target=_record_calls, args=(_TIMELINE,), name="engine-timeline", daemon=True).start()
if _TRACE:
    threading.Thread(target=_trace, args=(_TRACE, float(os.environ.get("SPECTANDEM_ENGINE_TRACE_S", "1")),
                                          float(os.environ.get("SPECTANDEM_ENGINE_TRACE_DELAY_S", "1"))),
                     name="engine-trace", daemon=True).start()
if _CPROFILE:
    threading.Thread(target=_cprofile, args=(_CPROFILE,), name="engine-cprofile", daemon=True).start()
