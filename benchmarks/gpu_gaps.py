"""Where each GPU idles: a torch.profiler (Kineto) trace read as per-device busy intervals.

`summarize(trace_json_path)` -> text: per device, the window from its first to its last kernel,
the busy time (the union of its kernels, copies and sets), and its idle gaps by size; then the
largest gaps, each with the GPU work on either side and the host runtime calls (CUDA API,
any thread) that began inside it, which say what the host was doing while the device waited.
A trace taken with the host's Python stacks (ProfilerActivity.CPU, with_stack=True) also says,
for each large gap, which of our functions launched the GPU work on either side and which ran
(per thread) inside it, and sums the idle time of every gap of `min_site_us` or more by the pair
of functions that launched the work on either side.

    python benchmarks/gpu_gaps.py trace.json [--top 20] [--min-us 20]
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
from collections import Counter, defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# Frames of the repo's own code in with_stack traces: "verifier/engine.py(123): verify".
OURS = re.compile(r"(?:^|/)((?:drafter|verifier|router|spectandem|benchmarks)/[\w/]+\.py)\((\d+)\): (\S+)")


def _load(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def _merge(spans: list[tuple[float, float, str]]) -> list[tuple[float, float, str, str]]:
    """Sorted (start, end, name) -> merged busy runs (start, end, first name, last name)."""
    runs: list[list] = []
    for s, e, name in sorted(spans):
        if runs and s <= runs[-1][1]:
            if e > runs[-1][1]:
                runs[-1][1], runs[-1][3] = e, name
        else:
            runs.append([s, e, name, name])
    return [tuple(r) for r in runs]


class _Stacks:
    """The Python frames of our code per host thread (python_function events), to ask which of
    them enclosed a moment or ran inside an interval."""

    def __init__(self, events: list[dict]):
        import numpy as np

        per_tid = defaultdict(list)
        for ev in events:
            if ev.get("ph") == "X" and ev.get("cat") == "python_function":
                m = OURS.search(ev.get("name", ""))
                if m:
                    s = float(ev["ts"])
                    per_tid[ev.get("tid")].append((s, s + float(ev.get("dur", 0)), f"{m.group(1)}:{m.group(3)}"))
        self.tids = {}
        for tid, frames in per_tid.items():
            frames.sort()
            self.tids[tid] = (np.array([f[0] for f in frames]), np.array([f[1] for f in frames]), [f[2] for f in frames])

    def __bool__(self) -> bool:
        return bool(self.tids)

    def at(self, tid, t: float, depth: int = 3) -> str:
        """Our innermost `depth` frames enclosing time `t` on thread `tid`, outermost first."""
        if tid not in self.tids:
            return "-"
        start, end, names = self.tids[tid]
        idx = ((start <= t) & (end >= t)).nonzero()[0]
        inner = sorted(idx, key=lambda i: (start[i], -end[i]))[-depth:]
        return " > ".join(names[i] for i in inner) or "-"

    def inside(self, s: float, e: float, top: int = 3) -> list[str]:
        """Per thread, our innermost frames that ran inside [s, e), by time inside, top `top`."""
        out = []
        for tid, (start, end, names) in self.tids.items():
            idx = ((start < e) & (end > s)).nonzero()[0]
            if not len(idx):
                continue
            # innermost: frames that enclose no other frame of the interval
            by = Counter()
            for i in idx:
                contains = ((start[idx] >= start[i]) & (end[idx] <= end[i])).sum() > 1
                if not contains:
                    by[names[i]] += min(end[i], e) - max(start[i], s)
            what = ", ".join(f"{n} {us / 1000:.2f}" for n, us in by.most_common(top))
            out.append(f"tid {tid}: {what}")
        return out


def summarize(path: str, top: int = 20, min_us: float = 20.0, min_site_us: float = 200.0) -> str:
    events = _load(path)
    per_dev: dict[int, list] = defaultdict(list)
    host = []
    launch = {}   # correlation id -> (ts, tid) of the runtime call that queued a GPU op
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in GPU_CATS:
            dev = ev.get("args", {}).get("device", 0)
            per_dev[dev].append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), ev.get("name", "?"),
                                 ev.get("args", {}).get("correlation")))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            host.append((float(ev["ts"]), ev.get("name", "?"), ev.get("tid")))
            if "correlation" in ev.get("args", {}):
                launch[ev["args"]["correlation"]] = (float(ev["ts"]), ev.get("tid"))
    host.sort()
    stacks = _Stacks(events)

    def site(corr) -> str:
        if corr not in launch:
            return "?"
        ts, tid = launch[corr]
        return stacks.at(tid, ts)
    out = []
    for dev in sorted(per_dev):
        corr_of = {(s, e, n): c for s, e, n, c in per_dev[dev]}
        runs = _merge([(s, e, n) for s, e, n, _ in per_dev[dev]])
        if not runs:
            continue
        window = runs[-1][1] - runs[0][0]
        busy = sum(e - s for s, e, _, _ in runs)
        last_op = {}   # merged run end -> the correlation of the op that ended it; run start -> of the first
        first_op = {}
        for (s0, e0, n0), c in corr_of.items():
            first_op.setdefault(s0, c)
            last_op[e0] = c
        gaps = [(runs[i + 1][0] - runs[i][1], runs[i][1], runs[i + 1][0], runs[i][3], runs[i + 1][2])
                for i in range(len(runs) - 1)]
        buckets = Counter()
        idle_by = Counter()
        for g, *_ in gaps:
            b = ("<10us" if g < 10 else "10-50us" if g < 50 else "50-200us" if g < 200 else
                 "200us-1ms" if g < 1000 else ">=1ms")
            buckets[b] += 1
            idle_by[b] += g
        out.append(f"== device {dev}: window {window / 1000:.2f} ms, busy {busy / 1000:.2f} ms "
                   f"({100 * busy / max(window, 1e-9):.1f}%), {len(per_dev[dev])} GPU ops")
        for b in ("<10us", "10-50us", "50-200us", "200us-1ms", ">=1ms"):
            if buckets[b]:
                out.append(f"   gaps {b:>9s}: {buckets[b]:5d}, idle {idle_by[b] / 1000:8.2f} ms")
        big = sorted((g for g in gaps if g[0] >= min_us), key=lambda g: -g[0])[:top]
        out.append(f"   largest gaps (>= {min_us:.0f} us), by start time:")
        t_origin = runs[0][0]
        for g, s, e, before, after in sorted(big, key=lambda g: g[1]):
            calls = Counter(name for t, name, _ in host if s <= t < e)
            what = ", ".join(f"{n} x{c}" if c > 1 else n for n, c in calls.most_common(6))
            out.append(f"   {(s - t_origin) / 1000:9.3f} ms  {g:8.1f} us  after {before[:38]!r} before {after[:38]!r}"
                       f"\n{'':26s}host: {what or '-'}")
            if stacks:
                out.append(f"{'':26s}launched by: {site(last_op.get(s))}  |  then: {site(first_op.get(e))}")
                out.extend(f"{'':26s}ran: {line}" for line in stacks.inside(s, e))
        if stacks:
            by_site = Counter()
            count = Counter()
            for g, s, e, _, _ in gaps:
                if g >= min_site_us:
                    key = f"{site(last_op.get(s))}  ->  {site(first_op.get(e))}"
                    by_site[key] += g
                    count[key] += 1
            out.append(f"   idle in gaps of {min_site_us:.0f} us or more, by the code that launched the work before"
                       f" -> after ({sum(by_site.values()) / 1000:.1f} ms in all):")
            for key, us in by_site.most_common(top):
                out.append(f"   {us / 1000:8.2f} ms {count[key]:4d}x  {key}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-us", type=float, default=20.0)
    ap.add_argument("--min-site-us", type=float, default=200.0, help="gaps summed by launching code from this size")
    args = ap.parse_args()
    print(summarize(args.trace, args.top, args.min_us, args.min_site_us))


if __name__ == "__main__":
    main()
