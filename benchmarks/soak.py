"""Soak: `spectandem serve --backend grpc` under mixed traffic while its engines are killed and
stalled, then five invariants checked ("nothing lost, nothing stuck").

    python benchmarks/soak.py --requests 2000 --concurrency 16 --drafter-kills 4 --drafter-stalls 2 \\
        --verifier-kills 2 --verifier-stalls 1 --out soak.json

It starts the real `spectandem serve --backend grpc` (demo pair, CPU) as a subprocess in its own
process group, finds the drafter and verifier processes it started (its children running
`-m drafter` / `-m verifier`, read again before every fault), and sends `--requests` requests from
`--concurrency` workers through the SDK (`AsyncClient`): greedy and seeded, unary and streamed,
some cancelled by the client after a chunk or two, some with short deadlines, some sharing a
client-chosen request id with another request in flight. Faults are spread over the run by the
count of requests ended (sending waits for a fault that is due, except during a stall, so each lands under traffic):
SIGKILL of the drafter or the verifier, SIGSTOP for `--stall-seconds`
then SIGCONT. Before a fault, the engine it targets must be running again (serve restarts the
engines it started); one that does not come back within `--restart-wait` is a violation.

Invariants (each violation names the request and what was seen):
  terminal   every request ends exactly once: one chunk with a finish reason and nothing after it,
             or one error status, or the client's own cancel; a stream closed without a finish
             reason, a request still open at its deadline + 30 s, or DEADLINE_EXCEEDED on a request
             with a generous deadline is a violation, and so is a drafter stall during which no
             request in flight gets a chunk past the drafter timeout. Failures are allowed only where a fault
             explains them: UNAVAILABLE for requests that overlapped a verifier fault (from the
             signal until health is SERVING again), DEADLINE_EXCEEDED for short-deadline requests,
             a refusal (ALREADY_EXISTS, INVALID_ARGUMENT) of a request whose id duplicates another's.
  tokens     greedy and seeded (temperature below the drafter's sampling threshold, so drafts are
             deterministic and the draws those of plain decoding) tokens of completed requests equal
             the plain in-process reference (`LocalSpeculator`, method none, same dtype) exactly;
             what a failed or cancelled request received is a prefix of it.
  stream     chunk by chunk: each chunk extends the tokens before it (compared with the reference
             where there is one: a chunk repeating the previous tokens is "repeated", one that
             does not continue the reference "taken back / wrong"); no request gets more than
             max_tokens; "length" means exactly max_tokens; every chunk carries the request id sent.
  leaks      after the traffic and a settle: the router has nothing running or waiting, and both
             engines' used slots and KV blocks (their GetInfo, and GetServerStats' KvUsage) are
             back to the baseline read before the traffic.
  serving    at the end: health SERVING, both engine processes running, and a fresh greedy request
             completes with the reference tokens.

Everything is on loopback; every loop is bounded in count and time; only the serve process group
this script created is signalled at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# Request kinds. "checked" kinds have a reference; "sampled" (temperature above the drafter's
# sampling threshold: rejection-sampled drafts, whose draws depend on the drafts) gets the
# structural checks only.
KINDS = ("greedy", "greedy_stream", "seeded", "seeded_stream", "sampled_stream", "cancel", "short_deadline", "dup_id")
DEFAULT_MIX = {"greedy": 20, "greedy_stream": 20, "seeded": 8, "seeded_stream": 8, "sampled_stream": 5,
               "cancel": 12, "short_deadline": 12, "dup_id": 7}
SEEDED_TEMPERATURES = (0.3, 0.4)     # below --draft-sampling-min-temperature (0.5): deterministic drafts
SEEDS = tuple(range(6))              # seeded requests draw from these, so the reference stays small
EXPLAINED_DUP_CODES = ("ALREADY_EXISTS", "INVALID_ARGUMENT")


# ------------------------------------------------------------------------------------ records

@dataclass
class Planned:
    """One request as planned (deterministic from --seed)."""
    idx: int
    kind: str
    prompt: int                  # index into the prompt list
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    streamed: bool = True
    cancel_after: int = 0        # cancel after this many chunks (0: never)
    timeout: float = 60.0        # the call's deadline, seconds
    short_deadline: bool = False
    request_id: str = ""         # "" lets the server choose

    @property
    def checked(self) -> bool:
        return self.temperature == 0.0 or self.temperature in SEEDED_TEMPERATURES

    def ref_key(self) -> tuple:
        return (self.prompt, self.temperature, self.seed)


@dataclass
class Record:
    """What one request saw."""
    idx: int
    t_start: float = 0.0
    t_end: float = 0.0
    chunks: list = field(default_factory=list)        # token ids per chunk
    chunk_times: list = field(default_factory=list)
    finishes: list = field(default_factory=list)      # (chunk index, finish_reason)
    response_ids: list = field(default_factory=list)   # distinct request ids the server echoed
    code: str = ""                # gRPC status name of an error ("" when none)
    details: str = ""
    client_cancelled: bool = False
    hung: bool = False            # still open at the hard bound (deadline + 30 s)
    stats: dict | None = None
    unary: bool = False

    @property
    def tokens(self) -> list[int]:
        return [t for c in self.chunks for t in c]


@dataclass
class FaultEvent:
    action: str                   # drafter-kill, drafter-stall, verifier-kill, verifier-stall
    at_ended: int                 # requests ended when it was due
    t_signal: float = 0.0
    t_resume: float = 0.0         # SIGCONT (stalls)
    t_recovered: float | None = None   # health SERVING again after a verifier fault
    pid: int = 0
    skipped: str = ""             # why it was not done (engine not running)


# ------------------------------------------------------------------------------------ planning

def plan_requests(n: int, num_prompts: int, seed: int = 0, mix: dict | None = None, max_tokens=(8, 40),
                  timeout: float = 60.0) -> list[Planned]:
    rng = random.Random(seed)
    mix = mix or DEFAULT_MIX
    kinds, weights = zip(*[(k, w) for k, w in mix.items() if w > 0])
    out: list[Planned] = []
    dup = 0
    while len(out) < n:
        kind = rng.choices(kinds, weights)[0]
        i = len(out)
        p = Planned(i, kind, rng.randrange(num_prompts), rng.randint(*max_tokens), timeout=timeout)
        if kind in ("greedy", "seeded"):
            p.streamed = False
        if kind.startswith("seeded"):
            p.temperature, p.seed = rng.choice(SEEDED_TEMPERATURES), rng.choice(SEEDS)
            p.top_p = 0.95
        elif kind == "sampled_stream":
            p.temperature, p.seed = 0.9, rng.choice(SEEDS)
        elif kind == "cancel":
            p.max_tokens = max_tokens[1]
            p.cancel_after = rng.randint(1, 2)
        elif kind == "short_deadline":
            p.max_tokens = max_tokens[1]
            p.timeout = rng.choice((0.2, 0.5, 1.0, 2.0))
            p.short_deadline = True
        if kind == "dup_id":
            # Two requests with the same client-chosen id, planned next to each other so they run
            # together; different prompts, so a mix-up shows in their tokens.
            p.request_id = f"soak-dup-{dup}"
            out.append(p)
            if len(out) < n:
                q = Planned(len(out), kind, (p.prompt + 1) % num_prompts, rng.randint(*max_tokens),
                            timeout=timeout, request_id=p.request_id)
                out.append(q)
            dup += 1
            continue
        out.append(p)
    return out


def fault_schedule(n: int, drafter_kills: int, drafter_stalls: int, verifier_kills: int,
                   verifier_stalls: int = 0) -> list[FaultEvent]:
    """Faults interleaved (drafter ones first, verifier ones later) and spread evenly over the
    count of ended requests, the last at about 85% so recovery is seen under traffic."""
    drafter = []
    k, s = drafter_kills, drafter_stalls
    while k or s:                                   # kill, stall, kill, ...
        if k:
            drafter.append("drafter-kill")
            k -= 1
        if s:
            drafter.append("drafter-stall")
            s -= 1
    verifier = []
    k, s = verifier_kills, verifier_stalls
    while k or s:
        if s:
            verifier.append("verifier-stall")
            s -= 1
        if k:
            verifier.append("verifier-kill")
            k -= 1
    actions = list(drafter)
    for j, a in enumerate(verifier):      # spread among the drafter faults, never first
        actions.insert(max(1, (j + 1) * (len(drafter) + len(verifier)) // (len(verifier) + 1)), a)
    total = len(actions)
    return [FaultEvent(a, int(n * (0.1 + 0.75 * (i + 1) / (total + 1)))) for i, a in enumerate(actions)]


# ------------------------------------------------------------------------------------ reference

def prompt_ids(tokenizer) -> list[list[int]]:
    from tests.e2e.conftest import PROMPT_TEXTS

    return [tokenizer.encode(t).ids for t in PROMPT_TEXTS]


def reference_tokens(plan: list[Planned], prompts: list[list[int]], dtype: str = "float32",
                     max_len: int = 256, batch: int = 48) -> dict[tuple, list[int]]:
    """Plain decoding in this process (method none, same dtype as the server) at the plan's
    largest max_tokens for every (prompt, temperature, seed) the checked requests use; a request
    with fewer tokens expects a prefix (draws are keyed by position, decoding is causal)."""
    import torch

    from spectandem.config import SamplingParams, SpecConfig
    from spectandem.demo import demo_paths
    from router.local import LocalSpeculator

    keys = sorted({p.ref_key() for p in plan if p.checked} | {(0, 0.0, None)}, key=repr)
    longest = max(p.max_tokens for p in plan)
    spec = LocalSpeculator(demo_paths("none")[0], None, SpecConfig(method="none"), max_slots=batch,
                           max_len=max_len, dtype=getattr(torch, dtype))
    out: dict[tuple, list[int]] = {}
    for s in range(0, len(keys), batch):
        part = keys[s:s + batch]
        params = [SamplingParams(max_tokens=longest, temperature=t, top_p=0.95 if t else 1.0, seed=seed)
                  for _, t, seed in part]
        for key, done in zip(part, spec.generate([prompts[k[0]] for k in part], params)):
            out[key] = list(done.token_ids)
    return out


def expected_for(p: Planned, refs: dict) -> list[int] | None:
    ref = refs.get(p.ref_key()) if p.checked else None
    return None if ref is None else ref[:p.max_tokens]


# ------------------------------------------------------------------------------------ processes

def children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(x) for x in f.read().split()]
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass
    return out


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except (FileNotFoundError, ProcessLookupError):
        return []


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def engines(serve_pid: int) -> dict[str, tuple[int, int]]:
    """{"drafter"/"verifier": (pid, port)} of the live engine processes under serve."""
    out = {}
    for c in children(serve_pid):
        argv = _cmdline(c)
        for role in ("drafter", "verifier"):
            if "-m" in argv and role in argv[argv.index("-m") + 1:argv.index("-m") + 2] and _alive(c):
                port = int(argv[argv.index("--port") + 1]) if "--port" in argv else 0
                out[role] = (c, port)
    return out


class ServeProcess:
    """`python -m spectandem.cli serve --backend grpc ...` in a new session (its own process group)."""

    def __init__(self, extra: list[str], log_dir: str, dtype: str, drafter_timeout: float, max_running: int,
                 max_len: int):
        self.log_path = os.path.join(log_dir, "serve.log")
        self.log = open(self.log_path, "w")
        argv = [sys.executable, "-m", "spectandem.cli", "serve", "--backend", "grpc", "--host", "localhost",
                "--port", "0", "--http-port", "0", "--metrics-port", "0", "--dtype", dtype,
                "--drafter-timeout", str(drafter_timeout), "--max-running", str(max_running),
                "--max-len", str(max_len), *extra]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, cwd=str(ROOT), env=env,
                                     start_new_session=True)
        self.pgid = self.proc.pid          # start_new_session: the group this script created
        self.address = ""

    def wait_address(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with open(self.log_path) as f:
                m = re.search(r"spectandem serving .* on ([\w.\-]+):(\d+)", f.read())
            if m:
                self.address = f"{m.group(1)}:{m.group(2)}"
                return self.address
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}: {self.tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"serve did not print its address in {timeout:.0f} s: {self.tail()}")

    def tail(self, n: int = 3000) -> str:
        with open(self.log_path) as f:
            return f.read()[-n:]

    def stop(self) -> int | None:
        """SIGTERM to the group, then SIGKILL to it after 30 s; the engines it started are in it."""
        for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, sig)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pgid, signal.SIGCONT)    # a stopped engine must see the signal too
            try:
                return self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
        return None


# ------------------------------------------------------------------------------------ traffic

def _sdk_params(p: Planned):
    from spectandem.config import SamplingParams

    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p, seed=p.seed)


async def run_one(client, p: Planned, prompt: list[int], rec: Record, t0: float) -> None:
    from spectandem.errors import SpectandemError

    rec.t_start = time.monotonic() - t0
    rec.unary = not p.streamed

    async def body():
        if not p.streamed:
            done = await client.generate(prompt, _sdk_params(p), timeout=p.timeout, request_id=p.request_id or None)
            rec.chunks, rec.chunk_times = [list(done.token_ids)], [time.monotonic() - t0]
            rec.finishes, rec.stats = [(0, done.finish_reason)], done.stats
            rec.response_ids = [done.request_id] if done.request_id else []
            return
        stream = client.stream(prompt, _sdk_params(p), timeout=p.timeout, request_id=p.request_id or None)
        async with contextlib.aclosing(stream) as chunks:
            async for chunk in chunks:
                if chunk.finish_reason is not None:
                    rec.finishes.append((len(rec.chunks), chunk.finish_reason))
                    rec.stats = chunk.stats
                rec.chunks.append(list(chunk.token_ids))
                rec.chunk_times.append(time.monotonic() - t0)
                if chunk.request_id and chunk.request_id not in rec.response_ids:
                    rec.response_ids.append(chunk.request_id)
                if p.cancel_after and len(rec.chunks) >= p.cancel_after and not rec.finishes:
                    rec.client_cancelled = True
                    break

    try:
        await asyncio.wait_for(body(), p.timeout + 30.0)
    except asyncio.TimeoutError:
        rec.hung = True
    except SpectandemError as exc:
        rec.code, rec.details = exc.code.name, exc.details[:300]
    except Exception as exc:  # anything else the SDK let through is a finding too
        rec.code, rec.details = "CLIENT_" + type(exc).__name__, str(exc)[:300]
    rec.t_end = time.monotonic() - t0


async def _health_status(health_stub) -> str:
    from grpc_health.v1 import health_pb2

    try:
        r = await health_stub.Check(health_pb2.HealthCheckRequest(service="spectandem.v1.Generation"), timeout=2)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(r.status)
    except Exception as exc:
        return type(exc).__name__


async def _wait_engine(serve_pid: int, role: str, health_stub, timeout: float) -> tuple[tuple[int, int] | None, str]:
    """(the engine's (pid, port), "") once it runs, answers GetInfo and health is SERVING; after
    `timeout`: (None, what was missing last)."""
    deadline = time.monotonic() + timeout
    why = ""
    while time.monotonic() < deadline:
        eng = engines(serve_pid).get(role)
        status = await _health_status(health_stub)
        if eng is None:
            why = f"no live {role} process under serve"
        elif await _engine_info(role, eng[1]) is None:
            why = f"the {role} process {eng[0]} does not answer GetInfo"
        elif status != "SERVING":
            why = f"server health {status}"
        else:
            return eng, ""
        await asyncio.sleep(0.5)
    return None, f"{why} for {timeout:.0f} s"


async def _engine_info(role: str, port: int) -> dict | None:
    import grpc

    from spectandem.v1 import engines_pb2, engines_pb2_grpc

    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as ch:
            stub = (engines_pb2_grpc.DrafterStub if role == "drafter" else engines_pb2_grpc.VerifierStub)(ch)
            info = await stub.GetInfo(engines_pb2.EngineInfoRequest(), timeout=3)
            return {"used_slots": info.used_slots, "kv_used_blocks": info.kv_used_blocks,
                    "max_slots": info.max_slots, "kv_blocks": info.kv_blocks}
    except Exception:
        return None


async def run_faults(faults: list[FaultEvent], serve_pid: int, ended: list[int], health_stub, t0: float,
                     stall_seconds: float, restart_wait: float, stop: asyncio.Event, stalling: list) -> None:
    """Signals each fault once its count of ended requests is reached and its engine is up;
    `stalling[0]` is True while an engine is stopped."""
    for f in faults:
        while ended[0] < f.at_ended and not stop.is_set():
            await asyncio.sleep(0.05)
        if stop.is_set():
            f.skipped = "traffic ended first"
            continue
        role = f.action.split("-")[0]
        eng, why = await _wait_engine(serve_pid, role, health_stub, restart_wait)
        if eng is None:
            f.skipped = why
            continue
        f.pid = eng[0]
        f.t_signal = time.monotonic() - t0
        if f.action.endswith("kill"):
            with contextlib.suppress(ProcessLookupError):
                os.kill(f.pid, signal.SIGKILL)
        else:
            with contextlib.suppress(ProcessLookupError):
                os.kill(f.pid, signal.SIGSTOP)
            stalling[0] = True
            await asyncio.sleep(stall_seconds)
            stalling[0] = False
            with contextlib.suppress(ProcessLookupError):
                os.kill(f.pid, signal.SIGCONT)
            f.t_resume = time.monotonic() - t0
        if role == "verifier":
            # Health goes NOT_SERVING once the router sees the fault; the window ends when it is
            # SERVING again (a stall the router never noticed: SERVING at once after SIGCONT).
            deadline = time.monotonic() + restart_wait
            seen_down = False
            while time.monotonic() < deadline and not stop.is_set():
                st = await _health_status(health_stub)
                seen_down |= st != "SERVING"
                if st == "SERVING" and (seen_down or f.action.endswith("stall")
                                        or time.monotonic() - t0 > f.t_signal + 10):
                    f.t_recovered = time.monotonic() - t0
                    break
                await asyncio.sleep(0.2)


async def run_traffic(address: str, plan: list[Planned], prompts: list[list[int]], faults: list[FaultEvent],
                      serve_pid: int, concurrency: int, stall_seconds: float, restart_wait: float,
                      max_seconds: float, progress: bool = False) -> tuple[list[Record], float]:
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    from spectandem.client import AsyncClient

    t0 = time.monotonic()
    records = [Record(p.idx) for p in plan]
    ended = [0]
    next_i = [0]
    stop = asyncio.Event()
    health_ch = grpc.aio.insecure_channel(address)
    health = health_pb2_grpc.HealthStub(health_ch)
    client = AsyncClient(address, timeout=120, max_retries=3)

    def held_back(i: int) -> bool:
        # A fault due at N ended requests is signalled before request N + concurrency is sent, so
        # it always lands under traffic, however long the faults before it took.
        # While an engine is stopped requests keep coming (rounds must go on during a stall), paced
        # evenly over the stall, and a reserve of the plan is kept for the faults still to come:
        # on a fast machine an unpaced stall drains the plan in its first seconds, leaving the
        # rest of the stall without traffic and the later faults without requests.
        pending = [f for f in faults if not f.t_signal and not f.skipped]
        if stalling[0]:
            if not stall_pace:
                stall_pace[:] = [time.monotonic(), i]
            started, first = stall_pace
            budget = max(0, len(plan) - 2 * concurrency * len(pending) - first)
            return i >= first + budget * min(1.0, (time.monotonic() - started) / max(stall_seconds, 1e-3))
        stall_pace.clear()
        return any(f.at_ended + concurrency <= i for f in pending)

    async def worker():
        while next_i[0] < len(plan) and time.monotonic() - t0 < max_seconds:
            if held_back(next_i[0]) and not fault_task.done():
                await asyncio.sleep(0.05)
                continue
            p = plan[next_i[0]]
            next_i[0] += 1
            await run_one(client, p, prompts[p.prompt], records[p.idx], t0)
            ended[0] += 1
            if progress and ended[0] % 100 == 0:
                print(f"  {ended[0]} requests ended, {time.monotonic() - t0:.0f} s", flush=True)

    stalling: list = [False]
    stall_pace: list = []          # [when the stall was first seen, the next request then]
    fault_task = asyncio.create_task(run_faults(faults, serve_pid, ended, health, t0, stall_seconds,
                                                restart_wait, stop, stalling))
    try:
        await asyncio.gather(*[worker() for _ in range(concurrency)])
    finally:
        stop.set()
        await asyncio.wait_for(fault_task, restart_wait + stall_seconds + 30)
        await client.close()
        await health_ch.close()
    sent = next_i[0]
    return records[:sent], time.monotonic() - t0


async def end_state(address: str, serve_pid: int, baseline: dict, settle_s: float, prompt: list[int],
                    expected: list[int]) -> dict:
    """Waits (bounded) for SERVING and for the usage to return to the baseline, then sends a fresh
    greedy request."""
    import grpc
    from grpc_health.v1 import health_pb2_grpc

    from spectandem.client import AsyncClient
    from spectandem.config import SamplingParams

    out: dict = {}
    async with grpc.aio.insecure_channel(address) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + settle_s
        status = await _health_status(health)
        while status != "SERVING" and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            status = await _health_status(health)
        out["health"] = status
        usage = await read_usage(ch, serve_pid)
        while usage != baseline and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
            usage = await read_usage(ch, serve_pid)
        out["usage"] = usage
        out["engines"] = {r: pid for r, (pid, _) in engines(serve_pid).items()}
    async with AsyncClient(address, timeout=60) as client:
        try:
            done = await client.generate(prompt, SamplingParams(max_tokens=len(expected)), timeout=60)
            out["fresh_request"] = {"ok": done.token_ids == expected, "finish_reason": done.finish_reason,
                                    "accepted_tokens": done.stats.get("accepted_tokens", 0)}
        except Exception as exc:
            out["fresh_request"] = {"ok": False, "error": str(exc)[:300]}
        # Reported, not checked: whether requests are drafted again (the drafter back in use).
        out["drafting_again_after_s"] = None
        t = time.monotonic()
        while out["fresh_request"].get("ok") and time.monotonic() - t < settle_s:
            with contextlib.suppress(Exception):
                done = await client.generate(prompt, SamplingParams(max_tokens=len(expected)), timeout=30)
                if done.stats.get("accepted_tokens", 0) > 0:
                    out["drafting_again_after_s"] = round(time.monotonic() - t, 1)
                    break
            await asyncio.sleep(1.0)
    return out


async def read_usage(channel, serve_pid: int) -> dict:
    """Slots and KV blocks in use on both sides (the engines' GetInfo) and the router's queues and
    KvUsage (GetServerStats)."""
    from spectandem.v1 import generation_pb2, generation_pb2_grpc

    usage: dict = {}
    try:
        s = await generation_pb2_grpc.GenerationStub(channel).GetServerStats(generation_pb2.GetServerStatsRequest(),
                                                                              timeout=10)
        usage["router"] = {"running": s.running, "waiting": s.waiting,
                           "verifier_kv_used": s.verifier_kv.used_blocks, "drafter_kv_used": s.drafter_kv.used_blocks}
    except Exception as exc:
        usage["router"] = {"error": type(exc).__name__}
    eng = engines(serve_pid)
    for role in ("verifier", "drafter"):
        info = await _engine_info(role, eng[role][1]) if role in eng else None
        usage[role] = None if info is None else {"used_slots": info["used_slots"],
                                                 "kv_used_blocks": info["kv_used_blocks"]}
    return usage


# ------------------------------------------------------------------------------------ checking

def _overlaps(rec: Record, windows: list[tuple[float, float]], margin: float = 1.0) -> bool:
    return any(rec.t_start <= b + margin and rec.t_end >= a - margin for a, b in windows)


def verifier_windows(faults: list[FaultEvent], t_end: float) -> list[tuple[float, float]]:
    """Where the verifier was down or stopped: from the signal until health was SERVING again
    (until the end of the run when it never was)."""
    out = []
    for f in faults:
        if f.action.startswith("verifier") and not f.skipped:
            out.append((f.t_signal, f.t_recovered if f.t_recovered is not None else t_end))
    return out


DEADLINE_SLACK_S = 0.05   # how far before its deadline a client's DEADLINE_EXCEEDED may be reported


def finished_at_deadline(rec: Record, p: Planned) -> bool:
    """Whether a short-deadline stream got its finish chunk and then, at the deadline, its status:
    the server sends the last chunk and then the status, and a deadline that expires between the
    two makes grpc report DEADLINE_EXCEEDED for a request that completed (the client may read the
    finish chunk, received in time, only after the deadline, when its loop is busy). The finish
    must be the stream's last chunk and the status must come at the deadline (a DEADLINE_EXCEEDED
    earlier than that would be the server's, and is not this)."""
    if rec.code != "DEADLINE_EXCEEDED" or not p.short_deadline or len(rec.finishes) != 1 or rec.unary:
        return False
    return rec.finishes[0][0] == len(rec.chunks) - 1 and rec.t_end - rec.t_start >= p.timeout - DEADLINE_SLACK_S


def check(plan: list[Planned], records: list[Record], refs: dict, faults: list[FaultEvent], end: dict | None,
          baseline: dict | None, t_end: float | None = None, drafter_timeout: float = 2.0) -> dict:
    """The invariants over what the run recorded -> {"violations": [...], figures}. Pure: the unit
    tests feed it fabricated records."""
    violations: list[dict] = []
    t_end = t_end if t_end is not None else max((r.t_end for r in records), default=0.0)
    vwin = verifier_windows(faults, t_end)
    by_code: dict[str, int] = {}
    fig = dict(sent=len(records), completed=0, failed=0, client_cancelled=0, deadline_exceeded=0,
               wrong_tokens=0, repeated_chunks=0, taken_back_chunks=0, hung=0, stuck=0, unexplained_failures=0,
               checked_completions=0, unchecked_completions=0, fallback_rounds=0, finished_at_deadline=0)

    def bad(inv: str, p: Planned, what: str):
        violations.append({"invariant": inv, "idx": p.idx, "kind": p.kind, "request_id": p.request_id, "what": what})

    for rec in records:
        p = plan[rec.idx]
        exp = expected_for(p, refs)
        toks = rec.tokens
        code = rec.code
        if finished_at_deadline(rec, p):   # one end: the finish; the status lost the race with the deadline
            fig["finished_at_deadline"] += 1
            code = ""
        # ---- terminal: exactly one end
        ends = len(rec.finishes) + bool(code) + rec.client_cancelled + rec.hung
        if rec.hung:
            fig["hung"] += 1
            bad("terminal", p, f"still open {p.timeout + 30:.0f} s after it was sent (timeout {p.timeout} s)")
        elif ends == 0:
            bad("terminal", p, f"stream closed without a finish reason or an error after {len(toks)} tokens")
        elif ends > 1:
            bad("terminal", p, f"{ends} terminal states: finishes {rec.finishes}, code {code or '-'}, "
                               f"cancelled {rec.client_cancelled} (sent at {rec.t_start:.2f} s, deadline "
                               f"{p.timeout} s, last chunk at {rec.chunk_times[-1] if rec.chunk_times else '-'}, "
                               f"ended at {rec.t_end:.2f} s)")
        if rec.finishes and rec.finishes[0][0] != len(rec.chunks) - 1:
            bad("stream", p, f"{len(rec.chunks) - 1 - rec.finishes[0][0]} chunk(s) after the finish chunk")
        if code:
            by_code[code] = by_code.get(code, 0) + 1
            fig["failed"] += 1
            explained = ((code == "UNAVAILABLE" and _overlaps(rec, vwin))
                         or (code == "DEADLINE_EXCEEDED" and p.short_deadline)
                         or (code in EXPLAINED_DUP_CODES and p.kind == "dup_id"))
            if code == "DEADLINE_EXCEEDED":
                fig["deadline_exceeded"] += 1
            if not explained:
                fig["unexplained_failures"] += 1
                if code == "DEADLINE_EXCEEDED":
                    fig["stuck"] += 1
                bad("terminal", p, ("stuck: " if code == "DEADLINE_EXCEEDED" else "")
                    + f"{code} not explained by a fault ({rec.details!r}; "
                                   f"{rec.t_start:.1f}-{rec.t_end:.1f} s, {len(toks)} tokens)")
        elif rec.client_cancelled:
            fig["client_cancelled"] += 1
        elif rec.finishes and len(rec.finishes) == 1:
            fig["completed"] += 1
            fig["fallback_rounds"] += (rec.stats or {}).get("fallback_rounds", 0)
        # ---- stream: order, repeats, take-backs, lengths
        if len(toks) > p.max_tokens:
            bad("stream", p, f"{len(toks)} tokens for max_tokens {p.max_tokens}")
        if rec.finishes and rec.finishes[-1][1] == "length" and len(toks) != p.max_tokens:
            bad("stream", p, f"finish 'length' after {len(toks)} tokens, max_tokens {p.max_tokens}")
        if rec.finishes and rec.finishes[-1][1] not in ("stop", "length"):
            bad("stream", p, f"finish reason {rec.finishes[-1][1]!r}")
        if p.request_id and rec.response_ids and rec.response_ids != [p.request_id]:
            bad("stream", p, f"responses carry ids {rec.response_ids}, sent {p.request_id!r}")
        if len(rec.response_ids) > 1:
            bad("stream", p, f"responses carry several ids {rec.response_ids}")
        if exp is not None:
            seen: list[int] = []
            for n, chunk in enumerate([] if rec.unary else rec.chunks):
                if chunk and chunk != exp[len(seen):len(seen) + len(chunk)]:
                    repeated = len(chunk) <= len(seen) and seen[-len(chunk):] == chunk
                    fig["repeated_chunks" if repeated else "taken_back_chunks"] += 1
                    bad("stream", p, f"chunk {n} {'repeats' if repeated else 'does not continue'} the tokens "
                                     f"before it: {chunk[:8]} at position {len(seen)}, expected "
                                     f"{exp[len(seen):len(seen) + len(chunk)][:8]}")
                    break
                seen += chunk
            # ---- tokens: exact for completions, prefix for the others
            done = bool(rec.finishes) and not code and not rec.client_cancelled
            if done:
                fig["checked_completions"] += 1
            if (done and toks != exp) or (not done and toks != exp[:len(toks)]):
                fig["wrong_tokens"] += 1
                first = next((i for i, (a, b) in enumerate(zip(toks, exp)) if a != b), min(len(toks), len(exp)))
                bad("tokens", p, f"{'completed' if done else 'partial'} tokens differ from the reference at "
                                 f"position {first} ({len(toks)} tokens, reference {len(exp)})")
        elif rec.finishes and not code:
            fig["unchecked_completions"] += 1
    # ---- stuck rounds: while an engine is stopped past the drafter timeout, requests must still
    # make progress when it is the drafter (rounds go on without it)
    fig["stall_progress"] = []
    for f in faults:
        if f.action != "drafter-stall" or f.skipped or not f.t_resume:
            continue
        a, b = f.t_signal + drafter_timeout + 1.0, f.t_resume
        if b - a < 1.0:
            continue
        waiting = sum(1 for r in records if r.t_start < b and r.t_end > a)
        progress = sum(1 for r in records for t in r.chunk_times if a <= t <= b)
        fig["stall_progress"].append({"window": [round(a, 1), round(b, 1)], "open_requests": waiting,
                                      "chunks": progress})
        if waiting and not progress:
            violations.append({"invariant": "terminal", "idx": -1, "kind": "", "request_id": "",
                               "what": f"no request made progress from {a:.1f} to {b:.1f} s while the drafter was "
                                       f"stopped ({waiting} requests open in it): rounds wait for a stalled drafter"})
    # ---- leaks
    leaked = {}
    if end is not None and baseline is not None:
        usage = end.get("usage") or {}
        for side in ("router", "verifier", "drafter"):
            if usage.get(side) != baseline.get(side):
                leaked[side] = {"baseline": baseline.get(side), "end": usage.get(side)}
                violations.append({"invariant": "leaks", "idx": -1, "kind": "", "request_id": "",
                                   "what": f"{side}: {baseline.get(side)} before the traffic, {usage.get(side)} "
                                           "after it settled"})
    # ---- serving at the end, engines back
    if end is not None:
        if end.get("health") != "SERVING":
            violations.append({"invariant": "serving", "idx": -1, "kind": "", "request_id": "",
                               "what": f"health {end.get('health')} at the end"})
        for role in ("verifier", "drafter"):
            if role not in (end.get("engines") or {}):
                violations.append({"invariant": "serving", "idx": -1, "kind": "", "request_id": "",
                                   "what": f"no live {role} process under serve at the end"})
        fresh = end.get("fresh_request") or {}
        if not fresh.get("ok"):
            violations.append({"invariant": "serving", "idx": -1, "kind": "", "request_id": "",
                               "what": f"a fresh greedy request at the end did not complete exactly: {fresh}"})
    for f in faults:
        if f.skipped:
            violations.append({"invariant": "serving", "idx": -1, "kind": "", "request_id": "",
                               "what": f"fault {f.action} due at {f.at_ended} ended requests not done: {f.skipped}"})
    fig["failed_by_code"] = dict(sorted(by_code.items()))
    fig["leaked"] = leaked
    fig["violations_by_invariant"] = {}
    for v in violations:
        fig["violations_by_invariant"][v["invariant"]] = fig["violations_by_invariant"].get(v["invariant"], 0) + 1
    fig["violations"] = violations
    return fig


# ------------------------------------------------------------------------------------ driver

@dataclass
class SoakConfig:
    requests: int = 300
    concurrency: int = 16
    drafter_kills: int = 2
    drafter_stalls: int = 1
    verifier_kills: int = 1
    verifier_stalls: int = 0
    stall_seconds: float = 6.0
    drafter_timeout: float = 2.0
    restart_wait: float = 60.0
    settle_seconds: float = 30.0
    max_seconds: float = 600.0     # no new request after this; every request is bounded anyway
    dtype: str = "float32"
    max_len: int = 256
    seed: int = 0
    serve_args: tuple = ()
    progress: bool = False
    mix: dict | None = None        # kind -> weight (DEFAULT_MIX when None)


def run_soak(cfg: SoakConfig, log_dir: str | None = None) -> dict:
    from spectandem.checkpoint import load_tokenizer
    from spectandem.demo import demo_paths

    log_dir = log_dir or tempfile.mkdtemp(prefix="soak-")
    tokenizer = load_tokenizer(demo_paths("none")[0])
    prompts = prompt_ids(tokenizer)
    plan = plan_requests(cfg.requests, len(prompts), cfg.seed, cfg.mix)
    faults = fault_schedule(cfg.requests, cfg.drafter_kills, cfg.drafter_stalls, cfg.verifier_kills,
                            cfg.verifier_stalls)
    t_start = time.monotonic()
    serve = ServeProcess(list(cfg.serve_args), log_dir, cfg.dtype, cfg.drafter_timeout, cfg.concurrency,
                         cfg.max_len)
    try:
        refs = reference_tokens(plan, prompts, cfg.dtype, cfg.max_len)   # while serve loads
        t_ref = time.monotonic() - t_start
        address = serve.wait_address()

        async def main():
            import grpc

            async with grpc.aio.insecure_channel(address) as ch:
                baseline = await read_usage(ch, serve.proc.pid)
            records, took = await run_traffic(address, plan, prompts, faults, serve.proc.pid, cfg.concurrency,
                                              cfg.stall_seconds, cfg.restart_wait, cfg.max_seconds, cfg.progress)
            fresh_expected = refs[(0, 0.0, None)][:16]
            end = await end_state(address, serve.proc.pid, baseline, cfg.settle_seconds, prompts[0], fresh_expected)
            return baseline, records, took, end

        baseline, records, took, end = asyncio.run(main())
    finally:
        rc = serve.stop()
    fig = check(plan, records, refs, faults, end, baseline,
                t_end=max((r.t_end for r in records), default=0.0), drafter_timeout=cfg.drafter_timeout)
    fig.update(planned=cfg.requests, traffic_seconds=round(took, 1), total_seconds=round(time.monotonic() - t_start, 1),
               reference_seconds=round(t_ref, 1), serve_exit=rc, baseline=baseline, end=end,
               faults=[dataclasses.asdict(f) for f in faults], config=dataclasses.asdict(cfg),
               kinds={k: sum(1 for r in records if plan[r.idx].kind == k) for k in KINDS},
               serve_log=serve.log_path)
    return fig


def summary(fig: dict) -> str:
    rows = [("sent / planned", f"{fig['sent']} / {fig['planned']}"),
            ("completed", f"{fig['completed']} ({fig['checked_completions']} checked against the reference, "
                          f"{fig['unchecked_completions']} sampled-draft unchecked)"),
            ("failed by status code", ", ".join(f"{k} {v}" for k, v in fig["failed_by_code"].items()) or "none"),
            ("unexplained failures", fig["unexplained_failures"]),
            ("cancelled by the client", fig["client_cancelled"]),
            ("deadline exceeded", fig["deadline_exceeded"]),
            ("finished, then DEADLINE_EXCEEDED at the deadline", fig["finished_at_deadline"]),
            ("stuck (DEADLINE_EXCEEDED at a generous deadline)", fig["stuck"]),
            ("hung (no end by deadline + 30 s)", fig["hung"]),
            ("wrong tokens (requests)", fig["wrong_tokens"]),
            ("repeated / taken-back chunks", f"{fig['repeated_chunks']} / {fig['taken_back_chunks']}"),
            ("leaked (vs baseline)", json.dumps(fig["leaked"]) if fig["leaked"] else "none"),
            ("end usage", json.dumps((fig.get("end") or {}).get("usage"))),
            ("serving at end", f"health {(fig.get('end') or {}).get('health')}, engines "
                               f"{sorted(((fig.get('end') or {}).get('engines') or {}))}, fresh request "
                               f"{(fig.get('end') or {}).get('fresh_request')}"),
            ("faults", "; ".join(f"{f['action']}@{f['at_ended']}"
                                 + (f" SKIPPED ({f['skipped']})" if f["skipped"] else
                                    f" t={f['t_signal']:.1f}s" + (f" back {f['t_recovered']:.1f}s"
                                                                   if f["t_recovered"] is not None else ""))
                                 for f in fig["faults"])),
            ("fallback rounds (completed requests)", fig["fallback_rounds"]),
            ("requests drafted again after (s)", (fig.get("end") or {}).get("drafting_again_after_s")),
            ("progress while the drafter was stopped", json.dumps(fig["stall_progress"])),
            ("traffic / total seconds", f"{fig['traffic_seconds']} / {fig['total_seconds']}"),
            ("violations by invariant", json.dumps(fig["violations_by_invariant"]) or "none")]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    for v in fig["violations"][:40]:
        lines.append(f"  [{v['invariant']}] #{v['idx']} {v['kind']} {v['request_id']}: {v['what']}")
    if len(fig["violations"]) > 40:
        lines.append(f"  ... {len(fig['violations']) - 40} more (see --out)")
    return "\n".join(lines)


def _mix(text: str | None) -> dict | None:
    if not text:
        return None
    mix = dict(DEFAULT_MIX)
    for item in text.split(","):
        kind, _, w = item.partition("=")
        if kind not in KINDS:
            raise SystemExit(f"--mix: unknown kind {kind!r} (kinds: {', '.join(KINDS)})")
        mix[kind] = int(w)
    return mix


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    d = SoakConfig()
    ap.add_argument("--requests", type=int, default=d.requests)
    ap.add_argument("--concurrency", type=int, default=d.concurrency)
    ap.add_argument("--drafter-kills", type=int, default=d.drafter_kills)
    ap.add_argument("--drafter-stalls", type=int, default=d.drafter_stalls)
    ap.add_argument("--verifier-kills", type=int, default=d.verifier_kills)
    ap.add_argument("--verifier-stalls", type=int, default=d.verifier_stalls)
    ap.add_argument("--stall-seconds", type=float, default=d.stall_seconds)
    ap.add_argument("--drafter-timeout", type=float, default=d.drafter_timeout)
    ap.add_argument("--restart-wait", type=float, default=d.restart_wait,
                    help="seconds an engine may take to be back before a fault on it counts as undone")
    ap.add_argument("--settle-seconds", type=float, default=d.settle_seconds)
    ap.add_argument("--max-seconds", type=float, default=d.max_seconds, help="no new request after this")
    ap.add_argument("--dtype", default=d.dtype, choices=["float32", "float64"])
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra flag for serve (repeat)")
    ap.add_argument("--mix", default=None, metavar="KIND=W,...",
                    help=f"request kinds and weights, the rest keep theirs (default {DEFAULT_MIX})")
    ap.add_argument("--out", default=None, help="write the figures and every violation as JSON")
    ap.add_argument("--log-dir", default=None)
    a = ap.parse_args(argv)
    cfg = SoakConfig(requests=a.requests, concurrency=a.concurrency, drafter_kills=a.drafter_kills,
                     drafter_stalls=a.drafter_stalls, verifier_kills=a.verifier_kills,
                     verifier_stalls=a.verifier_stalls, stall_seconds=a.stall_seconds,
                     drafter_timeout=a.drafter_timeout, restart_wait=a.restart_wait, settle_seconds=a.settle_seconds,
                     max_seconds=a.max_seconds, dtype=a.dtype, seed=a.seed, serve_args=tuple(a.serve_arg),
                     progress=True, mix=_mix(a.mix))
    fig = run_soak(cfg, a.log_dir)
    print(summary(fig))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(fig, f, indent=1, default=str)
    return 0 if not fig["violations"] else 1


if __name__ == "__main__":
    sys.exit(main())
