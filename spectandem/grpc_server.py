"""What the drafter and verifier gRPC services share: the one place engine exceptions become
status codes, the engine-call serialisation, and a grpc.aio server with health and reflection.

Status codes (the links in router/links_grpc.py map them back):
    StaleMessage (a tag of another epoch or round)  -> FAILED_PRECONDITION
    ValueError, KeyError (bad input, unknown id)    -> INVALID_ARGUMENT
    anything else (the engine failed)               -> INTERNAL
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from spectandem.messages import StaleMessage

log = logging.getLogger("spectandem.grpc")
_STATS = {}
_N = 0

# Features of long prompts are large: a 2k-token EAGLE-3 prefill of an 8B model is 48 MiB.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024
CHANNEL_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                   ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]


class EngineCalls:
    """Runs engine calls one at a time (engines are not thread-safe) in a worker thread (the
    event loop keeps answering health checks while a forward runs).

    The lock is taken inside the worker thread: when a caller's deadline cancels the handler,
    its thread still runs the engine call to the end, and the next call must wait for it."""

    def __init__(self, role: str):
        self.role = role
        self._lock = threading.Lock()

    async def run(self, context: grpc.aio.ServicerContext, fn: Callable, *args):
        """fn(*args) decodes the request, calls the engine and encodes the reply, all in the
        worker thread, so a malformed request maps to INVALID_ARGUMENT like any other."""

        import time, os
        t_in = time.perf_counter()
        box = {}
        def locked():
            box['t1'] = time.perf_counter()
            with self._lock:
                box['t2'] = time.perf_counter()
                r = fn(*args)
                box['t3'] = time.perf_counter()
                return r

        out = await self._mapped(context, asyncio.to_thread(locked), fn)
        t_out = time.perf_counter()
        st = _STATS.setdefault(getattr(fn, '__name__', '?'), [0, 0.0, 0.0, 0.0, 0.0])
        st[0] += 1; st[1] += box['t1'] - t_in; st[2] += box['t3'] - box['t2']; st[3] += t_out - box['t3']; st[4] += t_out - t_in
        global _N
        _N += 1
        if _N % 100 == 0:
            with open(f"/tmp/exp/eng_{self.role}_{os.getpid()}.txt", "w") as f:
                for k, v in _STATS.items():
                    f.write(f"{k:30s} n={v[0]} to_thread={v[1]/v[0]*1e3:.3f} work={v[2]/v[0]*1e3:.3f} back={v[3]/v[0]*1e3:.3f} total={v[4]/v[0]*1e3:.3f} ms\n")
        return out

    async def peek(self, context: grpc.aio.ServicerContext, fn: Callable, *args):
        """A cheap read of counters (info): inline, without waiting for a forward in flight."""

        async def call():
            return fn(*args)

        return await self._mapped(context, call(), fn)

    async def _mapped(self, context, coro, fn):
        try:
            return await coro
        except StaleMessage as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
        except (ValueError, KeyError) as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(exc).__name__}: {exc}")
        except Exception as exc:
            log.exception("%s: %s failed", self.role, getattr(fn, "__name__", fn))
            await context.abort(grpc.StatusCode.INTERNAL, f"{self.role} failed: {type(exc).__name__}: {exc}")


class EngineServer:
    """A started grpc.aio server: one engine service, grpc.health.v1 (SERVING from start to
    stop, overall and for the service) and reflection."""

    def __init__(self, server: grpc.aio.Server, port: int, health_servicer, service_name: str):
        self.server, self.port, self.health, self.service_name = server, port, health_servicer, service_name

    @classmethod
    async def start(cls, register: Callable[[grpc.aio.Server], None], service_name: str, host: str,
                    port: int, credentials: grpc.ServerCredentials | None = None) -> "EngineServer":
        """`register(server)` adds the engine servicer; port 0 picks a free port; `credentials`
        TLS or mTLS (spectandem/tls.py; None: plaintext)."""
        # No SO_REUSEPORT: a second engine on a taken port must fail, not share its traffic.
        server = grpc.aio.server(options=CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)])
        register(server)
        health_servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        reflection.enable_server_reflection((service_name, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
        try:
            address = f"{host}:{port}"
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError as exc:
            raise ValueError(f"cannot listen on {host}:{port}: {exc}") from None
        await server.start()
        for name in ("", service_name):
            await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
        return cls(server, bound, health_servicer, service_name)

    async def stop(self, grace: float | None = 2.0) -> None:
        await self.health.enter_graceful_shutdown()
        await self.server.stop(grace)

    async def serve_until_signal(self) -> None:
        """Blocks until SIGTERM or SIGINT, then drains in-flight calls and stops."""
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        log.info("%s: shutting down", self.service_name)
        await self.stop(grace=5.0)
