"""Nothing lost, nothing stuck: `spectandem serve --backend grpc` in front of a verifier and a
drafter deployed on their own (real `python -m verifier` / `python -m drafter` processes, which
this module starts, signals and restarts itself).

- A verifier killed under load and started again on its port: the in-flight requests end
  UNAVAILABLE, health goes NOT_SERVING, and the router picks the verifier up again by itself
  while idle (SERVING, requests exact); neither engine keeps any state of the failed requests.
- A verifier stopped (SIGSTOP) under load until its calls time out, then continued: the same,
  and the verifier releases what it still held for the failed requests.
- A drafter stopped under load: rounds go on without it after one drafter timeout (every
  request completes, exact, while it is still stopped); once continued it releases what it held
  for requests that ended meanwhile, and speculation resumes; the outage is counted and logged
  once, its rounds counted as fallback rounds, not as plain rounds.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.v1 import generation_pb2
from router.links import GRPC_CALL_TIMEOUT_S
from router.serve import free_port
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import Served, collect, request

MAX_LEN = 256
SLOTS = 16
CALL_TIMEOUT_S = 8.0   # serve's --engine-call-timeout here: well under the gRPC default it must replace
pytestmark = pytest.mark.slow



class Engine:
    """One engine service in a process group of its own, restartable on the same port."""

    def __init__(self, role: str, extra: list[str] = ()):
        self.role, self.port = role, free_port()
        self.argv = [sys.executable, "-m", role, "--host", "127.0.0.1", "--port", str(self.port), "--method", "eagle3",
                     "--max-slots", str(SLOTS), "--max-len", str(MAX_LEN), *extra]
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def address(self) -> str:
        return f"localhost:{self.port}"

    def start(self) -> None:
        env = dict(os.environ, OMP_NUM_THREADS="1")
        self.proc = subprocess.Popen(self.argv, env=env, start_new_session=True,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def signal(self, sig: int) -> None:
        os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            for sig in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.killpg(self.proc.pid, sig)
                except ProcessLookupError:
                    pass
            self.proc.wait(30)


@pytest.fixture(scope="module")
def reference():
    t, d = demo_paths("eagle3")
    return LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=SLOTS, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def deployed():
    """A verifier and a drafter of their own, and serve in front of them (sequential rounds, one
    token per plain round, so that every round asks the drafter; no admission beside the draft,
    whose new requests' first round is a plain one)."""
    engines = [Engine("verifier"), Engine("drafter")]
    server = None
    try:
        server = Served(["--backend", "grpc", "--verifier-address", engines[0].address, "--drafter-address",
                         engines[1].address, "--max-len", str(MAX_LEN), "--max-running", str(SLOTS),
                         "--drafter-timeout", "2", "--engine-call-timeout", str(CALL_TIMEOUT_S),
                         "--pipeline", "sequential", "--plain-steps", "1",
                         "--no-overlap-admission"]).wait_ready(240)
        yield server, engines[0], engines[1]
    finally:
        if server is not None:
            server.close()
        for e in engines:
            e.kill()


def _prompts(reference, n: int) -> list[list[int]]:
    return [reference.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(n)]


def _health(server) -> int:
    stub = health_pb2_grpc.HealthStub(server.channel)
    return stub.Check(health_pb2.HealthCheckRequest(service="spectandem.v1.Generation"), timeout=10).status


def _wait(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {seconds:.0f} s"
        time.sleep(0.2)


def _in_use(server, sides=("verifier", "drafter")) -> tuple[tuple[int, int], ...]:
    """Per side, (slots, blocks) the engine reports in use."""
    async def q():
        infos = [await server.state[side].info() for side in sides]
        return tuple((i.used_slots, i.kv.get("used_blocks", 0)) for i in infos)
    return server.run(q())


def _streams(server, reqs, timeout: float, on_first_chunk=None) -> list:
    """Runs the requests as concurrent streams; per request (tokens, finish reason, stats) or the
    RpcError. `on_first_chunk` runs once every stream has its first chunk (or failed)."""
    out: list = [None] * len(reqs)
    firsts = threading.Barrier(len(reqs) + 1)

    def worker(i):
        toks, reason, stats, seen = [], None, None, False
        try:
            for chunk in server.stub.Generate(reqs[i], timeout=timeout):
                toks += list(chunk.token_ids)
                if not seen:
                    seen = True
                    firsts.wait(60)
                if chunk.finish_reason:
                    reason, stats = chunk.finish_reason, chunk.stats
            out[i] = (toks, reason, stats)
        except grpc.RpcError as exc:
            out[i] = exc
        finally:
            if not seen:
                firsts.abort()

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(len(reqs))]
    for t in threads:
        t.start()
    try:
        firsts.wait(120)
    except threading.BrokenBarrierError:
        pass
    if on_first_chunk is not None:
        on_first_chunk()
    for t in threads:
        t.join(timeout + 30)
        assert not t.is_alive(), "a stream hung"
    return out


def _exact_after_recovery(server, reference, prompts) -> None:
    want = reference.generate(prompts, [SamplingParams(max_tokens=24)] * len(prompts))
    for p, w in zip(prompts, want):
        assert collect(server.stub, request(ids=p, max_tokens=24), timeout=120)[0] == w.token_ids


def test_verifier_killed_and_started_again_is_picked_up(deployed, reference):
    server, verifier, _ = deployed
    prompts = _prompts(reference, 6)
    res = _streams(server, [request(ids=p, max_tokens=200, ignore_eos=True) for p in prompts], timeout=90,
                   on_first_chunk=lambda: verifier.signal(signal.SIGKILL))
    for r in res:
        assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, r
        assert "localhost" not in r.details() and "127.0.0.1" not in r.details(), r.details()
    verifier.proc.wait(30)
    _wait(lambda: _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING, 30, "NOT_SERVING")
    with pytest.raises(grpc.RpcError) as err:
        collect(server.stub, request(ids=prompts[0], max_tokens=3), timeout=20)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    verifier.start()   # the same port: the router's link reconnects; nothing is sent to the idle router
    _wait(lambda: _health(server) == health_pb2.HealthCheckResponse.SERVING, 120, "SERVING again")
    _exact_after_recovery(server, reference, prompts[:3])
    _wait(lambda: _in_use(server) == ((0, 0), (0, 0)), 30, "both engines back to no slots and no blocks")


def test_verifier_stopped_then_continued_releases_what_it_held(deployed, reference):
    server, verifier, _ = deployed
    _wait(lambda: _health(server) == health_pb2.HealthCheckResponse.SERVING, 120, "SERVING")
    prompts = _prompts(reference, 6)
    # A stopped verifier answers nothing: its calls fail at their deadline (--engine-call-timeout),
    # then its requests end UNAVAILABLE; it still holds their state when it continues.
    stopped = []

    def stop():
        verifier.signal(signal.SIGSTOP)
        stopped.append(time.monotonic())

    res = _streams(server, [request(ids=p, max_tokens=200, ignore_eos=True) for p in prompts], timeout=120,
                   on_first_chunk=stop)
    failed_after = time.monotonic() - stopped[0]
    try:
        # The flag's deadline failed them, not gRPC's default (which would take about 30 s); no
        # tighter bound: how long the call in flight had run when the verifier stopped varies.
        assert failed_after < GRPC_CALL_TIMEOUT_S / 2, failed_after
        for r in res:
            assert isinstance(r, grpc.RpcError) and r.code() == grpc.StatusCode.UNAVAILABLE, r
        assert _health(server) == health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        verifier.signal(signal.SIGCONT)
    _wait(lambda: _health(server) == health_pb2.HealthCheckResponse.SERVING, 60, "SERVING again")
    _wait(lambda: _in_use(server) == ((0, 0), (0, 0)), 30, "both engines back to no slots and no blocks")
    _exact_after_recovery(server, reference, prompts[:3])


def test_drafter_stall_costs_one_timeout_and_leaks_nothing(deployed, reference, caplog):
    server, _, drafter = deployed
    _wait(lambda: _health(server) == health_pb2.HealthCheckResponse.SERVING, 120, "SERVING")
    router = server.state["router"]
    _wait(lambda: router.drafter_up, 60, "the drafter up")
    before = server.run(_counters(router))
    prompts = _prompts(reference, 6)
    n_tokens = 96
    want = reference.generate(prompts, [SamplingParams(max_tokens=n_tokens, ignore_eos=True)] * len(prompts))
    stalled = threading.Event()

    def stall():
        drafter.signal(signal.SIGSTOP)
        stalled.set()

    caplog.set_level(logging.WARNING, logger="spectandem.router")
    try:
        # One token per round and each round asking a stopped drafter: a router that waited on
        # the drafter in every round (or in every probe) would need minutes for these tokens.
        res = _streams(server, [request(ids=p, max_tokens=n_tokens, ignore_eos=True) for p in prompts], timeout=50,
                       on_first_chunk=stall)
        assert stalled.is_set() and drafter.proc.poll() is None
        for r, w in zip(res, want):
            assert not isinstance(r, grpc.RpcError), r
            assert r[0] == w.token_ids and r[1] == "length"
        # Finished while the drafter was stopped: the verifier frees them (in the router's next
        # turn, after the last chunk went out); the drafter still holds them.
        _wait(lambda: _in_use(server, ["verifier"]) == ((0, 0),), 30, "the verifier back to no slots and no blocks")
    finally:
        drafter.signal(signal.SIGCONT)
    _wait(lambda: router.drafter_up, 60, "the drafter up again")
    _wait(lambda: _in_use(server) == ((0, 0), (0, 0)), 30, "both engines back to no slots and no blocks")
    after = server.run(_counters(router))
    assert after["drafter_outages"] - before["drafter_outages"] == 1
    assert after["fallback_rounds"] > before["fallback_rounds"]
    assert after["plain_rounds"] == before["plain_rounds"]   # nothing chose plain decoding
    outage_logs = [r for r in caplog.records if "drafter is unavailable" in r.getMessage()]
    assert len(outage_logs) == 1, [r.getMessage() for r in outage_logs]
    # Speculation resumes.
    _, _, reason, stats = collect(server.stub, request(ids=prompts[0], max_tokens=40, ignore_eos=True))
    assert reason == "length" and stats.draft_tokens > 0 and stats.fallback_rounds == 0


async def _counters(router):
    from dataclasses import asdict

    return asdict(router.counters)


def test_public_stats_split_fallback_from_plain_rounds(deployed):
    server, _, _ = deployed
    stats = server.stub.GetServerStats(generation_pb2.GetServerStatsRequest(), timeout=10)
    mine = server.run(_counters(server.state["router"]))
    for name in ("fallback_rounds", "plain_rounds", "drafter_outages"):
        assert getattr(stats, name) == mine[name], name
