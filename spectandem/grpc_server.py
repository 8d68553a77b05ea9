"""What the drafter and verifier gRPC services share: the one place engine exceptions become
status codes, the engine-call serialisation, and a gRPC server with health and reflection.

Status codes (the links in router/links_grpc.py map them back):
    StaleMessage (a tag of another epoch or round)  -> FAILED_PRECONDITION
    ValueError, KeyError (bad input, unknown id)    -> INVALID_ARGUMENT
    anything else (the engine failed)               -> INTERNAL
    the engine busy past the call's deadline        -> DEADLINE_EXCEEDED (nothing ran)
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from concurrent import futures
from contextlib import nullcontext
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from spectandem.after_reply import AfterReply
from spectandem.call_clock import CallClock
from spectandem.client_wire import RECONNECT_OPTIONS
from spectandem.messages import StaleMessage

log = logging.getLogger("spectandem.grpc")

# The engine links carry target features inline wherever no feature channel does (the drafter's
# re-prefill of requests it does not hold, a catch-up backlog): 24 KiB a token for EAGLE-3 on an
# 8B target, so a re-prefill of 30 requests of 300 tokens is over 200 MiB. The router and its
# engines trust each other; the public API has limits of its own (router/server.py).
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
# A drafter prefill goes in calls of at most this many bytes each (router/links_grpc.py).
PREFILL_CALL_BYTES = 128 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
# The router's channels to its engines: those limits, and trying again to connect within a second.
LINK_CHANNEL_OPTIONS = CHANNEL_OPTIONS + RECONNECT_OPTIONS


class EngineCalls:
    """Runs engine calls one at a time (engines are not thread-safe) on the server's handler
    threads; health checks and `peek` calls run on other handler threads meanwhile.

    A call waits for the one in flight at most until its own deadline, then ends with
    DEADLINE_EXCEEDED having run nothing: its caller has given up, and the thread it holds is
    one the server's other calls need. A call whose deadline passes while it runs still runs to
    the end, and the next call waits for it."""

    def __init__(self, role: str, thread=None, after: AfterReply | None = None):
        """`thread`: a one-worker executor that runs the calls instead of the handler threads
        (an engine on the CPU with several torch threads: spectandem/devices.py
        engine_process_thread). `after`: the work the calls leave for after their replies
        (spectandem/after_reply.py): each call waits for the last one's first."""
        self.role, self._thread, self.after = role, thread, after
        self._lock = threading.Lock()
        # Per kind of call (its body's name): the seconds from the engine taken to the reply
        # encoded, and how many (EngineInfo.calls).
        self.clock = CallClock()
        if after is not None and after.clock is None:
            after.clock = self.clock

    def run(self, context: grpc.ServicerContext, fn: Callable, *args):
        """fn(*args) decodes the request, calls the engine and encodes the reply, so a malformed
        request maps to INVALID_ARGUMENT like any other."""
        arrived = time.perf_counter()
        wait = context.time_remaining()   # no deadline: None, or beyond what a lock's timeout takes
        if wait is not None and wait <= 0:   # a handler thread that took it up late: its caller gave up already
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"{self.role}: this call's deadline passed before it reached the engine")
        blocking = wait is None or wait >= threading.TIMEOUT_MAX
        if not self._lock.acquire(timeout=-1 if blocking else wait):
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                          f"{self.role}: the engine call in flight did not end before this call's deadline")
        try:
            return self._engine_turn(getattr(fn, "__name__", "call").lstrip("_"), self._mapped, context, fn, *args,
                                     arrived=arrived)
        finally:
            self._lock.release()

    def run_internal(self, kind: str, fn: Callable, *args):
        """fn(*args) in the engine's turn, after the call in flight, for work the server starts
        itself rather than a caller (drafter/next_trees.py, on the verifier's verdicts); timed as
        `kind`; its errors are the caller's."""
        with self._lock:
            return self._engine_turn(kind, fn, *args)

    def _engine_turn(self, kind: str, fn: Callable, *args, arrived: float | None = None):
        """fn(*args) under the lock: after the last call's work after its reply, timed as `kind`,
        on the engine thread where there is one. `arrived` (a caller's call: when its handler
        thread took it up): the wait for the engine until then is timed as "<kind>.queue"."""
        with self.after.call() if self.after is not None else nullcontext():
            if arrived is not None:
                self.clock.add(f"{kind}.queue", time.perf_counter() - arrived)
            with self.clock.timing(kind):
                if self._thread is not None:
                    return self._thread.submit(fn, *args).result()
                return fn(*args)

    def peek(self, context: grpc.ServicerContext, fn: Callable, *args):
        """A cheap read of counters (info), without waiting for a forward in flight."""
        return self._mapped(context, fn, *args)

    def _mapped(self, context, fn, *args):
        # context.abort raises, ending the RPC with that status.
        try:
            return fn(*args)
        except StaleMessage as exc:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ValueError, KeyError) as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("%s: %s failed", self.role, getattr(fn, "__name__", fn))
            context.abort(grpc.StatusCode.INTERNAL, f"{self.role} failed: {type(exc).__name__}: {exc}")


class EngineServer:
    """A started gRPC server: one engine service, grpc.health.v1 (SERVING from start to stop,
    overall and for the service) and reflection.

    A synchronous server, its handlers on a pool of threads: a call reaches its engine in the
    thread that takes it off the wire. grpc.aio would add two hops to every call (to the event
    loop, then to a worker thread, since a forward must not block the loop), each a wake-up of
    another thread: 0.16-0.22 ms a call on a 2-core CPU, against 0.01 ms here
    (benchmarks/results/grpc-crossing-cpu-2core.txt)."""

    # Handler threads: each RPC in flight holds one, an engine call waiting for the one before
    # it included (until its deadline); health checks and info need one free beside them.
    HANDLER_THREADS = 16

    def __init__(self, server: grpc.Server, port: int, health_servicer, service_name: str):
        self.server, self.port, self.health, self.service_name = server, port, health_servicer, service_name

    @classmethod
    def start(cls, register: Callable[[grpc.Server], None], service_name: str, host: str,
              port: int, credentials: grpc.ServerCredentials | None = None) -> "EngineServer":
        """`register(server)` adds the engine servicer; port 0 picks a free port; `credentials`
        TLS or mTLS (spectandem/tls.py; None: plaintext). Returns once it listens."""
        # No SO_REUSEPORT: a second engine on a taken port must fail, not share its traffic.
        server = grpc.server(futures.ThreadPoolExecutor(cls.HANDLER_THREADS, thread_name_prefix=service_name),
                             options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)])
        register(server)
        health_servicer = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            address = f"{host}:{port}"
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
        server.start()
        for name in ("", service_name):
            health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return cls(server, bound, health_servicer, service_name)

    def stop(self, grace: float | None = 2.0) -> None:
        """Stops taking calls, lets those in flight run up to `grace` seconds, returns when done."""
        self.health.enter_graceful_shutdown()
        self.server.stop(grace).wait()

    def serve_until_signal(self) -> None:
        """Blocks until SIGTERM or SIGINT (from the main thread), then drains in-flight calls and stops."""
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.wait(1.0):   # a timed wait: the handler runs between the waits at the latest
            pass
        log.info("%s: shutting down", self.service_name)
        self.stop(grace=5.0)
