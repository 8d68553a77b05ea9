"""A real `spectandem serve --backend grpc` on the CPU with the explicit no-GPU flags
(--device cpu --dtype float32 --no-cuda-graphs --no-triton-attention --enforce-eager) and
--engine-threads: both engine processes accept what serve hands them, the start-up line says where
each runs, a request is answered, and SIGTERM stops it all with exit code 0."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from spectandem.service_args import format_cores


def test_grpc_serve_on_the_cpu_with_explicit_no_gpu_flags():
    from router.serve import ONE_THREAD_UP_TO

    env = dict(os.environ, OMP_NUM_THREADS="1")
    argv = [sys.executable, "-m", "spectandem.cli", "serve", "--backend", "grpc", "--port", "0", "--http-port", "0",
            "--metrics-port", "0", "--device", "cpu", "--dtype", "float32", "--no-cuda-graphs",
            "--no-triton-attention", "--enforce-eager", "--max-len", "256", "--max-running", "4",
            "--engine-restarts", "0", "--engine-threads", "1", "--first-request", "def fibonacci(n):"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    lines: list[str] = []
    answered = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("--- ") and "tokens, finish_reason=" in line or "first request failed" in line:
                answered.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        answered.wait(240)
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # whatever is left of serve's group
        except ProcessLookupError:
            pass
        proc.wait(30)
        reader.join(30)
    out = "".join(lines)
    # One thread each (the flag); the drafter on cores of its own, the verifier on every core, its
    # small forwards on the drafter's (--cpu-bind auto, serve's default).
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        split = len(cores) - max(1, len(cores) // 4)
        on = [f" on core{'s' if len(c) > 1 else ''} {format_cores(c)}" for c in (cores, cores[split:])]
        on[0] += f", forwards of up to {ONE_THREAD_UP_TO} tokens{on[1]}"
    else:
        on = ["", ""]
    assert (f"spectandem serve: verifier on cpu (float32, eager, 1 thread{on[0]}); "
            f"drafter on cpu (float32, eager, 1 thread{on[1]})" in out), out
    assert "spectandem verifier:" in out and "spectandem drafter:" in out, out
    assert "first request failed" not in out and "finish_reason=" in out, out
    assert rc == 0 and "spectandem stopped" in out, (rc, out)


def test_engine_threads_follow_the_flag_else_omp_num_threads_else_the_cores_shared_by_the_engine_processes():
    from router.serve import engine_threads

    cores = len(os.sched_getaffinity(0))
    for processes in (1, 2, 8):
        assert engine_threads(2, "3", processes) == 2
        assert engine_threads(None, "3", processes) == 3
    # A core stays with the router; the rest is shared, never oversubscribed past one thread each.
    assert engine_threads(None, None, 1) == engine_threads(None, "", 1) == max(1, cores - 1)
    assert engine_threads(None, None, 2) == max(1, (cores - 1) // 2)
    assert engine_threads(None, None, 10 * cores) == 1
    # --backend local on the CPU: the router waits while the engines compute on every core.
    assert engine_threads(None, None, 1, router_core=False) == cores
    assert engine_threads(3, None, 1, router_core=False) == 3
    for bad in ("0", "two"):
        with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer"):
            engine_threads(None, bad)
    with pytest.raises(ValueError, match="engine processes must be >= 1"):
        engine_threads(None, None, 0)


def test_engine_processes_count_each_engine_of_each_replica_outside_this_process():
    from argparse import Namespace

    from router.serve import engine_processes

    def args(**kw):
        base = dict(backend="grpc", method="eagle3", replicas=None, verifier_address=None, drafter_address=None,
                    ray_address=None, device="cuda:0")
        return Namespace(**{**base, **kw})

    assert engine_processes(args(backend="local")) == 1
    assert engine_processes(args(backend="local", replicas=4)) == 1
    assert engine_processes(args()) == 2
    assert engine_processes(args(method="none")) == 1
    assert engine_processes(args(backend="ray", replicas=4)) == 8
    assert engine_processes(args(backend="ray", replicas=3, method="none")) == 3
    # Joining a cluster: a replica's pair shares a node; the replicas' nodes are Ray's choice.
    assert engine_processes(args(backend="ray", replicas=4, ray_address="auto")) == 2
    # gRPC on the CPU: a replica's engine processes take its cores in turn.
    assert engine_processes(args(device="cpu")) == engine_processes(args(device="cpu", method="none")) == 1
    assert engine_processes(args(device="cpu", replicas=3)) == 3
    assert engine_processes(args(device="cpu", backend="ray")) == 2
    assert engine_processes(args(device="cpu", verifier_address=["h:1"])) == 2


def test_an_unbound_grpc_pair_on_the_cpu_takes_every_core_and_bounds_its_spinning():
    from router.serve import PAIR_SPIN_COUNT, configure_process
    from spectandem.cli import build_parser

    cores = len(os.sched_getaffinity(0))

    serve_env = {"PATH": "/usr/bin", "HOME": "/root"}

    def configured(*argv, environ=serve_env, omp=None):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--cpu-bind", "none", *argv])
        configure_process(args, omp, environ)
        return args.engine_threads, args.engine_env

    # The engines' whole environment: serve's own, with the bound added.
    spin = {**serve_env, "GOMP_SPINCOUNT": str(PAIR_SPIN_COUNT)}
    assert configured("--backend", "grpc") == (cores, spin if cores > 1 else None)
    assert configured("--backend", "grpc", "--engine-threads", "2") == (2, spin)
    assert configured("--backend", "grpc", "--engine-threads", "1") == (1, None)
    assert configured("--backend", "grpc", "--method", "none", "--engine-threads", "2") == (2, None)   # one engine
    assert configured("--backend", "grpc", "--replicas", "2", "--engine-threads", "2")[1] == spin
    # The operator's own OpenMP settings win: the engines inherit serve's environment as it is.
    assert configured("--backend", "grpc", "--engine-threads", "2", environ={"GOMP_SPINCOUNT": "5"}) == (2, None)
    assert configured("--backend", "grpc", "--engine-threads", "2", environ={"OMP_WAIT_POLICY": "active"}) == (2, None)
    assert configured("--backend", "grpc", omp="1") == (1, None)
    # Ray's actors keep a share each, and never get the variable.
    assert configured("--backend", "ray", "--engine-threads", "2") == (2, None)
    assert configured("--backend", "ray")[0] == max(1, (cores - 1) // 2)


def test_a_grpc_pairs_drafter_on_the_cpu_leaves_a_core_unless_told():
    """serve's own choice for a gRPC pair on the CPU left unbound: the verifier every core of the replica, the
    drafter one fewer (at least one), on its command line and in the placement line; a count
    the flag or OMP_NUM_THREADS chose goes to both; Ray and local keep one count."""
    from router.serve import configure_process, engine_commands, placement_line, resolve_serve_flags
    from spectandem.cli import build_parser
    from spectandem.config import Platform
    from spectandem.service_args import spec_from_flags

    cores = len(os.sched_getaffinity(0))

    def configured(*argv, omp=None):
        args = build_parser().parse_args(["serve", "--device", "cpu", "--cpu-bind", "none", *argv])
        configure_process(args, omp, {})
        return args

    args = configured("--backend", "grpc")
    assert (args.engine_threads, args.drafter_threads) == (cores, max(1, cores - 1))
    assert configured("--backend", "grpc", "--engine-threads", "2").drafter_threads == 2
    assert configured("--backend", "grpc", omp="2").drafter_threads == 2
    assert configured("--backend", "grpc", "--method", "none").drafter_threads == cores
    assert configured("--backend", "grpc", "--replicas", "2").drafter_threads == max(1, cores // 2 - 1)
    ray = configured("--backend", "ray")
    assert ray.drafter_threads == ray.engine_threads

    resolved = resolve_serve_flags(args, Platform(gpus=0, triton=False))
    resolved.engine_threads, resolved.drafter_threads = 2, 1
    cfg, target, draft = spec_from_flags(resolved)
    cmds = engine_commands(resolved, cfg, target, draft, 7001, 7002)
    threads = {role: cmd[cmd.index("--threads") + 1] for role, cmd in cmds.items()}
    assert threads == {"verifier": "2", "drafter": "1"}
    line = placement_line(resolved, cfg)
    assert "verifier on cpu (float32, eager, 2 threads)" in line, line
    assert "drafter on cpu (float32, eager, 1 thread)" in line, line


def test_a_pair_on_the_cpu_is_bound_to_cores_of_its_own_by_default(monkeypatch):
    """--cpu-bind auto: the drafter the last quarter of serve's cores (at least one), the verifier
    every core over gRPC and the rest over Ray (its forwards of up to ONE_THREAD_UP_TO tokens on one
    thread on the drafter's cores, either way), each with a thread a core unless threads were
    chosen, on their command lines (--cpu-cores, --one-thread-up-to, --one-thread-cores) and in the
    placement line, Ray's actors on a local cluster alike; nothing bound for --cpu-bind none, one
    engine, local, a joined Ray cluster, several replicas or a single core."""
    from router.serve import (ONE_THREAD_UP_TO, configure_process, engine_commands, one_thread_cores,
                              one_thread_up_to, placement_line, resolve_serve_flags)
    from spectandem.cli import build_parser
    from spectandem.config import Platform
    from spectandem.service_args import spec_from_flags

    def configured(*argv, cores=(0, 1), omp=None):
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
        args = build_parser().parse_args(["serve", "--device", "cpu", *argv])
        configure_process(args, omp, {})
        return args

    # gRPC: the verifier keeps every core (its small forwards on one thread), the drafter its own.
    two = configured("--backend", "grpc")
    assert two.cpu_sets == {"verifier": [0, 1], "drafter": [1]}
    assert (two.engine_threads, two.drafter_threads) == (2, 1)
    eight = configured("--backend", "grpc", cores=range(8))
    assert eight.cpu_sets == {"verifier": list(range(8)), "drafter": [6, 7]}
    assert (eight.engine_threads, eight.drafter_threads) == (8, 2)
    odd = configured("--backend", "grpc", cores=(2, 3, 5))
    assert odd.cpu_sets == {"verifier": [2, 3, 5], "drafter": [5]}
    ray = configured("--backend", "ray", cores=range(4))   # a local cluster: its actors on this machine
    assert ray.cpu_sets == {"verifier": [0, 1, 2], "drafter": [3]} and (ray.engine_threads, ray.drafter_threads) == (3, 1)
    chosen = configured("--backend", "grpc", "--engine-threads", "3", cores=range(8))
    assert chosen.cpu_sets["drafter"] == [6, 7] and (chosen.engine_threads, chosen.drafter_threads) == (3, 3)
    assert configured("--backend", "grpc", omp="2", cores=range(8)).drafter_threads == 2
    for argv, cores in ((("--backend", "grpc", "--cpu-bind", "none"), (0, 1)),
                        (("--backend", "grpc", "--method", "none"), (0, 1)),
                        (("--backend", "grpc", "--replicas", "2"), range(8)),
                        (("--backend", "ray", "--ray-address", "10.0.0.1:6379"), (0, 1)),
                        (("--backend", "local"), (0, 1)),
                        (("--backend", "grpc"), (0,))):
        assert configured(*argv, cores=cores).cpu_sets is None, argv

    resolved = resolve_serve_flags(eight, Platform(gpus=0, triton=False))
    cfg, target, draft = spec_from_flags(resolved)
    cmds = engine_commands(resolved, cfg, target, draft, 7001, 7002)
    bound = {role: (cmd[cmd.index("--threads") + 1], cmd[cmd.index("--cpu-cores") + 1]) for role, cmd in cmds.items()}
    assert bound == {"verifier": ("8", "0-7"), "drafter": ("2", "6-7")}
    verifier = cmds["verifier"]
    assert verifier[verifier.index("--one-thread-up-to") + 1] == str(ONE_THREAD_UP_TO)
    assert verifier[verifier.index("--one-thread-cores") + 1] == "6-7"
    assert "--one-thread-up-to" not in cmds["drafter"] and "--one-thread-cores" not in cmds["drafter"]
    line = placement_line(resolved, cfg)
    assert (f"verifier on cpu (float32, eager, 8 threads on cores 0-7, forwards of up to {ONE_THREAD_UP_TO} "
            "tokens on one thread on cores 6-7)") in line, line
    assert "drafter on cpu (float32, eager, 2 threads on cores 6-7)" in line, line
    unbound = resolve_serve_flags(configured("--backend", "grpc", "--cpu-bind", "none"), Platform(gpus=0, triton=False))
    assert all("--cpu-cores" not in cmd and "--one-thread-cores" not in cmd
               for cmd in engine_commands(unbound, cfg, target, draft, 7001, 7002).values())
    assert (one_thread_up_to(unbound, "verifier"), one_thread_cores(unbound, "verifier")) == (0, None)
    # Over Ray the verifier actor gets the same: its small forwards on the drafter's core.
    assert (one_thread_up_to(ray, "verifier"), one_thread_cores(ray, "verifier")) == (ONE_THREAD_UP_TO, [3])
    assert (one_thread_up_to(ray, "drafter"), one_thread_cores(ray, "drafter")) == (0, None)


def test_cpu_cores_flag_reads_lists_and_ranges_and_refuses_what_the_process_may_not_use():
    import argparse

    from spectandem.devices import bind_cpu_cores
    from spectandem.service_args import cpu_core_list, format_cores

    assert cpu_core_list("0") == [0] and cpu_core_list("3,0-1") == [0, 1, 3] and cpu_core_list("2-2,2") == [2]
    assert format_cores([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    for bad in ("", "a", "1-0", "-1", "0-", "1,,2"):
        with pytest.raises(argparse.ArgumentTypeError, match="cores and ranges"):
            cpu_core_list(bad)
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match=r"--cpu-cores .*not among those this process may run on"):
        bind_cpu_cores([max(allowed) + 1000])
    assert sorted(os.sched_getaffinity(0)) == allowed   # nothing changed


def test_a_verifier_runs_its_small_forwards_on_one_thread_on_the_cores_it_is_told():
    """--one-thread-up-to and --one-thread-cores (spectandem.devices.SmallForwards): a forward of
    at most that many tokens runs on one torch thread, the calling thread bound to those cores
    while it runs and after it on those and the process's; a larger one on every torch thread and
    the process's cores. Off at 0 (a control: nothing changes); the cores without the count, or a negative
    count, refused; the gRPC servicer and the Ray actor count a forward's tokens alike."""
    import argparse
    import threading
    from types import SimpleNamespace

    import torch

    from spectandem.devices import SmallForwards
    from spectandem.service_args import non_negative_int
    from verifier.service import VerifierServicer
    from verifier.service_core import forward_tokens

    home = sorted(os.sched_getaffinity(0))
    seen = {}

    def now():
        return torch.get_num_threads(), sorted(os.sched_getaffinity(0))

    def run():   # on a thread of its own: the binding is the thread's
        small = SmallForwards(32, threads=2, cores=home[-1:])
        for tokens in (6, 384, 32):
            with small.placed(tokens):
                seen[tokens] = now()
            seen[f"after {tokens}"] = now()
        seen["count"] = small.count
        torch.set_num_threads(3)
        with SmallForwards(0, threads=2).placed(6):
            seen["off"] = now()
        with SmallForwards(32, threads=2).placed(6):
            seen["threads only"] = now()
        # A process whose cores are apart from the drafter's (a Ray verifier actor): after a small
        # forward the thread may stay where it computed, after a large one it is back home.
        if len(home) > 1:
            os.sched_setaffinity(0, home[:-1])
            torch.set_num_threads(1)
            apart = SmallForwards(32, threads=1, cores=home[-1:])
            for tokens in (6, 40):
                with apart.placed(tokens):
                    seen[f"apart {tokens}"] = now()
                seen[f"apart after {tokens}"] = now()

    t = threading.Thread(target=run)
    t.start()
    t.join()
    apart = {"apart 6": (1, home[-1:]), "apart after 6": (1, home), "apart 40": (1, home[:-1]),
             "apart after 40": (1, home[:-1])} if len(home) > 1 else {}
    assert seen == {6: (1, home[-1:]), "after 6": (1, home), 384: (2, home), "after 384": (2, home),
                    32: (1, home[-1:]), "after 32": (1, home), "count": 2, "off": (3, home), "threads only": (1, home),
                    **apart}
    assert sorted(os.sched_getaffinity(0)) == home   # this thread was never bound
    with pytest.raises(ValueError, match="--one-thread-cores needs --one-thread-up-to"):
        SmallForwards(0, threads=2, cores=[0])
    # A servicer whose calls run on gRPC's handler threads keeps their one torch thread.
    assert VerifierServicer(None, thread=None, threads=2, one_thread_up_to=32).small.threads == 1
    assert VerifierServicer(None, thread=object(), threads=2, one_thread_up_to=32, one_thread_cores=[0]).small.cores == [0]
    tree = SimpleNamespace(node_valid=torch.ones(2, 6, dtype=torch.bool))
    items = [SimpleNamespace(prompt_ids=[1] * 100)]
    assert forward_tokens(tree, [None] * 3, items) == 115 and forward_tokens(None, [], []) == 0
    assert non_negative_int("0") == 0
    with pytest.raises(argparse.ArgumentTypeError, match=">= 0"):
        non_negative_int("-1")


def test_engine_processes_started_with_cpu_cores_run_on_those_cores_only(tmp_path):
    """A real `python -m verifier` and `python -m drafter` given --cpu-cores: once serving, every
    thread of each (torch's and gRPC's included) runs on that core only; a core the process may
    not use is refused by name."""
    from tests.router.link_harness import _spawn, _stop

    cores = sorted(os.sched_getaffinity(0))
    want = cores[-1]
    for role in ("verifier", "drafter"):
        proc, _ = _spawn(["-m", role, "--device", "cpu", "--threads", "1", "--cpu-cores", str(want)],
                         tmp_path / f"{role}.log")
        try:
            threads = os.listdir(f"/proc/{proc.pid}/task")
            assert len(threads) > 1
            assert {tid: os.sched_getaffinity(int(tid)) for tid in threads} == {tid: {want} for tid in threads}
        finally:
            _stop(proc)
    bad = subprocess.run([sys.executable, "-m", "drafter", "--port", "0", "--device", "cpu",
                          "--cpu-cores", str(max(cores) + 1000)], capture_output=True, text=True, timeout=120)
    assert bad.returncode != 0 and "--cpu-cores" in bad.stderr and "not among those" in bad.stderr, bad.stderr[-2000:]


def test_a_verifier_process_runs_small_forwards_where_its_flags_say(tmp_path):
    """A real `python -m verifier --threads 2 --one-thread-up-to 32 --one-thread-cores C`, called
    over gRPC: a prefill of 5 tokens counts as run on one thread (EngineInfo.one_thread_forwards),
    one of 40 does not, and afterwards every thread of the process is back on the process's
    cores."""
    import asyncio

    from router.links_grpc import GrpcVerifierLink
    from spectandem.config import SamplingParams
    from spectandem.protocol import Tag, VerifierPrefillItem
    from tests.router.link_harness import _spawn, _stop

    cores = sorted(os.sched_getaffinity(0))
    proc, address = _spawn(["-m", "verifier", "--device", "cpu", "--threads", "2", "--one-thread-up-to", "32",
                            "--one-thread-cores", str(cores[-1])], tmp_path / "v.log")

    async def prefills() -> list[int]:
        link, counts = GrpcVerifierLink(address), []
        try:
            for n in (5, 40):
                rid = f"r{n}"
                await link.prefill([VerifierPrefillItem(Tag(rid, 0, n), list(range(1, n + 1)), SamplingParams(), 0)],
                                   want_features=False)
                await link.release([rid])
                counts.append((await link.info()).extra.get("one_thread_forwards", 0))
        finally:
            await link.close()
        return counts

    try:
        assert asyncio.run(prefills()) == [1, 1]
        threads = os.listdir(f"/proc/{proc.pid}/task")
        assert {t: sorted(os.sched_getaffinity(int(t))) for t in threads} == {t: cores for t in threads}
    finally:
        _stop(proc)


def test_a_verifier_refuses_one_thread_cores_it_cannot_honour():
    """--one-thread-cores without --one-thread-up-to, or naming a core the process may not use:
    the verifier process exits before loading, naming the flag."""
    cores = sorted(os.sched_getaffinity(0))
    for extra, says in ((["--one-thread-cores", str(cores[0])], "needs --one-thread-up-to"),
                        (["--one-thread-up-to", "32", "--one-thread-cores", str(max(cores) + 1000)], "not among those")):
        bad = subprocess.run([sys.executable, "-m", "verifier", "--port", "0", "--device", "cpu", *extra],
                             capture_output=True, text=True, timeout=120)
        assert bad.returncode != 0 and "--one-thread-cores" in bad.stderr and says in bad.stderr, bad.stderr[-2000:]


def test_engine_processes_get_the_environment_serve_made_else_its_own(tmp_path):
    from router.supervisor import EngineProcess

    code = ("import os, sys; "
            "sys.stderr.write(os.environ.get('GOMP_SPINCOUNT', '-') + ' ' + os.environ.get('PATH', '-') + '\\n')")
    made = {**os.environ, "GOMP_SPINCOUNT": "100000"}
    for env, want in ((made, "100000"), (None, os.environ.get("GOMP_SPINCOUNT", "-"))):
        e = EngineProcess("probe", [sys.executable, "-c", code], env)
        for _ in range(2):   # a restart starts it with the same environment
            e.start()
            assert e.popen.wait(60) == 0
            e._reader.join(30)
            assert e.tail[-1] == f"{want} {os.environ.get('PATH', '-')}", list(e.tail)


def test_local_engines_on_the_cpu_take_turns_on_one_thread_with_its_own_torch_threads():
    """serve --backend local --device cpu: both links run their calls on one shared thread whose
    torch threads are --engine-threads, while the process's own stay at one (so the engine
    thread's OpenMP team is the only one of more than one thread); the served tokens are plain
    decoding's. In a subprocess: configure_process sets the process's torch threads."""
    code = r"""
import asyncio, threading, torch
from router.serve import _build_links, _spec, configure_process, placement_line, resolve_serve_flags
from spectandem.cli import build_parser
from spectandem.config import Platform, SamplingParams
args = build_parser().parse_args(["serve", "--backend", "local", "--device", "cpu", "--engine-threads", "2",
                                  "--max-len", "128", "--max-running", "2"])
configure_process(args, None)
assert args.engine_threads == 2 and torch.get_num_threads() == 1
args = resolve_serve_flags(args, Platform(gpus=0))
line = placement_line(args, _spec(args)[0])
assert line == ("verifier on cpu (float32, eager, 2 threads); drafter on cpu (float32, eager, 2 threads), "
                "taking turns"), line
async def main():
    cfg, target, draft = _spec(args)
    v, d, cleanup, _ = await _build_links(args, cfg, target, draft)
    try:
        assert v._thread is d._thread
        seen = await asyncio.gather(*(link._run("probe", lambda: (threading.current_thread().name,
                                                                 torch.get_num_threads())) for link in (v, d)))
        assert seen[0] == seen[1] and seen[0][0].startswith("spectandem-engines") and seen[0][1] == 2, seen
    finally:
        await cleanup()
asyncio.run(main())
assert torch.get_num_threads() == 1
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_auto_asks_ahead_for_a_smaller_edge_only_in_process_on_a_gpu():
    """serve's RouterConfig.ahead_edge: AHEAD_EDGE_OWN_STREAM for --backend local with an engine on
    a GPU (each engine a thread and a stream of its own), AHEAD_EDGE for engine processes sharing
    the GPU and for local engines on the CPU (one thread for both)."""
    from router.pipeline import AHEAD_EDGE, AHEAD_EDGE_OWN_STREAM
    from router.serve import ahead_edge, resolve_serve_flags
    from spectandem.cli import build_parser
    from spectandem.config import Platform

    def edge(*argv, gpus=1):
        args = build_parser().parse_args(["serve", *argv])
        return ahead_edge(resolve_serve_flags(args, Platform(gpus=gpus, triton=True)))

    assert edge("--backend", "local", "--device", "cuda") == AHEAD_EDGE_OWN_STREAM
    assert edge("--backend", "grpc", "--device", "cuda") == AHEAD_EDGE
    assert edge("--backend", "ray", "--device", "cuda") == AHEAD_EDGE
    assert edge("--backend", "local", "--device", "cpu", gpus=0) == AHEAD_EDGE
    assert AHEAD_EDGE_OWN_STREAM < AHEAD_EDGE
