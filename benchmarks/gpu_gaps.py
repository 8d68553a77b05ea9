"""Where each GPU idles: a torch.profiler (Kineto) trace read as per-device busy intervals.

`summarize(trace_json_path)` -> text: per device, the window from its first to its last kernel,
the busy time (the union of its kernels, copies and sets), and its idle gaps by size; then the
largest gaps, each with the GPU work on either side and the host runtime calls (CUDA API,
any thread) that began inside it, which say what the host was doing while the device waited.

    python benchmarks/gpu_gaps.py trace.json [--top 20] [--min-us 20]
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import Counter, defaultdict

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


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


def summarize(path: str, top: int = 20, min_us: float = 20.0) -> str:
    events = _load(path)
    per_dev: dict[int, list] = defaultdict(list)
    host = []
    for ev in events:
        if ev.get("ph") != "X":
            continue
        cat = ev.get("cat", "")
        if cat in GPU_CATS:
            dev = ev.get("args", {}).get("device", 0)
            per_dev[dev].append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0)), ev.get("name", "?")))
        elif cat == "cuda_runtime" or cat == "cuda_driver":
            host.append((float(ev["ts"]), ev.get("name", "?"), ev.get("tid")))
    host.sort()
    out = []
    for dev in sorted(per_dev):
        runs = _merge(per_dev[dev])
        if not runs:
            continue
        window = runs[-1][1] - runs[0][0]
        busy = sum(e - s for s, e, _, _ in runs)
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
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--min-us", type=float, default=20.0)
    args = ap.parse_args()
    print(summarize(args.trace, args.top, args.min_us))


if __name__ == "__main__":
    main()
