"""Where each CPU core's time goes while `spectandem serve` serves: the scheduler's record of a
measured run, by core, by process role and by thread.

    python benchmarks/core_share.py --seconds 3 -- --backend grpc --device cpu

It starts `spectandem serve` with the arguments after `--` (a port of its own), waits for it,
runs one warm-up pass of `spectandem bench serve`, then a measured pass at `--concurrency`,
and while that runs records `--seconds` of the scheduler's switches on every core with
`perf sched record` (Linux perf with the sched tracepoints: root, or perf_event_paranoid <= 1).
From `perf sched timehist` it reports, for each core, the share of the recording it ran
anything, and the threads that ran on it longest: the process's role (router, verifier,
drafter, a Ray worker, the benchmark client) and the thread's name (a Python thread's own where
py-spy is installed), with the time it ran, how
many times it was switched in, and how long it waited to run once woken (scheduling delay).
`--timeline MS`: also each core's switches over MS milliseconds from the recording's middle.
The recording slows what it records a little; the served tok/s of the measured pass is printed
with it.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEHIST = re.compile(r"\s*([\d.]+)\s+\[(\d+)\]\s+(.+?)\[(\d+)(?:/(\d+))?\]\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc's parent links)."""
    children = collections.defaultdict(list)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children[ppid].append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def _role(pid: int) -> str:
    try:
        cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "?"
    if "ray::" in cmd:   # a Ray worker, titled by the actor it hosts
        actor = cmd.split("ray::", 1)[1].split(".", 1)[0].split(" ", 1)[0]
        return f"ray {actor}" if actor else "ray worker"
    for key, role in (("-m verifier", "verifier"), ("-m drafter", "drafter"),
                      ("bench serve", "bench client"), ("cli serve", "router"), ("spectandem serve", "router")):
        if key in cmd:
            return role
    return "ray" if "ray" in cmd else Path(cmd.split(" ", 1)[0]).name or "?"


