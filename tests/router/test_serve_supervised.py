"""Engines that serve starts, under faults, with real processes and signals.

- An engine that fails to start (a target whose weights file is broken: serve itself reads only
  its config and tokenizer) ends `spectandem serve` with a non-zero exit within seconds, printing
  the engine's own error: gRPC services and Ray actors. An engine that refuses its flags (a KV
  pool too small for one request) does so in one line, not a traceback, on every backend.
- --backend grpc: a SIGKILLed drafter process is restarted on its port and speculation resumes;
  a SIGKILLed verifier fails its requests with UNAVAILABLE, is restarted, and the server serves
  again; every engine process, restarted ones included, is gone after shutdown. A verifier that
  stays down (restart budget spent) ends serve with exit code 1.
- --backend ray: the drafter's and then the verifier's worker process SIGKILLed: Ray restarts the
  actors, speculation resumes, the verifier's requests end UNAVAILABLE and the server serves again.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest

from spectandem.demo import demo_paths
from router.serve import free_port
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import RAY_CLUSTERS, Served, collect, request


MAX_LEN = "256"


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "X"
    except FileNotFoundError:
        return True


def _run_serve(argv: list[str], timeout_s: float, until=None) -> tuple[int | None, str, float]:
    """`spectandem serve ARGV` in a process group of its own; `until(proc)` runs once it has started.
    -> (exit code or None if it ran past timeout_s, its output, seconds it ran)."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "spectandem.cli", "serve", "--http-port", "0", "--metrics-port", "0",
                             *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.extend(proc.stdout), daemon=True)
    reader.start()
    t0 = time.monotonic()
    try:
        if until is not None:
            until(proc)
        rc = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        took = time.monotonic() - t0
        try:
            os.killpg(proc.pid, signal.SIGKILL)   # the group: serve and whatever it started
        except ProcessLookupError:
            pass
        proc.wait(30)
        reader.join(30)
    return rc, "".join(out), took


@pytest.fixture
def broken_target(tmp_path):
    target = tmp_path / "target"
    shutil.copytree(demo_paths("eagle3")[0], target)
    (target / "model.safetensors").write_bytes(b"\xff" * 64)   # config and tokenizer intact
    return str(target)


@pytest.mark.parametrize("backend", ["grpc", pytest.param("ray", marks=RAY_CLUSTERS)])
def test_engine_that_fails_to_start_ends_serve_with_its_error(broken_target, backend):
    draft = str(demo_paths("eagle3")[1])
    rc, out, took = _run_serve(["--backend", backend, "--port", str(free_port()), "--target", broken_target,
                                "--draft", draft, "--max-len", MAX_LEN], timeout_s=120)
    assert rc is not None, f"serve still running after {took:.0f} s:\n{out[-3000:]}"
    assert rc != 0, out[-3000:]
    assert "spectandem serve: error: the " in out, out[-3000:]
    report = out[out.index("spectandem serve: error: the "):]
    assert ("before it was ready; its last output" if backend == "grpc" else "actor failed to start") in report
    assert "cannot read safetensors" in report, report    # the engine's own error
    assert took < 90, took


@pytest.mark.parametrize("backend", ["local", "grpc", pytest.param("ray", marks=RAY_CLUSTERS)])
def test_a_kv_pool_that_cannot_hold_one_request_is_one_line_on_every_backend(backend):
    """The verifier refuses a --cpu-kv-cache-gib too small for one request at --max-len: serve
    ends with that one line, not a traceback, whichever process the engine runs in."""
    rc, out, took = _run_serve(["--backend", backend, "--port", str(free_port()), "--max-len", "2048",
                                "--cpu-kv-cache-gib", "0.01"], timeout_s=120)
    assert rc is not None and rc != 0, out[-3000:]
    lines = [line for line in out.splitlines() if "error: " in line and "--cpu-kv-cache-gib 0.01 holds" in line]
    assert lines, out[-3000:]
    assert "lower --max-len or raise --cpu-kv-cache-gib" in lines[-1]
    assert "Traceback" not in out and 'File "' not in out, out[-3000:]


def _health(channel) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    try:
        return health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service="spectandem.v1.Generation"), timeout=10).status
    except grpc.RpcError:
        return -1


def _wait_serving(server, timeout_s: float) -> None:
    from grpc_health.v1 import health_pb2

    deadline = time.monotonic() + timeout_s
    while _health(server.channel) != health_pb2.HealthCheckResponse.SERVING:
        assert time.monotonic() < deadline, f"not SERVING again within {timeout_s} s"
        time.sleep(0.5)


