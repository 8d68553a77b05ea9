"""How the verifier's per-round host code (verifier/tree_inputs.py `host_tree_inputs`, numpy on the
host tables) slows when another thread of the same process runs Python part of the time, as the
router's event loop and gRPC's handlers do beside the engines' worker threads in `serve
--backend local`. The other thread runs bursts of pure-Python work for a fraction (duty) of each
millisecond and sleeps the rest; the interpreter's lock gives the two threads turns.

    python benchmarks/gil_share.py --batch 64 --duties 0,0.1,0.3,0.6 --switch-interval-ms 0.5,5

Prints µs per call for each switch interval and duty. CPU only; no model.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path: run as a script)

from spectandem.kv_cache import PagedKVCache  # noqa: E402
from verifier.tree_inputs import host_tree_inputs  # noqa: E402


def _inputs(batch: int, n: int):
    cache = PagedKVCache(1, batch, 1, 4096, 8, torch.float32, "cpu", block_size=16)
    slots, lens = list(range(batch)), [300 + 7 * i for i in range(batch)]
    for s, c in zip(slots, lens):
        cache.reserve(s, c + n)
    tokens = torch.randint(0, 100, (batch, n))
    parents = torch.arange(-1, n - 1).expand(batch, n).contiguous()
    return cache, slots, lens, tokens, parents, torch.ones(batch, n, dtype=torch.bool)


def _per_call_us(args, calls: int) -> float:
    t0 = time.perf_counter()
    for _ in range(calls):
        host_tree_inputs(*args, len(args[1]))
    return (time.perf_counter() - t0) / calls * 1e6


def _busy(duty: float, stop: threading.Event) -> None:
    while not stop.is_set():
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < duty * 1e-3:
            [i * 2 for i in range(50)]
        time.sleep((1 - duty) * 1e-3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--nodes", type=int, default=5, help="tree nodes per request (default: %(default)s)")
    ap.add_argument("--duties", default="0,0.1,0.3,0.6", help="the other thread's busy fractions")
    ap.add_argument("--switch-interval-ms", default="0.5,5", help="the interpreter's switch intervals tried")
    ap.add_argument("--calls", type=int, default=2000)
    args = ap.parse_args()
    inputs = _inputs(args.batch, args.nodes)
    _per_call_us(inputs, 300)   # warm
    print(f"host_tree_inputs, batch {args.batch}, {args.nodes} nodes: us per call")
    print("switch ms  " + "  ".join(f"busy {float(d):4.0%}" for d in args.duties.split(",")))
    for ms in (float(x) for x in args.switch_interval_ms.split(",")):
        sys.setswitchinterval(ms / 1000)
        row = []
        for duty in (float(d) for d in args.duties.split(",")):
            stop = threading.Event()
            other = threading.Thread(target=_busy, args=(duty, stop)) if duty > 0 else None
            if other is not None:
                other.start()
            row.append(_per_call_us(inputs, args.calls))
            stop.set()
            if other is not None:
                other.join()
        print(f"{ms:9.2f}  " + "  ".join(f"{us:9.1f}" for us in row))


if __name__ == "__main__":
    main()
