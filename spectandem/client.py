"""The Python SDK for a spectandem server: `Client` (blocking) and `AsyncClient` (asyncio).

    with Client("localhost:50051", timeout=30) as client:
        client.wait_for_ready(60)
        c = client.generate("The capital of France is", SamplingParams(max_tokens=16))
        for chunk in client.stream("Once upon a time"):
            print(chunk.text, end="", flush=True)

Both speak `spectandem.v1.Generation` (proto/spectandem/v1/generation.proto): `Generate` streams
chunks of newly committed tokens, the first with the prompt length, the last with the finish
reason and the request's speculation statistics.

Deadlines: `timeout` (seconds) bounds a whole call, retries and backoff included; a per-call
`timeout` overrides the client's. Retries: only UNAVAILABLE (not ready, draining, unreachable) is
retried, with exponential backoff and jitter, and a stream only until its first chunk has arrived:
a stream that fails after tokens were delivered is never re-sent, since the caller has already
seen those tokens. Errors: every failed call raises a `SpectandemError` subclass keyed on the gRPC
status code (`error_from_rpc` is the one place that maps them).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from spectandem.config import SamplingParams
from spectandem.errors import (  # noqa: F401 (re-exported: the SDK's public exceptions)
    AlreadyExists, Cancelled, DeadlineExceeded, InternalError, InvalidArgument, ResourceExhausted, SpectandemError,
    Unauthenticated, Unavailable, error_from_rpc)
from spectandem.client_wire import (  # noqa: F401 (Chunk, Completion, Prompt: the SDK's public types)
    RECONNECT_OPTIONS, Chunk, Completion, Prompt, _ChunkReader, _model_info_dict, build_request)
from spectandem.v1 import generation_pb2, generation_pb2_grpc

__all__ = [
    "AsyncClient", "Cancelled", "Chunk", "Client", "Completion", "DeadlineExceeded", "InternalError",
    "InvalidArgument", "ResourceExhausted", "SamplingParams", "SpectandemError", "Unauthenticated",
    "Unavailable", "error_from_rpc",
]

GENERATION_SERVICE = "spectandem.v1.Generation"  # the health-check name readiness is reported under
INITIAL_BACKOFF_S = 0.1
MAX_BACKOFF_S = 2.0
HEALTH_POLL_S = 0.1          # wait_for_ready: pause between health checks
HEALTH_CHECK_TIMEOUT_S = 1.0  # wait_for_ready: deadline of one health check


# ---------------------------------------------------------------------------------- retries

def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _retry_delay(err: grpc.RpcError, retries_done: int, max_retries: int, deadline: float | None) -> float | None:
    """Seconds to sleep before re-sending, or None to give up: only UNAVAILABLE is retried, at most
    `max_retries` times, with exponential backoff and jitter, and never past the call's deadline."""
    if err.code() != grpc.StatusCode.UNAVAILABLE or retries_done >= max_retries:
        return None
    delay = min(MAX_BACKOFF_S, INITIAL_BACKOFF_S * 2 ** retries_done) * random.uniform(0.5, 1.0)
    if deadline is not None and time.monotonic() + delay >= deadline:
        return None
    return delay


def _channel_credentials(tls: bool | grpc.ChannelCredentials | None) -> grpc.ChannelCredentials | None:
    if tls is None or tls is False:
        return None
    return grpc.ssl_channel_credentials() if tls is True else tls


class _Base:
    def __init__(self, address: str, timeout: float | None, max_retries: int,
                 tls: bool | grpc.ChannelCredentials | None, options: Sequence[tuple[str, Any]],
                 api_key: str | None = None):
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.address = address
        self.timeout = timeout
        self.max_retries = max_retries
        self._credentials = _channel_credentials(tls)
        given = {key for key, _ in options}   # the caller's options win over the SDK's reconnect pacing
        self._options = [o for o in RECONNECT_OPTIONS if o[0] not in given] + list(options)
        # Sent with every call but health checks (which servers leave open).
        self._metadata = (("authorization", f"Bearer {api_key}"),) if api_key else None

    def _call_deadline(self, timeout: float | None) -> float | None:
        return _deadline(self.timeout if timeout is None else timeout)

    def _not_ready(self, service: str, waited: float, last: str) -> DeadlineExceeded:
        return DeadlineExceeded(grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"{self.address} not SERVING {service!r} after {waited:.1f}s (last: {last})")


