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


def test_grpc_serve_on_the_cpu_with_explicit_no_gpu_flags():
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
    assert ("spectandem serve: verifier on cpu (float32, eager, 1 thread); drafter on cpu (float32, eager, 1 thread)"
            in out), out
    assert "spectandem verifier:" in out and "spectandem drafter:" in out, out
    assert "first request failed" not in out and "finish_reason=" in out, out
    assert rc == 0 and "spectandem stopped" in out, (rc, out)


def test_engine_threads_follow_the_flag_else_omp_num_threads_else_the_cores_by_backend():
    from router.serve import engine_threads

    cores = len(os.sched_getaffinity(0))
    for backend in ("local", "grpc", "ray"):
        assert engine_threads(2, "3", backend) == 2
        assert engine_threads(None, "3", backend) == 3
    # In-process engines leave a core to the router; engine processes of their own take turns.
    assert engine_threads(None, None, "local") == engine_threads(None, "", "local") == max(1, cores - 1)
    assert engine_threads(None, None, "grpc") == engine_threads(None, None, "ray") == cores
    for bad in ("0", "two"):
        with pytest.raises(ValueError, match="OMP_NUM_THREADS must be a positive integer"):
            engine_threads(None, bad)
