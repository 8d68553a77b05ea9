"""`spectandem serve`: engines (Ray actors by default; or gRPC services; or in this process), the
router, and the public gRPC server on --host:--port, until Ctrl-C or SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from spectandem.generate_cli import add_model_flags

log = logging.getLogger("spectandem.serve")


def add_serve(sub) -> None:
    p = sub.add_parser("serve", help="serve the public gRPC API (the demo pair with no model flags)")
    add_model_flags(p)
    p.add_argument("--backend", choices=["ray", "grpc", "local"], default="ray",
                   help="ray: drafter and verifier as Ray actors (a local cluster unless --ray-address); "
                        "grpc: as gRPC services (started here unless --drafter-address/--verifier-address); "
                        "local: both engines in this process")
    p.add_argument("--ray-address", default=None, help="join an existing Ray cluster (e.g. 'auto')")
    p.add_argument("--drafter-address", default=None, help="use a separately deployed drafter service")
    p.add_argument("--verifier-address", default=None, help="use a separately deployed verifier service")
    p.add_argument("--host", default="localhost")
    p.add_argument("--port", type=int, default=50051)
    p.add_argument("--max-running", type=int, default=64, help="requests in the running batch (engine slots)")
    p.add_argument("--first-request", default=None, metavar="PROMPT",
                   help="once serving, send this prompt through the client SDK and print the completion")
    p.add_argument("--drafter-timeout", type=float, default=10.0,
                   help="seconds a drafter call may take before rounds go on without it")
    p.set_defaults(func=_serve)


def _spec(args):
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths

    cfg = SpecConfig(method=args.method, num_steps=args.num_steps, topk=args.topk,
                     num_draft_tokens=args.num_draft_tokens, fused=args.fused,
                     draft_sampling_min_temperature=args.draft_sampling_min_temperature)
    target, draft = args.target, args.draft
    if target is None:
        demo_target, demo_draft = demo_paths(args.method)
        target, draft = str(demo_target), (draft or (str(demo_draft) if demo_draft else None))
    elif draft is None and args.method in ("eagle", "eagle3", "draft-model"):
        raise ValueError(f"--method {args.method} with --target needs --draft")
    return cfg, target, draft


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _build_links(args, cfg, target, draft):
    """-> (verifier link, drafter link or None, cleanup coroutine function, {role: Popen} of the
    engine processes started here)."""
    import torch

    max_slots = args.max_running
    if args.backend == "local":
        from router.links import LocalDrafterLink, LocalVerifierLink
        from spectandem.local import LocalSpeculator

        spec = LocalSpeculator(target, draft, cfg, max_slots=max_slots, max_len=args.max_len,
                               dtype=getattr(torch, args.dtype), device=args.device)
        v = LocalVerifierLink(spec.verifier, Path(target).name)
        d = LocalDrafterLink(spec.drafter, Path(draft).name if draft else "") if spec.drafter else None

        async def cleanup():
            return None
        return v, d, cleanup, {}
    if args.backend == "ray":
        import ray

        from router.links_ray import ray_init, start_engines

        started_here = not ray.is_initialized() and args.ray_address is None
        ray_init(args.ray_address)
        v, d, stop = start_engines(target, draft, cfg, max_slots=max_slots, max_len=args.max_len,
                                   device=args.device, dtype=getattr(torch, args.dtype))

        async def cleanup():
            stop()
            if started_here:  # a local cluster this command started: take it down too
                ray.shutdown()
        return v, d, cleanup, {}
    from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink

    procs: dict[str, subprocess.Popen] = {}
    common = ["--method", cfg.method, "--device", args.device, "--dtype", args.dtype, "--max-slots", str(max_slots),
              "--target", target] + (["--draft", draft] if draft else []) + (
              ["--max-len", str(args.max_len)] if args.max_len else [])
    tree = ["--num-steps", str(cfg.num_steps), "--topk", str(cfg.topk), "--num-draft-tokens", str(cfg.num_draft_tokens),
            "--draft-sampling-min-temperature", str(cfg.draft_sampling_min_temperature)]
    verifier_address, drafter_address = args.verifier_address, args.drafter_address
    if verifier_address is None:
        port = _free_port()
        procs["verifier"] = subprocess.Popen([sys.executable, "-m", "verifier", "--port", str(port)] + common)
        verifier_address = f"localhost:{port}"
    if drafter_address is None and cfg.method != "none":
        port = _free_port()
        procs["drafter"] = subprocess.Popen([sys.executable, "-m", "drafter", "--port", str(port)] + common + tree)
        drafter_address = f"localhost:{port}"
    v = GrpcVerifierLink(verifier_address)
    d = GrpcDrafterLink(drafter_address) if drafter_address else None

    async def cleanup():
        await v.close()
        if d:
            await d.close()
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
    return v, d, cleanup, procs


async def _wait_ready(link, what: str, timeout: float = 300.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return await link.info()
        except Exception as exc:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the {what} did not come up in {timeout:.0f} s: {exc}") from None
            await asyncio.sleep(0.5)


async def serve_async(args, ready_message=True, stop_event: asyncio.Event | None = None,
                      state: dict | None = None) -> None:
    """Runs until SIGINT/SIGTERM (or `stop_event`). `state`, when given, receives the router,
    the links and the bound port once serving (for tests and embedding)."""
    from router.scheduler import Router, RouterConfig
    from router.server import Limits, start_server
    from spectandem.checkpoint import load_tokenizer, read_config

    cfg, target, draft = _spec(args)
    tokenizer = load_tokenizer(target)
    tcfg = read_config(target)
    eos = tcfg.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    v, d, cleanup, procs = await _build_links(args, cfg, target, draft)
    server = None
    router = None
    try:
        vinfo = await _wait_ready(v, "verifier")
        dinfo = await _wait_ready(d, "drafter") if d else None
        want = dinfo is not None and dinfo.feature_layers not in (None, "none")
        lookahead = 1 if d is None else max(cfg.max_draft_nodes + 1, (cfg.num_steps - 1) * cfg.topk + 1)
        router = Router(v, d, tokenizer, RouterConfig(max_len=vinfo.max_len, eos_token_ids=eos_ids,
                                                      lookahead=lookahead, want_features=want,
                                                      max_running=args.max_running,
                                                      drafter_timeout=args.drafter_timeout))
        router.start()
        limits = Limits(max_context=vinfo.max_len, vocab_size=int(tcfg["vocab_size"]))
        info = dict(target_model=Path(target).name, draft_model=Path(draft).name if draft else "",
                    method=cfg.method, num_steps=cfg.num_steps, topk=cfg.topk,
                    num_draft_tokens=cfg.num_draft_tokens, max_context=vinfo.max_len,
                    max_tokens_limit=vinfo.max_len - 1, max_stop_strings=limits.max_stop_strings,
                    max_message_bytes=limits.max_message_bytes, vocab_size=limits.vocab_size,
                    backend=args.backend, fused=cfg.fused)
        server, port = await start_server(router, tokenizer, limits, info, args.host, args.port)
        if state is not None:
            state.update(router=router, verifier=v, drafter=d, port=port, procs=procs)
        if ready_message:
            print(f"spectandem serving {info['target_model']} ({cfg.method}, backend {args.backend}) "
                  f"on {args.host}:{port}", flush=True)
        if args.first_request:
            asyncio.get_running_loop().create_task(_first_request(f"localhost:{port}", args.first_request))
        stop = stop_event or asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            try:
                loop.add_signal_handler(sig, stop.set)
            except (NotImplementedError, RuntimeError):
                pass
        await stop.wait()
    finally:
        if server is not None:
            await server.stop(grace=2)
        if router is not None:
            await router.stop()
        await cleanup()
        if ready_message:
            print("spectandem stopped", flush=True)


async def _first_request(address: str, prompt: str) -> None:
    """What a user's first call looks like: the SDK against the running server."""
    from spectandem import AsyncClient, SamplingParams

    try:
        async with AsyncClient(address, timeout=120) as client:
            done = await client.generate(prompt, SamplingParams(max_tokens=64))
        s = done.stats
        print(f"--- first request: {prompt!r}\n{prompt}{done.text}\n--- {len(done.token_ids)} tokens, "
              f"finish_reason={done.finish_reason}, rounds={s['num_rounds']}, accepted={s['accepted_tokens']}"
              f"/{s['draft_tokens']} drafted, accept_length={s['accept_length']:.2f}", flush=True)
    except Exception as exc:
        print(f"first request failed: {exc}", flush=True)


def _serve(args) -> int:
    logging.basicConfig(level=os.environ.get("SPECTANDEM_LOG_LEVEL", "WARNING"),
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")
    asyncio.run(serve_async(args))
    return 0
