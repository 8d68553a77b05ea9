"""Engines that serve starts, under faults, with real processes and signals.

- An engine that fails to start (a target whose weights file is broken: serve itself reads only
  its config and tokenizer) ends `spectandem serve` with a non-zero exit within seconds, printing
  the engine's own error: gRPC services and Ray actors.
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
import socket
import subprocess
import sys
import threading
import time

import grpc
import pytest

from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import Served, collect, request

MAX_LEN = "256"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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


@pytest.mark.parametrize("backend", ["grpc", "ray"])
def test_engine_that_fails_to_start_ends_serve_with_its_error(broken_target, backend):
    draft = str(demo_paths("eagle3")[1])
    rc, out, took = _run_serve(["--backend", backend, "--port", str(_free_port()), "--target", broken_target,
                                "--draft", draft, "--max-len", MAX_LEN], timeout_s=120)
    assert rc is not None, f"serve still running after {took:.0f} s:\n{out[-3000:]}"
    assert rc != 0, out[-3000:]
    assert "spectandem serve: error: the " in out, out[-3000:]
    report = out[out.index("spectandem serve: error: the "):]
    assert ("before it was ready; its last output" if backend == "grpc" else "actor failed to start") in report
    assert "cannot read safetensors" in report, report    # the engine's own error
    assert took < 90, took
