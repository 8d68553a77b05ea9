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

# The engine links carry target features inline wherever no feature channel does (the drafter's
# re-prefill of requests it does not hold, a catch-up backlog): 24 KiB a token for EAGLE-3 on an
# 8B target, so a re-prefill of 30 requests of 300 tokens is over 200 MiB. The router and its
# engines trust each other; the public API has limits of its own (router/server.py).
MAX_MESSAGE_BYTES = 1024 * 1024 * 1024
# A drafter prefill goes in calls of at most this many bytes each (router/links_grpc.py).
PREFILL_CALL_BYTES = 128 * 1024 * 1024
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

        def locked():
            with self._lock:
                return fn(*args)

        return await self._mapped(context, asyncio.to_thread(locked), fn)

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