def _python_names(pid: int) -> dict[str, str]:
    """tid -> the Python thread's name, from `py-spy dump` where py-spy is installed (the OS
    name of every Python thread is the interpreter's)."""
    if shutil.which("py-spy") is None:
        return {}
    try:
        dump = subprocess.run(["py-spy", "dump", "-p", str(pid)], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    return dict(re.findall(r'^Thread (\d+) \(\w+\): "(.*)"', dump, flags=re.M))


def _threads(pids: list[int]) -> dict[str, str]:
    """tid -> 'role:thread name' for every thread of `pids`."""
    names = {}
    for pid in pids:
        role = _role(pid)
        python = _python_names(pid)
        for task in (Path("/proc") / str(pid) / "task").glob("*"):
            try:
                names[task.name] = f"{role}:{python.get(task.name) or (task / 'comm').read_text().strip()}"
            except OSError:
                pass
    return names


def _wait_ready(port: int, proc: subprocess.Popen, timeout_s: float = 300.0) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"spectandem serve exited with {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)
    raise SystemExit("spectandem serve did not listen in time")


def _bench(port: int, prompts: int, concurrency: int, max_tokens: int, warmups: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "spectandem.cli", "bench", "serve", "--address", f"127.0.0.1:{port}",
         "--num-prompts", str(prompts), "--max-concurrency", str(concurrency), "--max-tokens", str(max_tokens),
         "--num-warmups", str(warmups), "--no-progress"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def report(timehist: str, names: dict[str, str], seconds: float, top: int, timeline_ms: float) -> str:
    run = collections.defaultdict(float)
    slices = collections.Counter()
    delay = collections.defaultdict(float)
    events = []
    for line in timehist.splitlines():
        m = TIMEHIST.match(line)
        if not m:
            continue
        ts, cpu, comm, tid, _pid, _wait, sched_delay, run_ms = m.groups()
        who = names.get(tid, f"other:{comm.strip()}")
        key = (int(cpu), who if not who.startswith("other:") or "idle" not in who else "idle")
        if key[1] == "idle":
            continue
        run[key] += float(run_ms)
        slices[key] += 1
        delay[key] += float(sched_delay)
        events.append((float(ts), int(cpu), who, float(run_ms), float(sched_delay)))
    out = []
    for cpu in sorted({c for c, _ in run}):
        busy = sum(v for (c, _), v in run.items() if c == cpu)
        out.append(f"core {cpu}: ran something {100 * busy / (1000 * seconds):.0f}% of the {seconds:g} s")
        out.append(f"  {'ms':>8}  {'slices':>7}  {'sched delay ms':>14}  thread (role:name)")
        rows = sorted(((v, who) for (c, who), v in run.items() if c == cpu), reverse=True)[:top]
        for v, who in rows:
            out.append(f"  {v:8.1f}  {slices[(cpu, who)]:7d}  {delay[(cpu, who)]:14.1f}  {who}")
    if timeline_ms and events:
        mid = events[len(events) // 2][0]
        out.append(f"switches over {timeline_ms:g} ms from the recording's middle (ms from there at the slice's end, "
                   f"ran ms, waited to run ms, thread):")
        for ts, cpu, who, ran, waited in events:
            if mid <= ts <= mid + timeline_ms / 1000:
                out.append(f"  core {cpu}  {1000 * (ts - mid):8.2f}  {ran:7.3f}  {waited:6.3f}  {who}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=3.0, help="length of the recording (default: %(default)s)")
    ap.add_argument("--delay", type=float, default=1.5,
                    help="seconds into the measured pass before recording (default: %(default)s)")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=8, help="measured requests (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=8, help="threads listed per core (default: %(default)s)")
    ap.add_argument("--timeline", type=float, default=0.0, metavar="MS")
    ap.add_argument("serve_args", nargs=argparse.REMAINDER, help="-- then spectandem serve's arguments")
    args = ap.parse_args()
    serve_args = args.serve_args[1:] if args.serve_args[:1] == ["--"] else args.serve_args
    if shutil.which("perf") is None:
        raise SystemExit("core_share.py records with `perf sched record`: install Linux perf (linux-tools)")
    port = _free_port()
    serve = subprocess.Popen([sys.executable, "-m", "spectandem.cli", "serve", *serve_args, "--port", str(port),
                              "--http-port", "0"], cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True)
    try:
        _wait_ready(port, serve)
        warm = _bench(port, 2 * args.concurrency, args.concurrency, args.max_tokens, 0)
        warm.communicate()
        bench = _bench(port, args.prompts, args.concurrency, args.max_tokens, 0)
        time.sleep(args.delay)
        with tempfile.TemporaryDirectory() as tmp:
            data = os.path.join(tmp, "sched.data")
            subprocess.run(["perf", "sched", "record", "-a", "-o", data, "--", "sleep", str(args.seconds)],
                           check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            names = _threads(_descendants(serve.pid) + [bench.pid])
            hist = subprocess.run(["perf", "sched", "timehist", "-i", data], capture_output=True, text=True,
                                  check=True).stdout
        bench_out = bench.communicate()[0]
    finally:
        os.killpg(serve.pid, signal.SIGINT)
        try:
            serve.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(serve.pid, signal.SIGKILL)
    tok_s = re.search(r"Output token throughput \(tok/s\):\s+([\d.]+)", bench_out)
    accept = re.search(r"acceptance length:\s+([\d.]+)", bench_out)
    print(f"serve {' '.join(serve_args)}: concurrency {args.concurrency}, "
          f"{tok_s.group(1) if tok_s else '?'} tok/s, accept {accept.group(1) if accept else '?'} "
          f"(the measured pass, recorded {args.seconds:g} s of it)")
    print(report(hist, names, args.seconds, args.top, args.timeline))


if __name__ == "__main__":
    main()
