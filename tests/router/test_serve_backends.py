"""The served system with the engines in separate processes: gRPC services and Ray actors, with
serve's defaults (the feature and tree channels on). Exactness against the reference loop, and faults: the drafter killed mid-stream (every request
completes by fallback with the same greedy tokens), the verifier killed (UNAVAILABLE, none
hangs, NOT_SERVING), either Ray actor killed as serve's warm-up begins, and `spectandem serve`
started as a user would."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from router.serve import free_port
from spectandem.service_args import format_cores
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import RAY_CLUSTERS, Served, collect, request

MAX_LEN = "256"


@pytest.fixture(scope="module")
def reference():
    t, d = demo_paths("eagle3")
    return LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=16, max_len=int(MAX_LEN))


def _prompts(reference, n):
    return [reference.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(n)]


def _concurrent(stub, reqs, on_first_chunk=None, timeout=120):
    """Runs streams in threads; returns per request (tokens, finish_reason, stats) or the RpcError."""
    out: dict[int, object] = {}
    firsts = threading.Barrier(len(reqs) + 1) if on_first_chunk else None

    def worker(i):
        toks, reason, stats = [], None, None
        try:
            for n, chunk in enumerate(stub.Generate(reqs[i], timeout=timeout)):
                toks += list(chunk.token_ids)
                if n == 0 and firsts:
                    firsts.wait(60)
                if chunk.finish_reason:
                    reason, stats = chunk.finish_reason, chunk.stats
            out[i] = (toks, reason, stats)
        except grpc.RpcError as exc:
            out[i] = exc
            if firsts and not firsts.broken:
                firsts.abort()

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(reqs))]
    for t in threads:
        t.start()
    if firsts:
        try:
            firsts.wait(120)
        except threading.BrokenBarrierError:
            pass
        on_first_chunk()
    for t in threads:
        t.join(timeout + 30)
        assert not t.is_alive(), "a stream hung"
    return out


def test_grpc_backend_exact_and_drafter_killed(reference):
    # The drafter stays down (no restart: tests/router/test_serve_supervised.py covers those).
    server = Served(["--backend", "grpc", "--max-len", MAX_LEN, "--max-running", "16",
                     "--drafter-timeout", "3", "--engine-restarts", "0"]).wait_ready()
    try:
        prompts = _prompts(reference, 6)
        greedy = reference.generate(prompts, [SamplingParams(max_tokens=20)] * 6)
        sampled = reference.generate(prompts, [SamplingParams(max_tokens=20, temperature=0.9, seed=i) for i in range(6)])
        for i, p in enumerate(prompts):
            assert collect(server.stub, request(ids=p, max_tokens=20))[0] == greedy[i].token_ids
            assert collect(server.stub, request(ids=p, max_tokens=20, temperature=0.9, seed=i))[0] == sampled[i].token_ids
        # Serve's default: the rounds' trees went drafter -> verifier over the tree channel, those
        # the drafter drafted on the last verdicts early and without a draft call.
        assert server.state["router"].counters.posted_trees > 0
        assert server.state["router"].counters.early_tree_rounds > 0

        long = reference.generate(prompts, [SamplingParams(max_tokens=120, ignore_eos=True)] * 6)
        drafter = server.state["procs"]["drafter"]
        res = _concurrent(server.stub, [request(ids=p, max_tokens=120, ignore_eos=True) for p in prompts],
                          on_first_chunk=lambda: drafter.send_signal(signal.SIGKILL))
        for i in range(6):
            toks, reason, stats = res[i]
            assert toks == long[i].token_ids and reason == "length"
        assert sum(res[i][2].fallback_rounds for i in range(6)) > 0
        assert server.state["router"].drafter_up is False
    finally:
        server.close()


def test_grpc_backend_verifier_killed():
    # Its restart comes 30 s later, after the checks of the outage below.
    server = Served(["--backend", "grpc", "--max-len", MAX_LEN, "--max-running", "16",
                     "--engine-restart-backoff", "30"]).wait_ready()
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        verifier = server.state["procs"]["verifier"]
        reqs = [request(text=PROMPT_TEXTS[i], max_tokens=200, ignore_eos=True) for i in range(4)]
        res = _concurrent(server.stub, reqs, on_first_chunk=lambda: verifier.send_signal(signal.SIGKILL), timeout=60)
        for i in range(4):
            assert isinstance(res[i], grpc.RpcError) and res[i].code() == grpc.StatusCode.UNAVAILABLE, res[i]
        health = health_pb2_grpc.HealthStub(server.channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="spectandem.v1.Generation")).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(grpc.RpcError) as err:
            collect(server.stub, request(text="x", max_tokens=3), timeout=20)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()


@RAY_CLUSTERS
def test_ray_backend_exact_and_drafter_killed(reference):
    import ray

    # Sequential rounds: whether speculation resumes after the restart must not depend on what
    # "auto" measures on a busy CPU (it may rightly keep plain decoding there, and then no new
    # request is drafted within the wait below).
    server = Served(["--backend", "ray", "--max-len", MAX_LEN, "--max-running", "16",
                     "--drafter-timeout", "5", "--pipeline", "sequential"]).wait_ready(300)
    try:
        prompts = _prompts(reference, 4)
        greedy = reference.generate(prompts, [SamplingParams(max_tokens=20)] * 4)
        sampled = reference.generate(prompts, [SamplingParams(max_tokens=20, temperature=0.9, seed=i) for i in range(4)])
        for i, p in enumerate(prompts):
            assert collect(server.stub, request(ids=p, max_tokens=20))[0] == greedy[i].token_ids
            assert collect(server.stub, request(ids=p, max_tokens=20, temperature=0.9, seed=i))[0] == sampled[i].token_ids
        # Serve's default: the rounds' trees went drafter -> verifier over the tree channel.
        assert server.state["router"].counters.posted_trees > 0

        long = reference.generate(prompts, [SamplingParams(max_tokens=120, ignore_eos=True)] * 4)
        actor = server.state["drafter"].actor
        res = _concurrent(server.stub, [request(ids=p, max_tokens=120, ignore_eos=True) for p in prompts],
                          on_first_chunk=lambda: ray.kill(actor, no_restart=False))
        for i in range(4):
            toks, reason, stats = res[i]
            assert toks == long[i].token_ids and reason == "length"
        # The drafter actor restarts empty; speculation resumes for new requests.
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            toks, _, reason, stats = collect(server.stub, request(ids=prompts[0], max_tokens=40))
            if stats.accepted_tokens > 0:
                break
            time.sleep(1)
        assert stats.accepted_tokens > 0
    finally:
        server.close()


@RAY_CLUSTERS
@pytest.mark.parametrize("stop", ["sigterm", "ctrl-c", "group-sigterm"])
def test_spectandem_serve_as_a_user_would(tmp_path, stop):
    """`spectandem serve` (Ray backend, a local cluster), a request, then a stop: SIGTERM to the
    process; SIGINT to its whole process group, as a terminal's Ctrl-C; SIGTERM to the whole
    group, as `timeout` or systemd send it, which also ends the local Ray cluster's own processes
    under it. Each way it stops cleanly and soon (the last once waited 120 s on a Ray cluster
    that was already gone)."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    # The HTTP front and metrics on free ports too: their fixed defaults collide with any other
    # server on this machine (another test worker's, another run's).
    fronts = ["--http-port", str(free_port()), "--metrics-port", str(free_port())]
    proc = subprocess.Popen([sys.executable, "-m", "spectandem.cli", "serve", "--port", str(port), *fronts],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    try:
        from spectandem import Client

        with Client(f"localhost:{port}", timeout=60) as client:
            client.wait_for_ready(300)
        out = subprocess.run([sys.executable, "-m", "spectandem.cli", "generate", "def f(x):", "--address",
                              f"localhost:{port}", "--max-tokens", "12", "--json"],
                             capture_output=True, text=True, timeout=120, env=env)
        assert out.returncode == 0, out.stderr
        import json

        obj = json.loads(out.stdout)
        assert len(obj["token_ids"]) == 12 and obj["finish_reason"] == "length"
        assert obj["stats"]["num_rounds"] >= 1
        # --cpu-bind auto (serve's default) over Ray on the CPU: every thread of serve's own process
        # on the verifier's cores, off the drafter's (the last quarter, at least one core).
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) > 1:
            want = format_cores(cores[: len(cores) - max(1, len(cores) // 4)])
            assert _threads_cores(proc.pid) == {want}, (_threads_cores(proc.pid), want)
    finally:
        t0 = time.monotonic()
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT if stop == "ctrl-c" else signal.SIGTERM)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = None
        took = time.monotonic() - t0
        log = proc.stdout.read()
    assert f"on localhost:{port}" in log
    assert rc == 0, log
    assert "spectandem stopped" in log
    assert "did not stop within" not in log and took < 60, (took, log)


def _threads_cores(pid: int) -> set[str]:
    """The cores each thread of process `pid` may run on, as /proc has them ("0-2,5"), told apart."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                out.update(line.split()[1] for line in f if line.startswith("Cpus_allowed_list:"))
        except FileNotFoundError:   # a thread that ended meanwhile
            pass
    return out


@pytest.mark.parametrize("signalled", [True, False])
def test_an_engine_exit_seen_before_the_signal(signalled, monkeypatch, capsys):
    """Ctrl-C reaches the engine processes of serve's group too: one may exit, and serve see that
    (an engine that failed to start) before it takes the signal itself. serve then still cleans up
    to the end, says it stopped and ends as asked, without an error. The same exit without a
    signal stays the error it is. (The engines here are stand-ins: what is under test is serve's
    start and stop around them; test_stopped_while_it_starts runs the real processes.)"""
    import asyncio

    import router.serve as serve
    from router.links import EngineStartError
    from spectandem.cli import build_parser

    cleaned, handlers = [], []

    class Link:
        address = "127.0.0.1:1"

    async def build(args, cfg, target, draft, supervisor, say):
        async def cleanup():
            await asyncio.sleep(0.05)   # the loop turns here: a signal taken now must not cut it short
            cleaned.append(True)
        return [(Link(), None)], cleanup, {"verifier": object()}

    install = serve._StopSignals.install

    def installing(self):
        handlers.append(self)
        install(self)

    async def exited(link, what, timeout=300.0, process=None):
        if signalled:   # the signal, taken by the loop once this step has raised
            asyncio.get_running_loop().call_soon(handlers[-1]._on_signal)
        raise EngineStartError("the verifier process exited with code -2 before it served")

    monkeypatch.setattr(serve, "_build_replicas", build)
    monkeypatch.setattr(serve, "_wait_ready", exited)
    monkeypatch.setattr(serve._StopSignals, "install", installing)
    args = build_parser().parse_args(["serve", "--backend", "grpc", "--host", "127.0.0.1", "--port", "0",
                                      "--http-port", "0", "--metrics-port", "0"])
    if signalled:
        asyncio.run(serve.serve_async(args))
    else:
        with pytest.raises(EngineStartError, match="exited with code -2"):
            asyncio.run(serve.serve_async(args))
    assert cleaned == [True]
    assert capsys.readouterr().out.rstrip().endswith("spectandem stopped")


@pytest.mark.parametrize("backend,stop", [pytest.param("ray", "sigterm", marks=RAY_CLUSTERS),
                                          pytest.param("ray", "ctrl-c", marks=RAY_CLUSTERS),
                                          ("grpc", "ctrl-c"), ("grpc", "sigterm")])
def test_stopped_while_it_starts(backend, stop):
    """`spectandem serve` told to stop while it starts (a SIGTERM to the process, or Ctrl-C to its
    process group), once its log says the engines are loading: it does not come up, says it
    stopped, exits 0, soon, and leaves no process of its group behind (gRPC: the engine
    processes it started; Ray: its local cluster). A SIGTERM there once ended the Ray server with
    a stack dump from Ray's own handler, and a Ctrl-C was lost: the server came up and stayed."""
    marker = "starting the engine actors" if backend == "ray" else "waiting for the engine processes to load"
    fronts = ["--http-port", str(free_port()), "--metrics-port", str(free_port())]
    proc = subprocess.Popen([sys.executable, "-m", "spectandem.cli", "serve", "--backend", backend,
                             "--port", str(free_port()), *fronts],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1"), start_new_session=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if marker in line:
                break
        assert any(marker in line for line in lines), "".join(lines)
        t0 = time.monotonic()
        if stop == "sigterm":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        try:
            rc = proc.wait(90)
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - t0
        log = "".join(lines) + proc.stdout.read() if rc is not None else "".join(lines)
        assert rc == 0, (rc, log)
        assert "spectandem serving" not in log and "spectandem stopped" in log, log
        assert took < 60, (took, log)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.5)
        else:
            left = subprocess.run(["ps", "-o", "pid,args", "-g", str(proc.pid)], capture_output=True, text=True)
            pytest.fail(f"processes of serve's group still run 30 s after it exited:\n{left.stdout}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


@RAY_CLUSTERS
def test_ray_backend_64_streams_cancel_and_deadline(reference):
    server = Served(["--backend", "ray", "--max-len", MAX_LEN, "--max-running", "64"]).wait_ready(300)
    try:
        prompts = [reference.tokenizer.encode(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]).ids for i in range(64)]
        expected = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=64,
                                   max_len=int(MAX_LEN)).generate(prompts, [SamplingParams(max_tokens=12)] * 64)
        res = _concurrent(server.stub, [request(ids=p, max_tokens=12) for p in prompts], timeout=300)
        assert [res[i][0] for i in range(64)] == [e.token_ids for e in expected]

        call = server.stub.Generate(request(text=PROMPT_TEXTS[0], max_tokens=200, ignore_eos=True))
        assert next(call).token_ids
        call.cancel()
        with pytest.raises(grpc.RpcError) as err:
            collect(server.stub, request(text=PROMPT_TEXTS[1], max_tokens=220, ignore_eos=True), timeout=0.5)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        deadline = time.monotonic() + 30
        while server.slots_in_use() != (0, 0) or server.state["router"].num_active:
            assert time.monotonic() < deadline, server.slots_in_use()
            time.sleep(0.1)
    finally:
        server.close()


def _kill_at_warm_up(monkeypatch, role: str):
    """Serve's warm-up starts by killing the `role` actor's process (Ray restarts it): a real
    SIGKILL-like death (ray.kill) while the first warm-up requests go out."""
    import ray

    from router.loop import Router

    warm_up = Router.warm_up

    async def killing(self, *args, **kwargs):
        ray.kill(getattr(self, role).actor, no_restart=False)
        return await warm_up(self, *args, **kwargs)

    monkeypatch.setattr(Router, "warm_up", killing)


@RAY_CLUSTERS
def test_ray_drafter_killed_during_warm_up_serve_still_comes_up(reference, monkeypatch):
    """The drafter actor dies as warm-up begins: the warm-up's requests decode without it, the
    restarted actor is picked up, and the server comes up and serves the reference's tokens."""
    _kill_at_warm_up(monkeypatch, "drafter")
    server = Served(["--backend", "ray", "--max-len", MAX_LEN, "--max-running", "4", "--warm-up",
                     "--drafter-timeout", "5", "--pipeline", "sequential"]).wait_ready(300)
    try:
        prompts = _prompts(reference, 2)
        greedy = reference.generate(prompts, [SamplingParams(max_tokens=20)] * 2)
        for i, p in enumerate(prompts):
            assert collect(server.stub, request(ids=p, max_tokens=20))[0] == greedy[i].token_ids
    finally:
        server.close()


@RAY_CLUSTERS
def test_ray_verifier_killed_during_warm_up_serve_says_why(monkeypatch):
    """The verifier actor dies as warm-up begins: serve ends at once with an error that says the
    warm-up's requests failed and why, rather than hanging or failing on something else."""
    _kill_at_warm_up(monkeypatch, "verifier")
    server = Served(["--backend", "ray", "--max-len", MAX_LEN, "--max-running", "4", "--warm-up",
                     "--pipeline", "sequential"])
    with pytest.raises(RuntimeError, match=r"a warm-up request did not finish \(failed: UNAVAILABLE: "):
        server.wait_ready(300)
    server.thread.join(120)
    assert not server.thread.is_alive()
