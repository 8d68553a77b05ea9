"""`spectandem serve`: engines (Ray actors by default; or gRPC services; or in this process), the
router, and the public gRPC server on --host:--port, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

from router.links import GRPC_CALL_TIMEOUT_S, RAY_CALL_TIMEOUT_S, EngineStartError
from spectandem.config import EngineConfig, GpuPaths, benchmark_warning, engine_devices, is_cuda, resolve_model_flags
from router.ops import OpsConfig, add_ops_flags
from spectandem.memory import engine_memory_flags, kv_capacity_line
from spectandem.service_args import (add_benchmark_flag, add_memory_flags, add_model_flags, format_cores, model_dtype,
                                     positive_int)

log = logging.getLogger("spectandem.serve")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the public gRPC API (the demo pair with no model flags)")
    add_model_flags(p)
    add_memory_flags(p, engine=False)
    add_benchmark_flag(p)
    p.add_argument("--backend", choices=["ray", "grpc", "local"], default="ray",
                   help="ray: drafter and verifier as Ray actors (a local cluster unless --ray-address); "
                        "grpc: as gRPC services (started here unless --drafter-address/--verifier-address); "
                        "local: both engines in this process")
    p.add_argument("--drafter-device", default="auto",
                   help="--backend local and grpc: the drafter's torch device; auto = cuda:1 when two GPUs or more "
                        "are visible and --device is cuda (or auto), else the verifier's device (cuda:0 with one GPU). "
                        "Ray gives each actor a GPU of its own when there are two, else a half of the one")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster (e.g. 'auto')")
    p.add_argument("--drafter-address", action="append", default=None,
                   help="use a separately deployed drafter service (repeat: one per replica)")
    p.add_argument("--verifier-address", action="append", default=None,
                   help="use a separately deployed verifier service (repeat: one per replica)")
    p.add_argument("--replicas", type=int, default=None,
                   help="drafter/verifier pairs behind this server, each with its own round loop (on Ray: its "
                        "own placement group, so a pair shares a node); --max-running is per replica "
                        "(default: 1, or one per --verifier-address)")
    p.add_argument("--host", default="localhost", help="address of the public gRPC API (and the HTTP fronts)")
    p.add_argument("--port", type=int, default=50051, help="port of the public gRPC API (0: a free one, printed)")
    p.add_argument("--max-running", "--max-num-seqs", type=int, default=64,
                   help="requests in the running batch (engine slots; --max-num-seqs as in vLLM)")
    p.add_argument("--first-request", default=None, metavar="PROMPT",
                   help="once serving, send this prompt through the client SDK and print the completion")
    p.add_argument("--pipeline", choices=["auto", "sequential", "pingpong", "ahead"], default="auto",
                   help="ahead: the drafter prepares the next trees for likely outcomes during the verify "
                        "(latency); pingpong: two micro-batches overlap drafting with verification "
                        "(throughput); auto: measured per batch size, with shorter drafts and plain rounds")
    p.add_argument("--plain-steps", type=positive_int, default=4,
                   help="tokens per request a plain round (no drafts: --method none, or speculation switched off) "
                        "decodes in one verifier call when every request in it is greedy; the steps are chained "
                        "on the GPU without the host waiting between them. 1: one token per round")
    p.add_argument("--overlap-admission", action=argparse.BooleanOptionalAction, default=False,
                   help="sequential rounds below 32 running requests: new requests are prefilled on the verifier "
                        "while the drafter drafts for the running ones, join that round's verify as plain rows, and "
                        "are prefilled on the drafter while the verifier verifies; from 32 on they are prefilled in "
                        "the round's verify step (--mixed-prefill) (default: off: new requests are prefilled in the "
                        "round's verify step, or before the round)")
    p.add_argument("--mixed-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="new requests are prefilled in the step of the round's verify, their prompts' tokens "
                        "beside the running requests' (as vLLM's chunked prefill mixes prefills into decode "
                        "batches), where the verifier carries them; the rest prefill on their own (default: on; "
                        "--no-mixed-prefill: every prefill a forward of its own)")
    p.add_argument("--drafter-timeout", type=float, default=10.0,
                   help="seconds a drafter call may take before rounds go on without it")
    p.add_argument("--engine-call-timeout", type=float, default=None, metavar="SECONDS",
                   help="--backend grpc and ray: the deadline of every call to an engine process; a verifier "
                        "that does not answer within it fails the requests it holds (UNAVAILABLE) and serve "
                        "waits for it to come back (default: %g s for grpc, %g s for ray)"
                        % (GRPC_CALL_TIMEOUT_S, RAY_CALL_TIMEOUT_S))
    p.add_argument("--feature-channel", nargs="?", const="auto", default=None, metavar="tcp://HOST:PORT|auto|off",
                   help="target features go verifier -> drafter over a direct channel instead of through the "
                        "router: a CUDA IPC ring when both engines share a GPU, NCCL between two GPUs, shared "
                        "memory or gloo on CPU. On by default ('auto': a free port of the verifier's node) when "
                        "this command starts both engines (--backend grpc or ray) and speculates; a value: that "
                        "address; 'off': through the router. If it cannot come up, features go through the router")
    p.add_argument("--no-feature-channel", dest="feature_channel", action="store_const", const="off",
                   help="target features go through the router (--feature-channel off)")
    p.add_argument("--tree-channel", action=argparse.BooleanOptionalAction, default=None,
                   help="a round's draft trees go drafter -> verifier over a socket between the two engines, and "
                        "the round's draft and verify calls go out together, so that a round waits on one call to "
                        "the engines, not two in a row (default: on when this command starts both engines, "
                        "--backend grpc or ray, and speculates, and with --backend local where an engine is on a "
                        "GPU, each engine then having a worker thread of its own, the trees handed between the "
                        "two in this process; --no-tree-channel: trees through the router)")
    p.add_argument("--draft-on-verdict", action=argparse.BooleanOptionalAction, default=None,
                   help="the verifier hands a sequential round's verdicts straight to the drafter (over the tree "
                        "channel; in this process, from thread to thread), which catches up and drafts the next "
                        "trees while the router commits the round; the next draft call then finds them made "
                        "(default: on with the tree channel for --backend grpc and ray, off in-process)")
    p.add_argument("--engine-restarts", type=int, default=5,
                   help="--backend grpc: restarts of an engine process started here within "
                        "--engine-restart-window, after which it stays down (a verifier that stays down ends "
                        "serve with exit code 1; without its drafter serve decodes plainly). 0: never restart "
                        "(default: %(default)s)")
    p.add_argument("--engine-restart-window", type=float, default=300.0, metavar="SECONDS",
                   help="the window --engine-restarts counts in (default: %(default)s)")
    p.add_argument("--engine-restart-backoff", type=float, default=1.0, metavar="SECONDS",
                   help="delay before restarting an engine, doubled for each further restart within the window, "
                        "at most 30 s (default: %(default)s)")
    p.add_argument("--switch-interval-ms", type=float, default=None, metavar="MS",
                   help="--backend local: the interpreter's switch interval while the router and both engines "
                        "share this process, so that a thread back from the GPU gets the Python lock sooner "
                        "(0: keep the interpreter's 5 ms; default: 0.5)")
    p.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=None,
                   help="before serving, run greedy requests at each batch size up to --max-running (1, 2, 4, ... "
                        "64), so that every CUDA graph of those batches is captured and the pipeline modes are met "
                        "before the first client; a batch size still running after 180 s writes every thread's "
                        "stack to stderr (default: on when the verifier runs on a GPU)")
    p.add_argument("--log-level", type=str.upper, choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   default=None, help="logging level (default: $SPECTANDEM_LOG_LEVEL, else WARNING)")
    p.add_argument("--engine-threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads of each engine, in this process (--backend local) or in the engine "
                        "processes serve starts (default: $OMP_NUM_THREADS where set; else the cores this process "
                        "may use less one, a core staying with the router and the gRPC server, shared evenly among "
                        "the processes that run engines, at least 1 each: one per engine and replica for ray, and "
                        "for grpc on GPUs; --backend local on the CPU, whose engines take turns on one thread while "
                        "the router waits for them, and --backend grpc on the CPU, whose engine processes take "
                        "turns: every core of the replica, the drafter's a core fewer, at least 1; where --cpu-bind "
                        "binds a pair, one per core of each engine's cores)")
    p.add_argument("--cpu-bind", choices=["auto", "none"], default="auto",
                   help="the cores of the engine processes serve starts for a speculating pair on the CPU "
                        "(--backend grpc, or ray on a local cluster; one replica): auto binds the drafter's "
                        "process to the last quarter of the cores this process may use (at least one); over ray "
                        "the verifier's to the others, over grpc the verifier keeps every core; either way the "
                        f"verifier runs forwards of up to {ONE_THREAD_UP_TO} tokens on one thread on the drafter's "
                        "cores; each with as many torch threads as it has cores unless --engine-threads or "
                        "OMP_NUM_THREADS says otherwise (their --cpu-cores, --one-thread-up-to, --one-thread-cores); "
                        "over ray serve's own process goes to the verifier's cores once the actors are up; "
                        "none leaves both on every core, taking turns (default: auto)")
    add_ops_flags(p)
    p.set_defaults(func=_serve)


def engine_call_timeout_s(args) -> float:
    """--engine-call-timeout in seconds (the backend's default unless given); refused with
    --backend local, whose engines run in this process."""
    value = getattr(args, "engine_call_timeout", None)
    if value is None:
        return RAY_CALL_TIMEOUT_S if args.backend == "ray" else GRPC_CALL_TIMEOUT_S
    if args.backend == "local":
        raise ValueError("--engine-call-timeout applies to --backend grpc and ray (engine processes), not --backend "
                         "local, whose engines run in this process")
    if not 0 < value < float("inf"):
        raise ValueError(f"--engine-call-timeout must be a number of seconds > 0, got {value}")
    return value


def switch_interval_s(args) -> float:
    """--switch-interval-ms in seconds (DEFAULT_SWITCH_INTERVAL_S unless given); refused unless
    --backend local."""
    ms = getattr(args, "switch_interval_ms", None)
    if ms is not None and args.backend != "local":
        raise ValueError(f"--switch-interval-ms applies to --backend local (one process), not --backend {args.backend}")
    if ms is not None and not 0 <= ms < float("inf"):
        raise ValueError(f"--switch-interval-ms must be a number of milliseconds >= 0, got {ms}")
    from router.local_base import DEFAULT_SWITCH_INTERVAL_S

    return DEFAULT_SWITCH_INTERVAL_S if ms is None else ms / 1000


def _spec(args):
    from spectandem.service_args import spec_from_flags

    return spec_from_flags(args)


def engine_threads(flag: int | None, omp_num_threads: str | None, processes: int = 1,
                   router_core: bool = True) -> int:
    """Torch threads of each engine (--engine-threads): the flag, else OMP_NUM_THREADS where set,
    else the cores this process may run on less one (the router's and its gRPC server's;
    `router_core` False: all of them), shared evenly among the `processes` that run engines on
    them (`engine_processes`), at least 1 each. A torch op ends at a barrier of all its threads,
    so threads beyond the free cores wait for those another process holds
    (benchmarks/results/RESULTS.md, serve-cpu-2core)."""
    if flag is not None:
        return flag
    if omp_num_threads:
        try:
            n = int(omp_num_threads)
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp_num_threads!r}") from None
        if n < 1:
            raise ValueError(f"OMP_NUM_THREADS must be a positive integer, got {omp_num_threads!r}")
        return n
    if processes < 1:
        raise ValueError(f"engine processes must be >= 1, got {processes}")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, (cores - router_core) // processes)


def engine_processes(args) -> int:
    """How many processes share the cores an engine runs on: this one (--backend local), else one
    per engine (the drafter's unless --method none) of each replica started on this machine; on a
    Ray cluster joined with --ray-address, those of one replica (its placement group keeps a pair
    on one node; where the other replicas go is Ray's choice). --backend grpc on the CPU: one per
    replica, whose engine processes take its cores in turn (`cores_per_replica`)."""
    if args.backend == "local":
        return 1
    if cores_per_replica(args):
        return _num_replicas(args)
    pair = 1 if args.method == "none" else 2
    if args.backend == "ray" and args.ray_address:
        return pair
    return _num_replicas(args) * pair


# Where `free_port` looks first: below the ports the OS hands out to outgoing connections.
PICKED_PORTS = (20000, 32768)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, for an engine process to listen on once it
    starts. Picked below the OS's range for outgoing connections (Linux's ip_local_port_range,
    32768-60999 by default) where that range is known: a port of that range, free when picked
    and bound only seconds later, can meanwhile become the local port of some connection (a
    verifier then failed to listen, under parallel tests). Falls back to a port the OS picks."""
    import random
    import socket

    low, high = PICKED_PORTS
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            high = min(high, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        high = low   # unknown: the OS's pick
    for port in random.sample(range(low, high), min(32, max(high - low, 0))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def feature_channel(args) -> str | None:
    """The feature channel serve opens: "auto", an address, or None (features through the
    router). Without --feature-channel: "auto" when this command starts both engines of a pair
    (--backend grpc or ray, no --verifier-address/--drafter-address), else None."""
    value = getattr(args, "feature_channel", None)
    if value == "off":
        return None
    if value is None:
        started_here = args.backend in ("grpc", "ray") and not args.verifier_address and not args.drafter_address
        return "auto" if started_here else None
    return value


def tree_channel(args) -> bool:
    """Whether serve opens the tree channel between the engines of each pair: --tree-channel, by
    default where this command starts both engines in other processes (--backend grpc or ray, no
    --verifier-address/--drafter-address) or in this one with a worker thread each (--backend
    local with an engine on a GPU: `_own_threads`; on the CPU both engines share one thread)."""
    started_here = args.backend in ("grpc", "ray") and not args.verifier_address and not args.drafter_address
    local = args.backend == "local" and _own_threads(args)
    value = getattr(args, "tree_channel", None)
    if value and args.backend == "local" and not local:
        raise ValueError("--tree-channel with --backend local needs an engine on a GPU: on the CPU both engines "
                         "share one worker thread, where a verify waiting for its trees would keep the draft from "
                         "running")
    if value and not (started_here or local):
        raise ValueError("--tree-channel connects engines this command starts (--backend grpc, ray or local); give "
                         "separately deployed services their own --tree-channel")
    return (started_here or local) if value is None else value


def draft_on_verdict(args) -> bool:
    """Whether the verifier hands a round's verdicts straight to the drafter (--draft-on-verdict;
    drafter/next_trees.py), and the drafter the trees it drafts on them straight back as early
    trees; refused without the tree channel, over which they go. On by default with it where the
    engines are processes of their own (--backend grpc, ray), off in-process.
    On one H100 (a = 0.8, the verdicts telling where their features lie in the feature channel's
    ring; benchmarks/results/serve-h100-draft-on-verdict.txt) a gRPC round served 299.6 tok/s with
    it against 274.8 without at concurrency 1, a Ray round 287.9 against 243.5; in-process, where
    the router's draft call reaches the drafter's thread at once, it gained nothing (one H200,
    sequential rounds, two servers alternated: 391.5 / 3,709.0 tok/s at 1 / 16 with it against
    393.5 / 3,661.2 without; benchmarks/results/serve-ab-local-c1-h200.txt), nor with the early
    trees and no draft call in the rounds they serve (1.005x at 1, 0.986x at 16 on one H200;
    benchmarks/results/local-early-trees-h200.txt)."""
    trees = tree_channel(args)
    value = getattr(args, "draft_on_verdict", None)
    if value and not trees:
        raise ValueError("--draft-on-verdict needs the tree channel (--backend grpc or ray starting both engines, "
                         "or --backend local with an engine on a GPU; not with --no-tree-channel): the verdicts go "
                         "over it")
    return (trees and args.backend != "local") if value is None else value


def _own_threads(args) -> bool:
    """--backend local: whether each engine gets a worker thread of its own (one of them on a GPU;
    on the CPU both share one, spectandem/devices.py cpu_engine_thread)."""
    verifier_device, drafter_device = args.engine_devices
    return is_cuda(verifier_device) or is_cuda(drafter_device or verifier_device)


def ahead_edge(args) -> float:
    """How much faster `auto` asks "ahead" to measure than sequential (RouterConfig.ahead_edge):
    AHEAD_EDGE_OWN_STREAM in-process with an engine on a GPU (each engine a worker thread and a
    stream of its own: the drafter drafts ahead beside the verify), else AHEAD_EDGE (engine
    processes take the GPU in turns; on the CPU the engines share one thread)."""
    from router.pipeline import AHEAD_EDGE, AHEAD_EDGE_OWN_STREAM

    return AHEAD_EDGE_OWN_STREAM if args.backend == "local" and _own_threads(args) else AHEAD_EDGE


def _num_replicas(args) -> int:
    counts = {flag: len(addrs) for flag, addrs in (("--verifier-address", args.verifier_address),
                                                   ("--drafter-address", args.drafter_address)) if addrs}
    n = args.replicas if args.replicas is not None else max(counts.values(), default=1)
    if n < 1:
        raise ValueError(f"--replicas must be >= 1, got {n}")
    for flag, k in counts.items():
        if k != n:
            raise ValueError(f"{flag} is given {k} times for {n} replicas (one address per replica)")
    return n


def _quiet(text: str) -> None:
    return None


def _progress(text: str) -> None:
    """A step of serve's start (to stderr, as the engines' own output)."""
    print(f"spectandem serve: {text}", file=sys.stderr, flush=True)


async def _build_replicas(args, cfg, target, draft, supervisor=None, say=_quiet):
    """-> ([(verifier link, drafter link or None)] one pair per replica, cleanup coroutine
    function, {role: EngineProcess} of the engine processes started here (by `supervisor`);
    replica i > 0 as "role-i"). `say`: the start's progress lines."""
    pairs, cleanups, procs = [], [], {}
    try:
        for i in range(_num_replicas(args)):
            v, d, cleanup, started = await _build_links(args, cfg, target, draft, i, supervisor, say)
            pairs.append((v, d))
            cleanups.append(cleanup)
            procs.update({(role if i == 0 else f"{role}-{i}"): p for role, p in started.items()})
    except BaseException:
        for cleanup in reversed(cleanups):
            await cleanup()
        raise

    async def cleanup_all():
        for cleanup in reversed(cleanups):  # replica 0 last: its cleanup may stop the Ray cluster
            await cleanup()
    return pairs, cleanup_all, procs


def engine_commands(args, cfg, target: str, draft: str | None, verifier_port: int | None,
                    drafter_port: int | None, feature_channel: str | None = None,
                    devices: tuple[str, str] | None = None, tree_channel: str | None = None) -> dict[str, list[str]]:
    """The command lines (`python -m verifier|drafter ...`) of the engine processes serve starts for
    --backend grpc, by role; a role whose port is None is not started. `args`: resolved model flags
    (resolve_model_flags), passed on explicitly, so that an engine never resolves `auto` itself.
    `devices`: (verifier's, drafter's) torch device (engine_devices; None: --device for both);
    `feature_channel`, `tree_channel`: the addresses of the channels between the two. The
    engines see every GPU and are told which to use (--device cuda:N), with no CUDA_VISIBLE_DEVICES."""
    unresolved = [flag for flag, value in (("--device", args.device), ("--dtype", args.dtype),
                                           ("--cuda-graphs", args.cuda_graphs),
                                           ("--triton-attention", args.triton_attention)) if value in ("auto", None)]
    if unresolved:
        raise ValueError(f"engine command lines need resolved flags; {', '.join(unresolved)} not resolved")
    verifier_device, drafter_device = devices or (args.device, args.device)
    common = ["--method", cfg.method, "--dtype", args.dtype, "--max-slots",
              str(args.max_running), "--target", target] + (["--draft", draft] if draft else []) + (
              ["--max-len", str(args.max_len)] if args.max_len else []) + ["--block-size", str(args.block_size)]
    # Engines started here serve this router only: loopback, and the internal TLS when asked.
    common += ["--host", "127.0.0.1"] + OpsConfig.from_args(args).engine_flags() + GpuPaths.from_args(args).flags()
    if args.cpu_kv_cache_gib is not None:
        common += ["--cpu-kv-cache-gib", repr(args.cpu_kv_cache_gib)]
    if feature_channel:
        common += ["--feature-channel", feature_channel]
    if tree_channel:
        common += ["--tree-channel", tree_channel]
    # Both engines on one device: the drafter's share of its memory and the verifier's rest;
    # on devices of their own, each sizes its pool from its device alone.
    mem_v, mem_d = engine_memory_flags(EngineConfig.from_args(args, cfg, target, draft, args.max_running))
    if verifier_device != drafter_device:
        mem_v = mem_d = ["--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    pool_v = (["--kv-blocks", str(args.kv_blocks)] if args.kv_blocks else []) + mem_v
    pool_d = (["--draft-kv-blocks", str(args.draft_kv_blocks)] if args.draft_kv_blocks else []) + mem_d
    shape = ["--num-steps", str(cfg.num_steps), "--topk", str(cfg.topk), "--num-draft-tokens", str(cfg.num_draft_tokens)]
    tree = shape + ["--draft-sampling-min-temperature", str(cfg.draft_sampling_min_temperature),
                    "--ahead-width", str(cfg.ahead_width)]
    if cfg.benchmark_acceptance_rate is not None:
        tree += ["--benchmark-acceptance-rate", repr(cfg.benchmark_acceptance_rate)]
    def threads(n: int | None, role: str) -> list[str]:
        sets = getattr(args, "cpu_sets", None)
        out = (["--threads", str(n)] if n else []) + (["--cpu-cores", format_cores(sets[role])] if sets else [])
        small = one_thread_up_to(args, role)
        return out + (["--one-thread-up-to", str(small), "--one-thread-cores", format_cores(one_thread_cores(args, role))]
                      if small else [])

    out = {}
    if verifier_port is not None:
        out["verifier"] = ([sys.executable, "-m", "verifier", "--port", str(verifier_port), "--device", verifier_device]
                           + common + threads(args.engine_threads, "verifier") + pool_v + (shape if cfg.method != "none" else []))
    if drafter_port is not None and cfg.method != "none":
        out["drafter"] = ([sys.executable, "-m", "drafter", "--port", str(drafter_port), "--device", drafter_device]
                          + common + threads(_drafter_threads_of(args), "drafter") + tree
                          + pool_d)
    return out


def restart_policy(args):
    from router.supervisor import RestartPolicy

    return RestartPolicy(max_restarts=args.engine_restarts, window_s=args.engine_restart_window,
                         backoff_s=args.engine_restart_backoff,
                         max_backoff_s=max(30.0, args.engine_restart_backoff))


def _loading(what: str, cfg, target, draft) -> str:
    models = f"target {target}" + (f" and {cfg.method} draft {draft}" if draft and cfg.method != "none" else "")
    if cfg.method != "none":   # the tree each round drafts (the flags', or as the head's config says)
        models += f" (tree depth {cfg.num_steps}, topk {cfg.topk}, {cfg.num_draft_tokens} nodes verified a round)"
    return f"{what} {models}"


async def _build_links(args, cfg, target, draft, index: int = 0, supervisor=None, say=_quiet):
    """One replica's links: -> (verifier link, drafter link or None, cleanup coroutine function,
    {role: EngineProcess} of the engine processes started here by `supervisor`)."""
    max_slots = args.max_running
    channel_flag = args.feature_channel if args.feature_channel != "off" else None   # given on the command line
    if channel_flag and (args.backend == "local" or args.verifier_address or args.drafter_address):
        raise ValueError("--feature-channel connects engines this command starts (--backend grpc or ray); give "
                         "separately deployed services their own --feature-channel")
    if channel_flag not in (None, "auto") and _num_replicas(args) > 1:
        raise ValueError(f"--feature-channel {channel_flag} is one pair's address; with "
                         f"{_num_replicas(args)} replicas give --feature-channel without a value")
    wanted_channel = feature_channel(args)
    tree_channel(args)   # refused here before a model loads
    draft_on_verdict(args)
    if args.backend == "local":
        from router.links_local import LocalDrafterLink, LocalVerifierLink
        from router.local import LocalSpeculator

        verifier_device, drafter_device = args.engine_devices
        config = EngineConfig.from_args(args, cfg, target, draft, max_slots)
        config = dataclasses.replace(config, device=verifier_device)
        say(_loading("loading", cfg, target, draft) + " in this process")
        spec = LocalSpeculator.from_config(config, drafter_device=drafter_device)
        thread = trees = None
        if not _own_threads(args):
            from spectandem.devices import cpu_engine_thread

            thread = cpu_engine_thread(args.engine_threads or 1)
        elif spec.drafter is not None and tree_channel(args):
            from spectandem.channel import TreeHandOff

            trees = TreeHandOff()
        d = LocalDrafterLink(spec.drafter, Path(draft).name if draft else "", thread, trees) if spec.drafter else None
        v = LocalVerifierLink(spec.verifier, Path(target).name, thread, trees,
                              drafter=d if d is not None and draft_on_verdict(args) else None)

        async def cleanup():
            if thread is not None:
                thread.shutdown(wait=False)
        return v, d, cleanup, {}
    if args.backend == "ray":
        import ray

        from router.links_ray import gcs_reachable, start_engines

        started_here = index == 0 and getattr(args, "ray_started_here", False)   # started by _platform
        _ray_init(args)
        say(_loading("starting the engine actors, loading", cfg, target, draft))
        v, d, stop = start_engines(target, draft, cfg, max_slots=max_slots, max_len=args.max_len,
                                   device=args.engine_devices[0], dtype=model_dtype(args), kv_blocks=args.kv_blocks,
                                   draft_kv_blocks=args.draft_kv_blocks, block_size=args.block_size,
                                   gpu=GpuPaths.from_args(args), feature_channel=wanted_channel,
                                   tree_channel=tree_channel(args), draft_on_verdict=draft_on_verdict(args),
                                   gpu_memory_utilization=args.gpu_memory_utilization,
                                   cpu_kv_cache_gib=args.cpu_kv_cache_gib, call_timeout_s=engine_call_timeout_s(args),
                                   num_threads=args.engine_threads or 1,   # (None: serve_async without _serve)
                                   drafter_threads=_drafter_threads_of(args), cpu_cores=getattr(args, "cpu_sets", None),
                                   one_thread_up_to=one_thread_up_to(args, "verifier"),
                                   one_thread_cores=one_thread_cores(args, "verifier"))
        bind_serving_process(args)

        async def cleanup():
            # A signal to the whole process group (`timeout`, systemd) ends a local cluster with
            # this process: every Ray call, ray.shutdown() included, then waits a minute for its
            # GCS and ends the process. So each step gets RAY_STOP_S, in a thread of its own; one
            # that does not finish means the cluster is gone, and `_serve` exits without Ray.
            steps = [stop] + ([ray.shutdown] if started_here else [])   # a local cluster started here goes too
            for step in steps:
                if not gcs_reachable() or not _finished_in(step, RAY_STOP_S):
                    _RAY_GONE.set()
                    return
        return v, d, cleanup, {}
    from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink

    ops = OpsConfig.from_args(args)
    verifier_address = args.verifier_address[index] if args.verifier_address else None
    drafter_address = args.drafter_address[index] if args.drafter_address else None
    channel = trees = None
    if wanted_channel and cfg.method != "none":
        channel = f"tcp://127.0.0.1:{free_port()}" if wanted_channel == "auto" else wanted_channel
    if tree_channel(args) and cfg.method != "none":
        trees = f"tcp://127.0.0.1:{free_port()}"
    commands = engine_commands(args, cfg, target, draft, None if verifier_address else free_port(),
                               None if drafter_address else free_port(), channel, args.engine_devices, trees)
    if commands and supervisor is None:
        raise ValueError("engine processes need a supervisor")
    procs = {}
    if commands:
        say(_loading(f"starting engine processes ({', '.join(commands)}), loading", cfg, target, draft))
    for role, argv in commands.items():
        procs[role] = supervisor.start(role if index == 0 else f"{role}-{index}", argv,
                                       getattr(args, "engine_env", None))
    if "verifier" in commands:
        verifier_address = f"localhost:{commands['verifier'][4]}"
    if "drafter" in commands:
        drafter_address = f"localhost:{commands['drafter'][4]}"
    creds = ops.link_credentials()
    deadline = engine_call_timeout_s(args)
    v = GrpcVerifierLink(verifier_address, deadline, credentials=creds,
                         hands_verdicts=trees is not None and draft_on_verdict(args))
    d = GrpcDrafterLink(drafter_address, deadline, credentials=creds) if drafter_address else None

    async def cleanup():
        await v.close()
        if d:
            await d.close()
        if supervisor is not None:
            await supervisor.wait_stopped()   # no restart from here on
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs.values()))
    return v, d, cleanup, procs


def _ray_init(args) -> None:
    """Joins --ray-address or starts a local cluster (once: later calls do nothing)."""
    from router.links_ray import ray_init

    # A local cluster gets a logical CPU per engine actor of every replica (bundles hold one).
    ray_init(args.ray_address, None if args.ray_address else max(os.cpu_count() or 1, 2 * _num_replicas(args)))


def _platform(args, target: str, say=_quiet):
    """-> (what the `auto` model flags resolve against: spectandem.config.Platform, with this
    machine's GPUs or with --backend ray the cluster's; whether a local Ray cluster was started
    here, to be stopped with serve)."""
    from spectandem.devices import probe_platform

    gpus, started_here = None, False
    if args.backend == "ray":
        import ray

        started_here = not ray.is_initialized() and args.ray_address is None
        if not ray.is_initialized():
            say(f"joining the Ray cluster at {args.ray_address}" if args.ray_address else "starting a local Ray cluster")
        _ray_init(args)
        gpus = int(ray.cluster_resources().get("GPU", 0))
    return probe_platform(target, gpus), started_here


def resolve_serve_flags(args, platform):
    """serve's flags with the model flags resolved for `platform` (resolve_model_flags), plus
    `engine_devices`: (verifier's, drafter's) torch device (engine_devices) and `gpus`: the GPUs
    the engines may use."""
    out = resolve_model_flags(args, platform)
    out.engine_devices = engine_devices(out.device, platform.gpus, out.backend, out.drafter_device)
    out.gpus = platform.gpus
    return out


def placement_line(args, cfg) -> str:
    """Where each engine runs, in its dtype, with its fast paths: "verifier on cuda:0 (bfloat16,
    CUDA graphs, Triton attention); drafter on cuda:1 (bfloat16, CUDA graphs)". Ray actors: the
    GPU, or share of one, that Ray gives each (router/links_ray.py bundle_plan). On the CPU, with
    --engine-threads resolved: the torch threads of each, "verifier on cpu (float32, eager, 1 thread)";
    with --backend local, where both engines take turns on one thread, ", taking turns" after the drafter's."""
    paths = GpuPaths.from_args(args)
    verifier, drafter = args.engine_devices
    sets = getattr(args, "cpu_sets", None)

    def count(n: int, role: str) -> str:
        cores = f" on core{'s' if len(sets[role]) > 1 else ''} {format_cores(sets[role])}" if sets else ""
        small = one_thread_up_to(args, role)
        if small:
            on = one_thread_cores(args, role)
            one = " on one thread" if n > 1 else ""
            cores += f", forwards of up to {small} tokens{one} on core{'s' if len(on) > 1 else ''} {format_cores(on)}"
        return f", {n} thread{'s' if n > 1 else ''}{cores}"

    threads = count(args.engine_threads, "verifier") if verifier == "cpu" and args.engine_threads else ""
    drafting = count(_drafter_threads_of(args), "drafter") if drafter == "cpu" and args.engine_threads else ""
    if args.backend == "ray" and verifier == "cuda":
        from router.links_ray import bundle_plan

        actors = 1 if cfg.method == "none" else 2
        share = bundle_plan(args.gpus, actors, True)[0][0]["GPU"]
        verifier = drafter = "a GPU of its own" if share == 1 else f"{share:g} of a shared GPU"
    line = f"verifier on {verifier} ({args.dtype}, {paths.describe('verifier')}{threads})"
    if cfg.method != "none":
        turns = ", taking turns" if threads and args.backend == "local" and drafter == "cpu" else ""
        line += f"; drafter on {drafter} ({args.dtype}, {paths.describe('drafter')}{drafting}){turns}"
    return line


async def _wait_ready(link, what: str, timeout: float = 300.0, process=None):
    """The engine's info once it answers. `process`: the EngineProcess serve started for it; its
    exit ends the wait at once (EngineStartError with its own last output)."""
    deadline = time.monotonic() + timeout
    while True:
        if process is not None:
            process.check()
        try:
            return await link.info()
        except Exception as exc:
            if process is not None:
                process.check()
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {what} did not come up in {timeout:.0f} s: {exc}") from None
            await asyncio.sleep(0.1)


async def _wait_channel(link, timeout: float = 120.0) -> None:
    """Waits until the verifier's feature channel is no longer connecting (the verifier returns
    features inline until then, so this only makes the first rounds use it)."""
    deadline = time.monotonic() + timeout
    state = (await link.info()).extra.get("feature_channel", "")
    while state == "connecting" and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        state = (await link.info()).extra.get("feature_channel", "")
    if state != "up":
        log.warning("the feature channel is %r: target features go through the router", state or "absent")


async def _trees_up(verifier, drafter, timeout: float = 30.0) -> bool:
    """Waits until both ends of the tree channel say "up" (the verifier's once its drafter is
    connected, the drafter's once the verifier took its connection); False (with a warning: trees
    then go through the router) if that does not happen within `timeout`."""
    deadline = time.monotonic() + timeout
    states: tuple = ()
    while time.monotonic() < deadline:
        states = tuple([(await link.info()).extra.get("tree_channel", "") for link in (verifier, drafter)])
        if states == ("up", "up"):
            return True
        await asyncio.sleep(0.1)
    log.warning("the tree channel is %r at the verifier and %r at the drafter: draft trees go through the router",
                states[0] or "absent", states[1] or "absent")
    return False


class StartStopped(Exception):
    """serve was told to end (SIGINT, SIGTERM, `stop_event`) before it served."""


class _StopSignals:
    """SIGINT and SIGTERM set `stop` (where the loop can take signals: its main thread) and, while
    serve is still starting, cancel the start's task too: a step may wait on something that never
    comes (an engine that does not start). `install` again after whatever replaced the handlers
    meanwhile (Ray's start); a signal that came in between is still taken, from the loop's
    wakeup fd."""

    def __init__(self, stop: asyncio.Event):
        self.stop, self.task, self.starting = stop, asyncio.current_task(), True
        self.signalled = False   # a SIGINT or SIGTERM came (not `stop` set otherwise)

    def install(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, self._on_signal)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def _on_signal(self) -> None:
        self.signalled = True
        self.stop.set()
        if self.starting and self.task is not None:
            self.task.cancel()


def _starting(stop: asyncio.Event) -> None:
    """Between the start's steps: StartStopped once serve was told to end."""
    if stop.is_set():
        raise StartStopped()


async def serve_async(args, ready_message=True, stop_event: asyncio.Event | None = None,
                      state: dict | None = None) -> None:
    """Runs until SIGINT/SIGTERM (or `stop_event`), which also end its start: what started is
    stopped and it returns without serving (StartStopped or CancelledError where the start had not
    yet built its engines). `state`, when given, receives the router, the links and the bound
    port once serving (for tests and embedding)."""
    from router.openai_protocol import ChatTemplate
    from router.ops import start_fronts
    from router.replicas import ReplicaSet
    from router.loop import Router, RouterConfig
    from router.server import Limits, check_port_free, prompt_char_limit, start_server
    from spectandem.checkpoint import eos_token_ids, load_tokenizer, read_config

    ops = OpsConfig.from_args(args)  # flag errors before any model loads
    switch_interval_s(args)
    engine_call_timeout_s(args)
    for flag, port in (("--port", args.port), ("--http-port", ops.http_port), ("--metrics-port", ops.metrics_port)):
        if port:   # a port in use, before the models load
            check_port_free(args.host, port, flag)
    cfg, target, draft = _spec(args)
    say = _progress if ready_message else _quiet
    stop = stop_event or asyncio.Event()
    # Ctrl-C and SIGTERM end the start too, however far it got: the step that awaits is cancelled,
    # and the start goes no further than the step it is in (`_starting`). Installed again after
    # Ray's start, which puts handlers of its own on them (a SIGTERM there ended the process with
    # a stack dump, a SIGINT was lost and the server came up).
    signals = _StopSignals(stop)
    signals.install()
    platform, ray_started_here = _platform(args, target, say)
    signals.install()
    _starting(stop)
    args = resolve_serve_flags(args, platform)
    args.ray_started_here = ray_started_here
    if not (args.verifier_address and (args.drafter_address or cfg.method == "none")):
        say(placement_line(args, cfg))   # engines this command starts
    if cfg.benchmark_acceptance_rate is not None:
        log.warning(benchmark_warning(cfg.benchmark_acceptance_rate))
        if ready_message:
            print(f"spectandem serve: WARNING: {benchmark_warning(cfg.benchmark_acceptance_rate)}",
                  file=sys.stderr, flush=True)
    tokenizer = load_tokenizer(target)
    tcfg = read_config(target)
    eos_ids = eos_token_ids(tcfg)
    fatal: list[str] = []

    def gave_up(role: str) -> None:
        if role.startswith("verifier"):   # without its verifier a replica serves nothing: serve ends, non-zero
            fatal.append(role)
            stop.set()

    from router.supervisor import EngineSupervisor

    supervisor = EngineSupervisor(restart_policy(args), on_give_up=gave_up)
    pairs, cleanup, procs = await _build_replicas(args, cfg, target, draft, supervisor, say)
    signals.install()
    server = None
    router = None
    fronts = None
    failed = None
    try:
        _starting(stop)
        routers = []
        if procs:
            say("waiting for the engine processes to load")
        for i, (v, d) in enumerate(pairs):
            suffix = "" if i == 0 else f"-{i}"
            apart = [f"the {role} at {link.address}" for role, link, given in
                     (("verifier", v, args.verifier_address), ("drafter", d, args.drafter_address))
                     if given and link is not None]   # services deployed apart: nothing else says so
            if apart:
                say("waiting for " + " and ".join(apart))
            vinfo = await _wait_ready(v, "verifier", process=procs.get(f"verifier{suffix}"))
            _starting(stop)
            dinfo = await _wait_ready(d, "drafter", process=procs.get(f"drafter{suffix}")) if d else None
            if feature_channel(args) and d is not None:
                await _wait_channel(v)
            trees = tree_channel(args) and d is not None and await _trees_up(v, d)
            want = dinfo is not None and dinfo.feature_layers not in (None, "none")
            lookahead = 1 if d is None else max(cfg.max_draft_nodes + 1, (cfg.num_steps - 1) * cfg.topk + 1)
            routers.append(Router(v, d, tokenizer, RouterConfig(max_len=vinfo.max_len, eos_token_ids=eos_ids,
                                                                lookahead=lookahead, want_features=want,
                                                                max_running=args.max_running,
                                                                drafter_timeout=args.drafter_timeout,
                                                      pipeline=args.pipeline, plain_steps=args.plain_steps,
                                                      ahead_edge=ahead_edge(args),
                                                      drafter_learns_outputs=cfg.benchmark_acceptance_rate is not None,
                                                      admit_beside_draft=args.overlap_admission,
                                                      mixed_prefill=args.mixed_prefill, tree_channel=trees,
                                                      draft_sampling_min_temperature=cfg.draft_sampling_min_temperature,
                                                      kv_blocks=vinfo.kv.get("num_blocks", 0),
                                                      kv_block_size=vinfo.kv.get("block_size", 16) or 16,
                                                      draft_kv_blocks=dinfo.kv.get("num_blocks", 0) if dinfo else 0,
                                                      draft_kv_block_size=(dinfo.kv.get("block_size", 16) or 16)
                                                      if dinfo else 16)))
            say(kv_capacity_line(vinfo.kv, dinfo.kv if dinfo else None))
        router = routers[0] if len(routers) == 1 else ReplicaSet(routers)
        v, d = pairs[0]
        supervisor.watch()   # from here on an engine process that exits is restarted
        router.start()
        if warm_up_wanted(args):
            sizes = [b for b in WARM_UP_BATCHES if b <= args.max_running]
            stage = StallDump(say)
            try:
                for r in routers:
                    await r.warm_up(sizes, int(tcfg["vocab_size"]), min(128, vinfo.max_len // 4), stage, stop)
            finally:
                stage.close()
        _starting(stop)
        limits = Limits(max_context=vinfo.max_len, vocab_size=int(tcfg["vocab_size"]),
                        max_prompt_chars=prompt_char_limit(tokenizer, vinfo.max_len))
        info = dict(target_model=Path(target).name, draft_model=Path(draft).name if draft else "",
                    method=cfg.method, num_steps=cfg.num_steps, topk=cfg.topk,
                    num_draft_tokens=cfg.num_draft_tokens, max_context=vinfo.max_len,
                    max_tokens_limit=vinfo.max_len - 1, max_stop_strings=limits.max_stop_strings,
                    max_message_bytes=limits.max_message_bytes, vocab_size=limits.vocab_size,
                    backend=args.backend, fused=cfg.fused, max_prompt_chars=limits.max_prompt_chars)
        if cfg.benchmark_acceptance_rate is not None:
            info["benchmark_acceptance_rate"] = cfg.benchmark_acceptance_rate
        credentials, interceptors = ops.grpc_server_security()
        server, port = await start_server(router, tokenizer, limits, info, args.host, args.port,
                                          credentials=credentials, interceptors=interceptors)
        fronts = await start_fronts(ops, router, tokenizer, limits, model_name=info["target_model"], host=args.host,
                                    links={"verifier": [v for v, _ in pairs], "drafter": [d for _, d in pairs if d]},
                                    positions=min(cfg.num_steps, cfg.max_draft_nodes),
                                    default_slots=args.max_running, chat_template=ChatTemplate.from_model_dir(target))
        # Everything loaded so far (models, engines, captured graphs) lives as long as the server:
        # out of every later collection, so a full collection never walks it mid-round (at batch
        # 64 on the H200 one such collection takes longer than a round).
        gc.collect()
        gc.freeze()
        signals.starting = False   # from here a signal ends serving (stop), cancelling nothing
        _starting(stop)   # a signal during the last start steps: the server never says it serves
        if state is not None:
            state.update(router=router, verifier=v, drafter=d, port=port, procs=procs, pairs=pairs,
                         http_port=fronts.http_port, metrics_port=fronts.metrics_port)
        if ready_message:
            replicas = f", {len(pairs)} replicas" if len(pairs) > 1 else ""
            print(f"spectandem serving {info['target_model']} ({cfg.method}, backend {args.backend}{replicas}) "
                  f"on {args.host}:{port}", flush=True)
            if fronts.http_port or fronts.metrics_port:
                print(f"  OpenAI-compatible HTTP: {f'{args.host}:{fronts.http_port}' if fronts.http_port else 'off'}"
                      f", metrics: {f'{args.host}:{fronts.metrics_port}/metrics' if fronts.metrics_port else 'off'}",
                      flush=True)
        if args.first_request:
            asyncio.get_running_loop().create_task(_first_request(f"localhost:{port}", args.first_request,
                                                                  ops.api_key, ops.public_tls is not None))
        await stop.wait()
    except StartStopped:   # told to end before it served: what started is cleaned up below
        pass
    except EngineStartError as exc:   # raised after the cleanup, unless a signal told serve to end (below)
        failed = exc
    finally:
        # From here a signal only sets `stop`: cancelling the task would cut the cleanup short (and
        # its last word), and every step is bounded: one that hangs must not keep the process (or a
        # test) from ending.
        signals.starting = False
        supervisor.stop_restarting()
        if fronts is not None:
            await _bounded("the HTTP fronts", fronts.close())
        if server is not None:
            await _bounded("the gRPC server", server.stop(grace=2))
        if router is not None:
            await _bounded("the router", router.stop())
        await _bounded("the engines", cleanup(), 120.0)
        gc.unfreeze()   # what the server held may be collected again (in-process callers: tests)
        if ready_message:
            print("spectandem stopped", flush=True)
    # Ctrl-C reaches the engine processes of serve's group too: one may exit, and its exit be seen
    # (an engine that failed to start), before serve takes the signal itself. Told to end, serve
    # ends as asked.
    if failed is not None and not signals.signalled:
        raise failed
    if fatal:
        raise EngineStartError(f"the {', '.join(fatal)} stayed down after {args.engine_restarts} restarts within "
                               f"{args.engine_restart_window:.0f} s (--engine-restarts, --engine-restart-window)")


WARM_UP_BATCHES = (1, 2, 4, 8, 16, 32, 64)   # the engines' CUDA graph batch buckets (spectandem/cuda_graphs.py)
# A warm-up stage (one batch size) that has not ended after this long has every thread's stack
# written to stderr, once: a start that stalls says where (on one H100 a stage takes seconds).
WARM_UP_STALL_S = 180.0


class StallDump:
    """`say` for the warm-up's stages that also arms faulthandler to write every thread's stack
    to stderr if the stage just announced has not ended `seconds` later (each stage re-arms it;
    `close` disarms it)."""

    def __init__(self, say, seconds: float = WARM_UP_STALL_S):
        self.say, self.seconds = say, seconds

    def __call__(self, text: str) -> None:
        import faulthandler

        self.say(text)
        faulthandler.dump_traceback_later(self.seconds, exit=False)

    @staticmethod
    def close() -> None:
        import faulthandler

        faulthandler.cancel_dump_traceback_later()


def warm_up_wanted(args) -> bool:
    """--warm-up, by default on where the verifier runs on a GPU (its graphs and the drafter's
    are captured as each batch bucket first runs: better before the first client than during)."""
    if args.warm_up is not None:
        return args.warm_up
    return str(getattr(args, "engine_devices", (args.device,))[0]).startswith("cuda")


RAY_GCS_WAIT_VAR = "RAY_gcs_server_port_wait_time_s"   # Ray's own setting, read by ray.init
_RAY_GONE = threading.Event()   # the local Ray cluster was gone at shutdown (router/links_ray.py: gcs_reachable)
RAY_STOP_S = 10.0               # what one Ray shutdown step may take


def _finished_in(fn, seconds: float) -> bool:
    """Runs fn in a daemon thread; whether it returned within `seconds` (one that hangs is left)."""
    t = threading.Thread(target=fn, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive()


async def _bounded(what: str, step, seconds: float = 30.0) -> None:
    """Awaits a shutdown step for at most `seconds`; a step that does not finish is logged and left."""
    try:
        await asyncio.wait_for(step, seconds)
    except asyncio.TimeoutError:
        log.warning("shutdown: %s did not stop within %.0f s; going on", what, seconds)


async def _first_request(address: str, prompt: str, api_key: str | None = None, tls: bool = False) -> None:
    """What a user's first call looks like: the SDK against the running server (over TLS: trusting
    the system's roots)."""
    from spectandem import AsyncClient, SamplingParams

    try:
        async with AsyncClient(address, timeout=120, api_key=api_key, tls=tls or None) as client:
            done = await client.generate(prompt, SamplingParams(max_tokens=64))
        s = done.stats
        print(f"--- first request: {prompt!r}\n{prompt}{done.text}\n--- {len(done.token_ids)} tokens, "
              f"finish_reason={done.finish_reason}, rounds={s['num_rounds']}, accepted={s['accepted_tokens']}"
              f"/{s['draft_tokens']} drafted, accept_length={s['accept_length']:.2f}", flush=True)
    except Exception as exc:
        print(f"first request failed: {exc}", flush=True)


def _engines_on_cpu(device: str) -> bool:
    """Whether --device (resolved or not) is the CPU, by resolve_device's rule; a CUDA device where
    no GPU is visible is not (the engines' start refuses it)."""
    from spectandem.config import resolve_device
    from spectandem.devices import cuda_gpus

    try:
        return not is_cuda(resolve_device(device, cuda_gpus()))
    except ValueError:
        return False


# How long an idle OpenMP thread of a CPU engine process spins before it sleeps (libgomp's
# GOMP_SPINCOUNT, in spin iterations) where a pair's two engine processes take turns on the same
# cores (`cores_per_replica`). libgomp's own default (300,000 where a process has no more threads than cores) keeps the
# idle engine's threads spinning into the other's turn. On the 2-core CPU (demo pair, gRPC, two
# torch threads each, concurrency 1) EAGLE-3 served 163.7 tok/s with libgomp's default, 210.5 at
# 5,000, 231.4 at 30,000 and 266.4 at 100,000, against 170.5 with one thread each
# (benchmarks/results/engine-threads-cpu-2core.txt).
PAIR_SPIN_COUNT = 100_000


def cores_per_replica(args) -> bool:
    """Whether the engine processes serve starts take the cores of their replica in turn rather
    than a share each: --backend grpc on the CPU, neither engine given by address. A pair's two
    processes take turns (the drafter drafts while the verifier waits for its trees, then the
    verifier verifies), and a plain replica's one engine leaves the router little to do while it
    computes. On the 2-core CPU (demo pair, concurrency 1) two torch threads each served plain
    decoding at 183.3 tok/s against 130.0 with one, and EAGLE-3 at 266.4 against 170.5 with the
    pair's spinning bounded (`engine_env`). Over Ray the actors keep a share each: there two
    threads each served EAGLE-3 slower (148.4 against 207.9 tok/s) and plain no faster (152.4
    against 158.9), Ray's own threads in the actor processes competing for the cores."""
    return (args.backend == "grpc" and _engines_on_cpu(args.device)
            and not args.verifier_address and not args.drafter_address)


# A pair's verifier on the CPU whose drafter has cores of its own (`cpu_sets`) runs forwards of at
# most this many tokens on one torch thread on the drafter's cores (`one_thread_cores`), larger
# ones on its own cores' threads (verifier --one-thread-up-to). On the 2-core CPU (demo pair,
# concurrency 1, chains of 5 drafts: 6 tokens a verify), a verify took 5.7-6.3 ms on one thread,
# against 7.3 on two beside the drafter's core; at 64 (384 tokens) 92.5 ms on two, against 153.2
# on one (benchmarks/results/cpu-bind-cpu-2core.txt).
ONE_THREAD_UP_TO = 32


def one_thread_up_to(args, role: str) -> int:
    """The verifier's --one-thread-up-to: ONE_THREAD_UP_TO for a pair's verifier that `cpu_sets`
    placed, else 0 (off). Those forwards run on the drafter's cores (`one_thread_cores`)."""
    return ONE_THREAD_UP_TO if getattr(args, "cpu_sets", None) is not None and role == "verifier" else 0


def one_thread_cores(args, role: str) -> list[int] | None:
    """The verifier's --one-thread-cores: for a pair that `cpu_sets` placed, the drafter's cores.
    At low concurrency one core then computes a round's verify and its draft in turn, never idling
    between them (spectandem.devices.SmallForwards). On the 2-core CPU (demo pair, concurrency 1,
    against the tree before it, runs alternated: benchmarks/results/small-forwards-cpu-2core.txt)
    EAGLE-3 served 1.11x over gRPC and 1.07x over Ray; on core 0 instead of the drafter's, gRPC
    served 0.92x of the unplaced thread."""
    sets = getattr(args, "cpu_sets", None)
    return sets["drafter"] if sets is not None and role == "verifier" else None


def bind_serving_process(args) -> None:
    """--cpu-bind auto over Ray on a local cluster (`cpu_sets`): once the engine actors are up,
    every thread of this process (the router's event loop, Ray's own, the front ends') on the
    verifier's cores, off the drafter's, where at low concurrency a round's whole critical path
    runs (its draft and the verifier's small forwards). The local cluster's processes, started
    before, and the workers it starts stay as they were. Over gRPC the verifier keeps every core,
    and this process starts the engines again after a failure (its children would inherit a
    narrower set), so nothing is bound there. On the 2-core CPU (demo pair, concurrency 1, runs
    alternated) EAGLE-3 over Ray served 208.4 tok/s bound against 200.5 unbound (1.040x); the
    serving process's threads had run on the drafter's core about 3% of the time
    (benchmarks/results/serving-process-bind-cpu-2core.txt)."""
    sets = getattr(args, "cpu_sets", None)
    if sets is None or args.backend != "ray":
        return
    from spectandem.devices import bind_cpu_cores

    bind_cpu_cores(sets["verifier"], every_thread=True)


def cpu_sets(args) -> dict[str, list[int]] | None:
    """--cpu-bind auto: the cores of each engine process of a speculating pair on this machine's
    CPU (--backend grpc taking turns, `cores_per_replica`; --backend ray on a local cluster), one
    replica, from the cores this process may use: the drafter the last quarter (at least one);
    over gRPC the verifier every core, over Ray the rest; the verifier's small forwards on one
    thread on the drafter's cores (ONE_THREAD_UP_TO, `one_thread_cores`). Unbound, the kernel's
    scheduler often ran both engines on one core while the other had little to do: on the 2-core CPU (demo pair,
    gRPC, one torch thread each, concurrency 1, alternated) EAGLE-3 served 346.4 and 360.8 tok/s
    bound against 319.7 and 329.5 unbound, the drafter's engine 4.3 / 4.1 ms a draft against 4.9;
    over Ray 337.1 and 293.5 against 295.8 and 279.8 (benchmarks/results/cpu-bind-cpu-2core.txt).
    None where nothing is bound: --cpu-bind none, local, a GPU, engines given by address or on a
    Ray cluster joined with --ray-address, one engine, several replicas, a single core."""
    local_ray = args.backend == "ray" and not args.ray_address and _engines_on_cpu(args.device)
    if (getattr(args, "cpu_bind", "none") != "auto" or args.method == "none"
            or not (cores_per_replica(args) or local_ray)
            or _num_replicas(args) != 1 or not hasattr(os, "sched_getaffinity")):
        return None
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        return None
    drafter = max(1, len(cores) // 4)
    # A gRPC pair's verifier keeps every core, its small forwards on one thread
    # (ONE_THREAD_UP_TO): bound to the others only, it verified a batch of 64 on one thread.
    return {"verifier": cores if cores_per_replica(args) else cores[:-drafter], "drafter": cores[-drafter:]}


def _drafter_threads_of(args) -> int | None:
    """The drafter's threads `configure_process` settled (`drafter_threads`), else the engines'."""
    return getattr(args, "drafter_threads", None) or args.engine_threads


def drafter_threads(args, chosen: bool) -> int | None:
    """The drafter process's torch threads: args.engine_threads, but for a pair taking turns on
    the CPU (`cores_per_replica`) whose threads no flag or OMP_NUM_THREADS chose, a core fewer
    (at least one). The verifier's work after its reply (the features into the channel, the
    verdicts to the drafter) and the router's commit run beside the draft, and a drafter team on
    every core made them wait for it: on the 2-core CPU (demo pair, gRPC, concurrency 1) EAGLE-3
    served 144.4 and 156.9 tok/s with one drafter thread against 132.5 and 150.4 with two, alternated,
    the draft's engine 8.2 / 7.7 ms a call against 9.3 / 8.6 and the verifier's work after its
    reply 0.8 against 1.1 ms (benchmarks/results/engine-threads-cpu-2core.txt)."""
    if args.engine_threads is None or chosen or args.method == "none" or not cores_per_replica(args):
        return args.engine_threads
    return max(1, args.engine_threads - 1)


def engine_env(args, environ) -> dict[str, str] | None:
    """The environment of the engine processes serve starts: `environ` (serve's own) with
    GOMP_SPINCOUNT = PAIR_SPIN_COUNT for a speculating pair whose processes take turns on the
    cores (`cores_per_replica`) with more than one torch thread each, unless `environ` sets
    GOMP_SPINCOUNT or OMP_WAIT_POLICY; None (serve's own, inherited) where nothing is added."""
    if (cores_per_replica(args) and args.method != "none" and (args.engine_threads or 1) > 1
            and not environ.get("GOMP_SPINCOUNT") and not environ.get("OMP_WAIT_POLICY")):
        return {**environ, "GOMP_SPINCOUNT": str(PAIR_SPIN_COUNT)}
    return None


def configure_process(args, omp_num_threads: str | None, environ=None) -> None:
    """The process-wide settings serve makes before any engine loads: each engine's torch
    threads (`engine_threads`, into args.engine_threads), and with --backend local, where the
    engines run in this process, those threads and the interpreter's switch interval."""
    # --backend local on the CPU: the engines take turns on one thread (spectandem/devices.py
    # cpu_engine_thread) while the router waits for them, so by default they take every core.
    on_cpu_here = args.backend == "local" and _engines_on_cpu(args.device)
    chosen = args.engine_threads is not None or bool(omp_num_threads)
    args.cpu_sets = cpu_sets(args)
    if args.cpu_sets is not None and not chosen:   # as many threads as cores, each engine
        args.engine_threads = len(args.cpu_sets["verifier"])
        args.drafter_threads = len(args.cpu_sets["drafter"])
    else:
        args.engine_threads = engine_threads(args.engine_threads, omp_num_threads, engine_processes(args),
                                             router_core=not (on_cpu_here or cores_per_replica(args)))
        args.drafter_threads = drafter_threads(args, chosen)
    args.engine_env = engine_env(args, environ or {})
    if args.backend == "local":
        from router.local_base import shorten_switch_interval
        from spectandem.devices import set_cpu_threads

        # This thread loads the engines with one torch thread, so that the engine thread's team
        # (--engine-threads) is the process's only OpenMP team of more than one thread.
        set_cpu_threads(1 if on_cpu_here else args.engine_threads)
        shorten_switch_interval(switch_interval_s(args))


def _serve(args) -> int:
    import faulthandler

    faulthandler.register(signal.SIGUSR2, all_threads=True)   # `kill -USR2 PID`: every thread's stack, to stderr
    # A loaded machine can take longer than Ray's default 30 s to bring a local cluster's GCS up:
    # it may take 120 s (the operator's own setting wins).
    os.environ.setdefault(RAY_GCS_WAIT_VAR, "120")
    # The environment is read here, in the entry point, only.
    level = args.log_level or os.environ.get("SPECTANDEM_LOG_LEVEL", "WARNING").upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"SPECTANDEM_LOG_LEVEL: unknown logging level {level!r}")
    if args.log_format == "json":
        from router.request_log import configure_json_logging

        configure_json_logging(level)
    else:
        logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s %(message)s")
    if args.api_key is None:
        args.api_key = os.environ.get("SPECTANDEM_API_KEY") or None
    configure_process(args, os.environ.get("OMP_NUM_THREADS"), os.environ)
    try:
        asyncio.run(serve_async(args))
    except (StartStopped, asyncio.CancelledError):   # told to end while it started: it cleaned up
        pass
    except EngineStartError as exc:   # an engine that failed to start, or a verifier that stayed down
        print(f"spectandem serve: error: {exc}", file=sys.stderr, flush=True)
        return 1
    if _RAY_GONE.is_set():   # skip Ray's exit hook, which would wait for the GCS that is gone
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    return 0
