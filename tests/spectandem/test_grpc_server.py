"""spectandem/grpc_server.py: engine calls one at a time on the server's handler threads, a call
that waits past its deadline ends DEADLINE_EXCEEDED having run nothing, health and peeks answer
while an engine call runs, and exceptions map to status codes. A real server on a free port with
a scripted service (raw bytes in and out), no model."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spectandem.grpc_server import CHANNEL_OPTIONS, EngineCalls, EngineServer
from spectandem.messages import StaleMessage

SERVICE = "spectandem.test.Scripted"


class _Scripted:
    """`Call` runs the request's word through EngineCalls.run: "block" waits for `unblock`,
    "stale"/"bad"/"boom" raise; every word that ran is in `ran`, in order. `Peek` reads `ran`
    through EngineCalls.peek."""

    def __init__(self, thread=None):
        self.calls = EngineCalls("scripted", thread)
        self.ran: list[str] = []
        self.threads: set[str] = set()   # the threads the bodies ran on
        self.entered, self.unblock = threading.Event(), threading.Event()

    def _body(self, word: str) -> bytes:
        self.ran.append(word)
        self.threads.add(threading.current_thread().name)
        if word == "block":
            self.entered.set()
            assert self.unblock.wait(30)
        if word == "stale":
            raise StaleMessage("tag of epoch 1, engine at epoch 2")
        if word == "bad":
            raise ValueError("prompt is empty")
        if word == "boom":
            raise RuntimeError("kernel failed")
        return word.encode()

    def register(self, server: grpc.Server) -> None:
        def call(request: bytes, context):
            return self.calls.run(context, self._body, request.decode())

        def peek(request: bytes, context):
            return self.calls.peek(context, lambda: ",".join(self.ran).encode())

        handlers = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in (("Call", call), ("Peek", peek))}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


@pytest.fixture(params=["handler threads", "one engine thread"])
def scripted(request):
    """(the service, a sync channel to its server, the server): calls run on the server's handler
    threads, or on one thread of their own (an engine on the CPU with several torch threads)."""
    own = request.param == "one engine thread"
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine") if own else None
    service = _Scripted(thread)
    server = EngineServer.start(service.register, SERVICE, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
    try:
        yield service, channel, server
    finally:
        service.unblock.set()
        channel.close()
        server.stop(0)
        if thread is not None:
            thread.shutdown(wait=True)


def _call(channel, word: str, timeout: float | None = 10.0) -> bytes:
    return channel.unary_unary(f"/{SERVICE}/Call")(word.encode(), timeout=timeout)


def test_a_call_waiting_past_its_deadline_runs_nothing(scripted):
    service, channel, _ = scripted
    first = {}
    blocker = threading.Thread(target=lambda: first.setdefault("reply", _call(channel, "block", None)))
    blocker.start()
    assert service.entered.wait(10)
    with pytest.raises(grpc.RpcError) as err:
        _call(channel, "late", timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # While the engine call runs: health and peeks answer on other handler threads.
    health = health_pb2_grpc.HealthStub(channel)
    for name in ("", SERVICE):
        reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert channel.unary_unary(f"/{SERVICE}/Peek")(b"", timeout=5) == b"block"
    service.unblock.set()
    blocker.join(10)
    assert first["reply"] == b"block"
    assert _call(channel, "after") == b"after"
    assert service.ran == ["block", "after"]   # "late" never ran


def test_calls_run_one_at_a_time(scripted):
    service, channel, _ = scripted
    inside, most = [0], [0]
    lock = threading.Lock()
    body = service._body

    def counted(word):
        with lock:
            inside[0] += 1
            most[0] = max(most[0], inside[0])
        try:
            return body(word)
        finally:
            with lock:
                inside[0] -= 1

    service._body = counted
    threads = [threading.Thread(target=_call, args=(channel, f"w{i}")) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert sorted(service.ran) == sorted(f"w{i}" for i in range(8)) and most[0] == 1


@pytest.mark.parametrize("word, code, details", [
    ("stale", grpc.StatusCode.FAILED_PRECONDITION, "epoch 1"),
    ("bad", grpc.StatusCode.INVALID_ARGUMENT, "ValueError: prompt is empty"),
    ("boom", grpc.StatusCode.INTERNAL, "scripted failed: RuntimeError: kernel failed"),
])
def test_exceptions_map_to_status_codes(scripted, word, code, details):
    service, channel, _ = scripted
    with pytest.raises(grpc.RpcError) as err:
        _call(channel, word)
    assert err.value.code() == code and details in err.value.details()
    assert _call(channel, "next") == b"next"   # the lock was released


def test_a_taken_port_is_refused(scripted):
    _, _, server = scripted
    with pytest.raises(ValueError, match=f"cannot listen on 127.0.0.1:{server.port}"):
        EngineServer.start(lambda s: None, SERVICE, "127.0.0.1", server.port)


def test_calls_given_a_thread_all_run_on_it():
    """EngineCalls with a one-worker executor: calls arriving on several handler threads at once
    run one after another on that one thread (the engine's OpenMP team stays the only one)."""
    thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    service = _Scripted(thread)
    server = EngineServer.start(service.register, SERVICE, "127.0.0.1", 0)
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}", options=CHANNEL_OPTIONS)
    try:
        callers = [threading.Thread(target=_call, args=(channel, f"w{i}")) for i in range(8)]
        for t in callers:
            t.start()
        for t in callers:
            t.join(20)
        assert sorted(service.ran) == sorted(f"w{i}" for i in range(8))
        assert len(service.threads) == 1 and next(iter(service.threads)).startswith("engine")
    finally:
        channel.close()
        server.stop(0)
        thread.shutdown(wait=True)


def test_engine_process_thread_only_for_several_cpu_threads():
    """spectandem/devices.py engine_process_thread: on the CPU with several torch threads the
    process drops to one and its calls get a thread with the others; with one thread, or on
    CUDA, none. In a subprocess: it sets the process's torch threads."""
    import subprocess
    import sys

    code = """
import threading, torch
from spectandem.devices import engine_process_thread
torch.set_num_threads(1)
assert engine_process_thread("cpu") is None and torch.get_num_threads() == 1
torch.set_num_threads(2)
assert engine_process_thread("cuda:0") is None and torch.get_num_threads() == 2
ex = engine_process_thread("cpu")
assert ex is not None and torch.get_num_threads() == 1
name, n = ex.submit(lambda: (threading.current_thread().name, torch.get_num_threads())).result()
assert name.startswith("spectandem-engines") and n == 2, (name, n)
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
