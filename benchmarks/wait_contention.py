"""What one thread's CUDA calls cost while another thread of the process waits for the GPU.

The in-process router runs the verifier's and the drafter's engines in worker threads of one
process (router/local_base.py). While one waits for its device (a stream's `synchronize()`, a
`.cpu()` copy), the other prepares and launches its next work. On the H200 hosts single calls on
that path (an event record, a small copy, a pinned `empty`) took 35-50 us, about ten times their
cost on an idle process. This measures the calls of a "launcher" thread while a "waiter" thread
waits for a long kernel on its own stream in one of several ways:

- none: no waiter (the baseline);
- spin: `stream.synchronize()` (the runtime's default wait; it spins while the process has
  fewer active contexts than logical CPUs);
- blocking: an event made with `blocking=True`, then `event.synchronize()` (the thread sleeps in
  the driver until the event completes);
- poll: `event.query()` in a loop with `time.sleep(0)` between (the Python lock released at
  every turn);
- d2h: `.cpu()` of a tensor written behind the kernel (a synchronous copy; waits like spin).

The waiter's device is the launcher's (same) or another GPU (other) when there are two.

    python benchmarks/wait_contention.py [--iters 400] [--csv OUT]

Prints one row per (waiter, placement): median and p90 of each call in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


class Waiter(threading.Thread):
    """Keeps its device busy with long sleep kernels and waits for each the way `how` says,
    until stopped."""

    def __init__(self, device: torch.device, how: str, kernel_cycles: int):
        super().__init__(daemon=True)
        self.device, self.how, self.cycles = device, how, kernel_cycles
        self.stop = threading.Event()
        self.waits = 0
        self.started_waiting = threading.Event()

    def run(self) -> None:
        torch.cuda.set_device(self.device)
        stream = torch.cuda.Stream(device=self.device)
        out = torch.zeros(1, device=self.device)
        with torch.cuda.stream(stream):
            while not self.stop.is_set():
                torch.cuda._sleep(self.cycles)
                out.add_(1)
                self.started_waiting.set()
                if self.how == "spin":
                    stream.synchronize()
                elif self.how == "blocking":
                    ev = torch.cuda.Event(blocking=True)
                    ev.record(stream)
                    ev.synchronize()
                elif self.how == "poll":
                    ev = torch.cuda.Event()
                    ev.record(stream)
                    while not ev.query():
                        time.sleep(0)
                elif self.how == "d2h":
                    out.cpu()
                else:
                    raise ValueError(f"unknown wait {self.how!r}")
                self.waits += 1


class Launcher:
    """The launcher thread's stream and buffers, and a small CUDA graph captured once, before
    any waiter runs (a capture forbids other threads' event queries)."""

    def __init__(self, device: torch.device):
        torch.cuda.set_device(device)
        self.device = device
        self.stream = torch.cuda.Stream(device=device)
        self.pinned = torch.arange(64, dtype=torch.long).pin_memory()
        self.dst = torch.empty(64, dtype=torch.long, device=device)
        self.small = torch.zeros(256, device=device)
        self.static = torch.zeros(1024, device=device)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(self.stream):
            for _ in range(2):
                self.static.mul_(1.0001)
        self.stream.synchronize()
        with torch.cuda.graph(self.graph, stream=self.stream):
            for _ in range(8):
                self.static.mul_(1.0001)
        torch.cuda.synchronize(device)

    def calls(self, iters: int) -> dict[str, list[float]]:
        """Each call `iters` times on the launcher's stream; -> call name -> microseconds each."""
        stream = self.stream
        calls = {
            "event_record": lambda: torch.cuda.Event().record(stream),
            "h2d_copy_64": lambda: self.dst.copy_(self.pinned, non_blocking=True),
            "add_kernel": lambda: self.small.add_(1),
            "graph_replay": self.graph.replay,
            "pinned_empty": lambda: torch.empty(64, dtype=torch.long, pin_memory=True),
        }
        out: dict[str, list[float]] = {k: [] for k in calls}
        with torch.cuda.stream(stream):
            for i in range(iters):
                for name, fn in calls.items():
                    t0 = time.perf_counter_ns()
                    fn()
                    out[name].append((time.perf_counter_ns() - t0) / 1e3)
                if i % 16 == 15:   # keep the launcher's queue short: its own work does not pile up
                    stream.synchronize()
        stream.synchronize()
        return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--kernel-cycles", type=int, default=20_000_000, help="the waiter's sleep kernel (~10 ms)")
    ap.add_argument("--csv", default=None)
    args = ap.parse_args()
    n = torch.cuda.device_count()
    a = torch.device("cuda:0")
    placements = [("same", a)] + ([("other", torch.device("cuda:1"))] if n > 1 else [])
    launcher = Launcher(a)
    launcher.calls(50)   # warm-up: contexts, allocator
    rows = []
    for how in ("none", "spin", "blocking", "poll", "d2h"):
        for where, dev in placements:
            if how == "none" and where != "same":
                continue
            waiter = None
            if how != "none":
                torch.zeros(1, device=dev)
                waiter = Waiter(dev, how, args.kernel_cycles)
                waiter.start()
                waiter.started_waiting.wait(5)
            times = launcher.calls(args.iters)
            if waiter is not None:
                waiter.stop.set()
                waiter.join()
            for name, xs in times.items():
                rows.append((how, where if how != "none" else "-", name, statistics.median(xs), _pct(xs, 0.9)))
    print(f"GPU: {torch.cuda.get_device_name(0)} x{n}; torch {torch.__version__}; us per call (median / p90)")
    names = list(dict.fromkeys(r[2] for r in rows))
    print(f"{'waiter':10s} {'where':6s} " + " ".join(f"{x:>20s}" for x in names))
    for key in dict.fromkeys((r[0], r[1]) for r in rows):
        cells = {r[2]: r for r in rows if (r[0], r[1]) == key}
        print(f"{key[0]:10s} {key[1]:6s} " + " ".join(f"{cells[x][3]:9.1f} / {cells[x][4]:7.1f}" for x in names))
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("waiter,where,call,median_us,p90_us\n")
            for r in rows:
                f.write(",".join(str(x) for x in r) + "\n")


if __name__ == "__main__":
    main()