def _drafted_again(server, prompt: str, timeout_s: float):
    """A new request's stats once one was drafted (draft_tokens > 0), within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = collect(server.stub, request(text=prompt, max_tokens=40, ignore_eos=True))[3]
        if stats.draft_tokens > 0 or time.monotonic() > deadline:
            return stats
        time.sleep(1)


def _verifier_killed_mid_stream(server, kill) -> None:
    from tests.router.test_serve_backends import _concurrent

    reqs = [request(text=PROMPT_TEXTS[i], max_tokens=200, ignore_eos=True) for i in range(3)]
    res = _concurrent(server.stub, reqs, on_first_chunk=kill, timeout=60)
    for i in range(3):
        assert isinstance(res[i], grpc.RpcError) and res[i].code() == grpc.StatusCode.UNAVAILABLE, res[i]


def test_grpc_engines_are_restarted_and_serving_resumes():
    from tests.router.test_serve_backends import _concurrent

    server = Served(["--backend", "grpc", "--max-len", MAX_LEN, "--max-running", "16", "--drafter-timeout", "3",
                     "--pipeline", "sequential", "--engine-restart-backoff", "0.5"]).wait_ready()
    pids = []
    try:
        expected = collect(server.stub, request(text=PROMPT_TEXTS[0], max_tokens=20))[0]
        drafter, verifier = server.state["procs"]["drafter"], server.state["procs"]["verifier"]
        old = drafter.pid
        pids.append(old)
        res = _concurrent(server.stub, [request(text=PROMPT_TEXTS[i], max_tokens=80, ignore_eos=True) for i in range(3)],
                          on_first_chunk=lambda: drafter.send_signal(signal.SIGKILL))
        assert all(res[i][1] == "length" for i in range(3)), res
        deadline = time.monotonic() + 60
        while drafter.pid == old:
            assert time.monotonic() < deadline, "the drafter was not restarted"
            time.sleep(0.2)
        pids.append(drafter.pid)
        assert _gone(old)    # reaped, no zombie
        stats = _drafted_again(server, PROMPT_TEXTS[1], 90)
        assert stats.draft_tokens > 0 and stats.accepted_tokens > 0, stats   # speculation resumed

        old_v = verifier.pid
        pids.append(old_v)
        _verifier_killed_mid_stream(server, lambda: verifier.send_signal(signal.SIGKILL))
        _wait_serving(server, 90)
        assert verifier.pid != old_v and _gone(old_v)
        pids.append(verifier.pid)
        assert collect(server.stub, request(text=PROMPT_TEXTS[0], max_tokens=20))[0] == expected
    finally:
        server.close()
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]   # restarted ones too


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_grpc_verifier_that_stays_down_ends_serve_non_zero():
    port = free_port()

    def kill_verifier(proc):
        from spectandem import Client

        with Client(f"localhost:{port}", timeout=30) as client:
            client.wait_for_ready(120)
        for child in _children(proc.pid):
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"-m\0verifier\0" in f.read():
                    os.kill(child, signal.SIGKILL)
                    return
        raise AssertionError("no verifier process under serve")

    rc, out, took = _run_serve(["--backend", "grpc", "--port", str(port), "--max-len", MAX_LEN,
                                "--engine-restarts", "0"], timeout_s=60, until=kill_verifier)
    assert rc == 1, (rc, out[-3000:])
    assert "exited with signal SIGKILL" in out and "stays down" in out, out[-3000:]
    assert "spectandem serve: error: the verifier stayed down" in out, out[-3000:]


@RAY_CLUSTERS
def test_ray_engines_restart_after_sigkill():
    server = Served(["--backend", "ray", "--max-len", MAX_LEN, "--max-running", "16", "--drafter-timeout", "5",
                     "--pipeline", "sequential"]).wait_ready(300)
    try:
        expected = collect(server.stub, request(text=PROMPT_TEXTS[0], max_tokens=20))[0]
        old_d = server.run(server.state["drafter"].info()).extra["pid"]
        os.kill(old_d, signal.SIGKILL)
        stats = _drafted_again(server, PROMPT_TEXTS[1], 120)
        assert stats.draft_tokens > 0 and stats.accepted_tokens > 0, stats   # speculation resumed
        assert server.run(server.state["drafter"].info()).extra["pid"] != old_d

        old_v = server.run(server.state["verifier"].info()).extra["pid"]
        _verifier_killed_mid_stream(server, lambda: os.kill(old_v, signal.SIGKILL))
        _wait_serving(server, 120)
        info = server.run(server.state["verifier"].info())
        assert info.extra["pid"] != old_v and info.extra["restarted"] is True
        assert collect(server.stub, request(text=PROMPT_TEXTS[0], max_tokens=20))[0] == expected
        stats = _drafted_again(server, PROMPT_TEXTS[2], 60)
        assert stats.draft_tokens > 0, stats   # the restarted verifier returns the drafter's features
    finally:
        server.close()


def test_engine_ports_are_picked_below_the_range_of_outgoing_connections(monkeypatch):
    """serve's ports for the engine processes (router/serve.py free_port) are free and lie below
    the OS's range for outgoing connections, so no connection takes one before its engine
    listens; where none of those is free it falls back to a port the OS picks."""
    import socket

    import router.serve

    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        outgoing_low = int(f.read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(router.serve.PICKED_PORTS[0] <= p < min(outgoing_low, router.serve.PICKED_PORTS[1]) for p in ports)
    for p in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))   # free
    with socket.socket() as held:
        taken = free_port()
        held.bind(("127.0.0.1", taken))
        monkeypatch.setattr(router.serve, "PICKED_PORTS", (taken, taken + 1))   # the only candidate is in use
        fallback = free_port()
        assert fallback != taken and fallback >= outgoing_low
