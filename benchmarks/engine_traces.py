"""The drafter's device work per round, read from torch.profiler traces: the served pair's
engine processes (benchmarks/profile_serve.py --engine-trace) against the engine loop's one
process (benchmarks/profile_engine_loop.py --gpu-trace).

A served drafter process launches nothing but the drafter's work, so its kernels, merged where
less than `gap_us` apart, form one burst per call that reached the device (a draft on the
verdicts, a draft call, a prefill). Per burst: its span (first kernel's start to last kernel's
end) and its busy time (the union of its kernels); and the verifier process's busy time inside
the drafter's bursts, where both processes share one GPU (their kernels then contend).

The engine loop's trace carries the host's Python stacks: each kernel is the drafter's or the
verifier's by the function that launched it (a graph's kernels by the graph's launch), and the
drafter's kernels between two verifier kernels form its burst of that round.

    python benchmarks/engine_traces.py served DIR      # trace-drafter-*.json, trace-verifier-*.json
    python benchmarks/engine_traces.py loop TRACE.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.gpu_gaps import GPU_CATS, _load, _merge, _Stacks  # noqa: E402


def _kernels(events: list[dict]) -> list[tuple[float, float, str, object]]:
    """(start µs, end µs, name, correlation) of every kernel, copy and set, by start."""
    out = []
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat", "") in GPU_CATS:
            s = float(ev["ts"])
            out.append((s, s + float(ev.get("dur", 0)), ev.get("name", "?"), ev.get("args", {}).get("correlation")))
    return sorted(out)


def _bursts(spans: list[tuple[float, float]], gap_us: float) -> list[tuple[float, float, float, int]]:
    """Sorted (start, end) -> (start, end, busy, kernels) of each run of spans less than `gap_us` apart."""
    out: list[list] = []
    for s, e in spans:
        if out and s - out[-1][1] < gap_us:
            b = out[-1]
            b[2] += max(0.0, e - max(s, b[1]))
            b[1] = max(b[1], e)
            b[3] += 1
        else:
            out.append([s, e, e - s, 1])
    return [tuple(b) for b in out]


def _busy_inside(runs: list[tuple], s: float, e: float) -> float:
    return sum(max(0.0, min(e, r1) - max(s, r0)) for r0, r1, *_ in runs)


def _quantiles(xs: list[float]) -> str:
    if not xs:
        return "-"
    xs = sorted(xs)
    p90 = xs[min(len(xs) - 1, int(0.9 * len(xs)))]
    return f"median {statistics.median(xs) / 1000:.2f} ms, p90 {p90 / 1000:.2f} ms"


def _top_kernels(kernels, top: int) -> list[str]:
    by: dict[str, list[float]] = {}
    for s, e, name, _ in kernels:
        by.setdefault(name, []).append(e - s)
    rows = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:top]
    return [f"    {sum(d) / 1000:8.2f} ms  {len(d):6d} x {statistics.mean(d):7.1f} µs  {name[:90]}" for name, d in rows]


def served_report(folder: str | Path, gap_us: float = 300.0, top: int = 8) -> str:
    folder = Path(folder)
    drafters = sorted(folder.glob("trace-drafter-*.json"))
    verifiers = sorted(folder.glob("trace-verifier-*.json"))
    if not drafters:
        return (f"  engine traces: no drafter trace in {folder} (a Ray actor's process does not say which engine it "
                f"hosts: its trace is trace-ray-worker-PID.json)")
    dk = _kernels(_load(str(drafters[0])))
    vk = _kernels(_load(str(verifiers[0]))) if verifiers else []
    bursts = _bursts([(s, e) for s, e, _, _ in dk], gap_us)
    vruns = _merge([(s, e, n) for s, e, n, _ in vk])
    lines = [f"  engine traces: the drafter's device work in bursts (kernels < {gap_us:.0f} µs apart): {len(bursts)} bursts",
             f"    span {_quantiles([b[1] - b[0] for b in bursts])}; busy {_quantiles([b[2] for b in bursts])}; "
             f"kernels a burst, median {statistics.median([b[3] for b in bursts]):.0f}"]
    big = [b for b in bursts if b[1] - b[0] >= 1000.0]
    if big:
        lines.append(f"    bursts of 1 ms or more: {len(big)}, span {_quantiles([b[1] - b[0] for b in big])}, "
                     f"busy {_quantiles([b[2] for b in big])}")
    if vk:
        inside = [_busy_inside(vruns, b[0], b[1]) for b in big or bursts]
        spans = [b[1] - b[0] for b in big or bursts]
        lines.append(f"    the verifier's device busy inside those bursts: {_quantiles(inside)} "
                     f"({100 * sum(inside) / max(1.0, sum(spans)):.1f}% of their spans)")
        window = max(dk[-1][1], vk[-1][1]) - min(dk[0][0], vk[0][0])
        vbusy = sum(e - s for s, e, *_ in vruns)
        dbusy = sum(e - s for s, e, *_ in _merge([(s, e, n) for s, e, n, _ in dk]))
        lines.append(f"    over the traced {window / 1000:.0f} ms: verifier busy {100 * vbusy / window:.1f}%, "
                     f"drafter busy {100 * dbusy / window:.1f}%")
    lines.append("    the drafter's kernels by total time:")
    lines += _top_kernels(dk, top)
    return "\n".join(lines)


def loop_report(path: str, gap_us: float = 300.0, top: int = 8) -> str:
    """The engine loop's trace (with stacks): the drafter's kernels by launch site, per burst."""
    events = _load(path)
    stacks = _Stacks(events)
    launch = {}
    for ev in events:
        if ev.get("ph") == "X" and ev.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in ev.get("args", {}):
            launch[ev["args"]["correlation"]] = (float(ev["ts"]), ev.get("tid"))
    kernels = _kernels(events)

    def role(corr) -> str:
        if corr not in launch:
            return "?"
        site = stacks.at(launch[corr][1], launch[corr][0], depth=12)
        return "drafter" if "drafter/" in site else "verifier" if "verifier/" in site else "?"
    roles = [role(k[3]) for k in kernels]
    # A burst: the drafter's kernels between two of the verifier's.
    bursts, cur = [], None
    for k, r in zip(kernels, roles):
        if r == "drafter":
            if cur is None:
                cur = [k[0], k[1], 0.0, 0]
            cur[2] += max(0.0, k[1] - max(k[0], cur[1])) if cur[3] else k[1] - k[0]
            cur[1] = max(cur[1], k[1])
            cur[3] += 1
        elif r == "verifier" and cur is not None:
            bursts.append(tuple(cur))
            cur = None
    if cur is not None:
        bursts.append(tuple(cur))
    counts = {r: roles.count(r) for r in set(roles)}
    lines = [f"  engine loop trace: kernels by launcher {counts}; the drafter's bursts between verifier kernels: {len(bursts)}",
             f"    span {_quantiles([b[1] - b[0] for b in bursts])}; busy {_quantiles([b[2] for b in bursts])}; "
             f"kernels a burst, median {statistics.median([b[3] for b in bursts]) if bursts else 0:.0f}",
             "    the drafter's kernels by total time:"]
    lines += _top_kernels([k for k, r in zip(kernels, roles) if r == "drafter"], top)
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kind", choices=("served", "loop"))
    ap.add_argument("path")
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--top", type=int, default=8)
    a = ap.parse_args()
    print(served_report(a.path, a.gap_us, a.top) if a.kind == "served" else loop_report(a.path, a.gap_us, a.top))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