def _health_check_timeout(deadline: float | None) -> float:
    left = _remaining(deadline)
    return HEALTH_CHECK_TIMEOUT_S if left is None else min(HEALTH_CHECK_TIMEOUT_S, left)


def _not_ready_reason(err: grpc.RpcError) -> str:
    """A failed health check while waiting: the reason to keep waiting, or raise if it never will."""
    if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                      grpc.StatusCode.NOT_FOUND):  # down, hung, or service not registered yet
        return err.code().name
    raise error_from_rpc(err) from err


# ---------------------------------------------------------------------------------- clients

class Client(_Base):
    """Blocking client. `tls`: None/False for plaintext, True for TLS with the system roots, or
    `grpc.ChannelCredentials` (e.g. `grpc.ssl_channel_credentials(ca, key, cert)` for a private CA
    and mTLS). `api_key`: sent as `authorization: Bearer KEY` (servers run with --api-key).
    `options`: extra gRPC channel arguments."""

    def __init__(self, address: str = "localhost:50051", *, timeout: float | None = None, max_retries: int = 3,
                 tls: bool | grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, Any]] = (),
                 api_key: str | None = None):
        super().__init__(address, timeout, max_retries, tls, options, api_key)
        if self._credentials is None:
            self._channel = grpc.insecure_channel(address, options=self._options)
        else:
            self._channel = grpc.secure_channel(address, self._credentials, options=self._options)
        self._generation = generation_pb2_grpc.GenerationStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)

    def generate(self, prompt: Prompt, params: SamplingParams | None = None, *, timeout: float | None = None,
                 request_id: str | None = None) -> Completion:
        """Run one request to the end and return the whole completion."""
        return Completion.from_chunks(list(self.stream(prompt, params, timeout=timeout, request_id=request_id)))

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, timeout: float | None = None,
               request_id: str | None = None) -> Iterator[Chunk]:
        """Chunks as the server commits tokens. Leaving the loop early cancels the request."""
        request = build_request(prompt, params, request_id)  # bad input raises here, not mid-loop
        return self._stream(request, self._call_deadline(timeout))

    def _stream(self, request: generation_pb2.GenerateRequest, deadline: float | None) -> Iterator[Chunk]:
        retries = 0
        while True:
            reader = _ChunkReader()
            call = self._generation.Generate(request, timeout=_remaining(deadline), metadata=self._metadata)
            try:
                for response in call:
                    yield reader.chunk(response)
                return
            except grpc.RpcError as err:
                delay = None if reader.started else _retry_delay(err, retries, self.max_retries, deadline)
                if delay is None:
                    raise error_from_rpc(err) from err
            finally:
                call.cancel()  # a no-op after the end; frees the server when the caller stops early
            retries += 1
            time.sleep(delay)

    def model_info(self, *, timeout: float | None = None) -> dict:
        """The server's models, speculation method, tree parameters and limits (`ModelInfo` fields)."""
        deadline = self._call_deadline(timeout)
        retries = 0
        while True:
            try:
                info = self._generation.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                     timeout=_remaining(deadline), metadata=self._metadata)
                return _model_info_dict(info)
            except grpc.RpcError as err:
                delay = _retry_delay(err, retries, self.max_retries, deadline)
                if delay is None:
                    raise error_from_rpc(err) from err
            retries += 1
            time.sleep(delay)

    def wait_for_ready(self, timeout: float | None = None, *, service: str = GENERATION_SERVICE) -> None:
        """Poll grpc.health.v1 until `service` is SERVING; raise DeadlineExceeded after `timeout`
        seconds (the client's default when None; no limit when that is None too)."""
        start, deadline = time.monotonic(), self._call_deadline(timeout)
        request = health_pb2.HealthCheckRequest(service=service)
        while True:
            try:
                # wait_for_ready: the check goes out the moment the channel connects
                reply = self._health.Check(request, timeout=_health_check_timeout(deadline), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                last = _not_ready_reason(err)
            if deadline is not None and time.monotonic() + HEALTH_POLL_S >= deadline:
                raise self._not_ready(service, time.monotonic() - start, last)
            time.sleep(HEALTH_POLL_S)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncClient(_Base):
    """asyncio client; same arguments and methods as `Client`, awaited. The channel is opened on
    the first call, in that call's event loop, and the client stays bound to that loop."""

    def __init__(self, address: str = "localhost:50051", *, timeout: float | None = None, max_retries: int = 3,
                 tls: bool | grpc.ChannelCredentials | None = None, options: Sequence[tuple[str, Any]] = (),
                 api_key: str | None = None):
        super().__init__(address, timeout, max_retries, tls, options, api_key)
        self._channel: grpc.aio.Channel | None = None

    def _stubs(self) -> tuple[generation_pb2_grpc.GenerationStub, health_pb2_grpc.HealthStub]:
        # grpc.aio channels bind to the running loop, so one made in __init__ (often outside any
        # loop) would fail on first use
        if self._channel is None:
            if self._credentials is None:
                self._channel = grpc.aio.insecure_channel(self.address, options=self._options)
            else:
                self._channel = grpc.aio.secure_channel(self.address, self._credentials, options=self._options)
            self._generation = generation_pb2_grpc.GenerationStub(self._channel)
            self._health = health_pb2_grpc.HealthStub(self._channel)
        return self._generation, self._health

    async def generate(self, prompt: Prompt, params: SamplingParams | None = None, *,
                       timeout: float | None = None, request_id: str | None = None) -> Completion:
        """Run one request to the end and return the whole completion."""
        return Completion.from_chunks([c async for c in self.stream(prompt, params, timeout=timeout,
                                                                    request_id=request_id)])

    def stream(self, prompt: Prompt, params: SamplingParams | None = None, *, timeout: float | None = None,
               request_id: str | None = None) -> AsyncIterator[Chunk]:
        """Chunks as the server commits tokens (`async for`). To cancel the request promptly when
        leaving the loop early, wrap it in `contextlib.aclosing`."""
        request = build_request(prompt, params, request_id)
        return self._stream(request, self._call_deadline(timeout))

    async def _stream(self, request: generation_pb2.GenerateRequest, deadline: float | None
                      ) -> AsyncIterator[Chunk]:
        generation, _ = self._stubs()
        retries = 0
        while True:
            reader = _ChunkReader()
            call = generation.Generate(request, timeout=_remaining(deadline), metadata=self._metadata)
            try:
                async for response in call:
                    yield reader.chunk(response)
                return
            except grpc.RpcError as err:
                delay = None if reader.started else _retry_delay(err, retries, self.max_retries, deadline)
                if delay is None:
                    raise error_from_rpc(err) from err
            finally:
                call.cancel()
            retries += 1
            await asyncio.sleep(delay)

    async def model_info(self, *, timeout: float | None = None) -> dict:
        """The server's models, speculation method, tree parameters and limits (`ModelInfo` fields)."""
        generation, _ = self._stubs()
        deadline = self._call_deadline(timeout)
        retries = 0
        while True:
            try:
                info = await generation.GetModelInfo(generation_pb2.GetModelInfoRequest(),
                                                     timeout=_remaining(deadline), metadata=self._metadata)
                return _model_info_dict(info)
            except grpc.RpcError as err:
                delay = _retry_delay(err, retries, self.max_retries, deadline)
                if delay is None:
                    raise error_from_rpc(err) from err
            retries += 1
            await asyncio.sleep(delay)

    async def wait_for_ready(self, timeout: float | None = None, *, service: str = GENERATION_SERVICE) -> None:
        """Poll grpc.health.v1 until `service` is SERVING; raise DeadlineExceeded after `timeout`
        seconds (the client's default when None; no limit when that is None too)."""
        _, health = self._stubs()
        start, deadline = time.monotonic(), self._call_deadline(timeout)
        request = health_pb2.HealthCheckRequest(service=service)
        while True:
            try:
                reply = await health.Check(request, timeout=_health_check_timeout(deadline), wait_for_ready=True)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as err:
                last = _not_ready_reason(err)
            if deadline is not None and time.monotonic() + HEALTH_POLL_S >= deadline:
                raise self._not_ready(service, time.monotonic() - start, last)
            await asyncio.sleep(HEALTH_POLL_S)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
