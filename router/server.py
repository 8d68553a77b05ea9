"""The public gRPC server: `spectandem.v1.Generation`, grpc.health.v1 and reflection.

The servicer is thin: it validates a request (every error names the field and the limit),
hands it to the Router, and streams the Router's events. One function maps exceptions to status
codes. When the client cancels, disconnects or passes its deadline, grpc.aio cancels the handler
and the `finally` below tells the Router to stop all work for the request.
"""

from __future__ import annotations

import asyncio
import logging
import math
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.links import DuplicateRequest, EngineUnavailable
from router.scheduler import Chunk, Failure, Router
from spectandem.config import SamplingParams
from spectandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

log = logging.getLogger("spectandem.router")

SERVICE_NAME = "spectandem.v1.Generation"


@dataclass(frozen=True, kw_only=True)
class Limits:
    """What one request may ask for (advertised by GetModelInfo)."""

    max_context: int
    vocab_size: int
    max_stop_strings: int = 16
    max_stop_string_chars: int = 256
    max_request_id_chars: int = 128
    max_message_bytes: int = 4 * 1024 * 1024


class InvalidRequest(ValueError):
    """A request field is out of its limits; the message names the field and the limit."""


def _sampling_params(p: common_pb2.SamplingParams, prompt_len: int, limits: Limits) -> SamplingParams:
    if p.max_tokens < 1:
        raise InvalidRequest(f"params.max_tokens must be >= 1, got {p.max_tokens}")
    if prompt_len + p.max_tokens > limits.max_context:
        raise InvalidRequest(f"params.max_tokens {p.max_tokens}: prompt ({prompt_len} tokens) + max_tokens exceeds "
                             f"the context length {limits.max_context}")
    if not math.isfinite(p.temperature) or p.temperature < 0:
        raise InvalidRequest(f"params.temperature must be a finite number >= 0, got {p.temperature}")
    top_p = p.top_p if p.HasField("top_p") else 1.0
    if not (0 < top_p <= 1) or math.isnan(top_p):
        raise InvalidRequest(f"params.top_p must be in (0, 1], got {top_p}")
    if p.top_k < 0:
        raise InvalidRequest(f"params.top_k must be >= 0 (0 = off), got {p.top_k}")
    if len(p.stop) > limits.max_stop_strings:
        raise InvalidRequest(f"params.stop has {len(p.stop)} strings; the limit is {limits.max_stop_strings}")
    for i, s in enumerate(p.stop):
        if not s or len(s) > limits.max_stop_string_chars:
            raise InvalidRequest(f"params.stop[{i}] must have 1..{limits.max_stop_string_chars} characters, "
                                 f"got {len(s)}")
    for i, t in enumerate(p.stop_token_ids):
        if t >= limits.vocab_size:
            raise InvalidRequest(f"params.stop_token_ids[{i}] = {t} is outside the vocabulary [0, {limits.vocab_size})")
    return SamplingParams(max_tokens=p.max_tokens, temperature=float(p.temperature), top_p=float(top_p),
                          top_k=p.top_k, seed=p.seed if p.HasField("seed") else None,
                          stop_token_ids=tuple(p.stop_token_ids), stop=tuple(p.stop), ignore_eos=p.ignore_eos)


def validate(request: generation_pb2.GenerateRequest, tokenizer, limits: Limits) -> tuple[list[int], SamplingParams]:
    """-> (prompt token ids, sampling params), or InvalidRequest naming the field and the limit."""
    if len(request.request_id) > limits.max_request_id_chars:
        raise InvalidRequest(f"request_id has {len(request.request_id)} characters; the limit is "
                             f"{limits.max_request_id_chars}")
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt is missing: set prompt.text or prompt.token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("prompt.text is empty")
        ids = tokenizer.encode(request.text).ids
    else:
        ids = list(request.token_ids.ids)
        for i, t in enumerate(ids):
            if t >= limits.vocab_size:
                raise InvalidRequest(f"prompt.token_ids[{i}] = {t} is outside the vocabulary [0, {limits.vocab_size})")
    if not ids:
        raise InvalidRequest(f"prompt.{kind} is empty")
    if len(ids) >= limits.max_context:
        raise InvalidRequest(f"prompt has {len(ids)} tokens; the context length is {limits.max_context} "
                             "(prompt + at least one new token must fit)")
    return ids, _sampling_params(request.params, len(ids), limits)


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The one place exceptions become gRPC status codes."""
    if isinstance(exc, DuplicateRequest):
        return grpc.StatusCode.ALREADY_EXISTS, str(exc)
    if isinstance(exc, InvalidRequest) or isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, EngineUnavailable):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, Failure):
        return getattr(grpc.StatusCode, exc.code), exc.message
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: Router, tokenizer, limits: Limits, info: dict):
        self.router, self.tokenizer, self.limits, self.info = router, tokenizer, limits, info

    async def Generate(self, request, context):
        try:
            prompt_ids, params = validate(request, self.tokenizer, self.limits)
            req = self.router.submit(prompt_ids, params, request.request_id or None)
        except (ValueError, EngineUnavailable, DuplicateRequest) as exc:
            code, msg = status_of(exc)
            await context.abort(code, msg)
        try:
            while True:
                ev = await req.events.get()
                if isinstance(ev, Failure):
                    code, msg = status_of(ev)
                    await context.abort(code, msg)
                assert isinstance(ev, Chunk)
                if ev.finish_reason == "abort":
                    return
                yield _response(req.request_id, ev)
                if ev.finish_reason is not None:
                    return
        finally:
            # Cancel, disconnect or deadline: grpc.aio cancels this coroutine; stop the work.
            if not req.done:
                self.router.cancel(req)

    async def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(**self.info)

    async def GetServerStats(self, request, context):
        return await server_stats(self.router)


async def server_stats(router) -> generation_pb2.ServerStats:
    """The router's counters, its queues and both sides' KV usage (from the engines' info)."""
    from dataclasses import asdict

    counters = asdict(router.counters)
    out = generation_pb2.ServerStats(**counters, running=len(router.running), waiting=len(router.waiting))

    async def kv(link):
        if link is None:
            return {}
        try:
            return (await asyncio.wait_for(link.info(), 5)).kv
        except Exception:  # an engine that does not answer reports no usage
            return {}
    routers = getattr(router, "replicas", None) or [router]  # a ReplicaSet sums its pairs
    for field_name, side in (("verifier_kv", "verifier"), ("drafter_kv", "drafter")):
        usages = [await kv(getattr(r, side)) for r in routers]
        getattr(out, field_name).CopyFrom(generation_pb2.KvUsage(
            num_blocks=sum(u.get("num_blocks", 0) for u in usages),
            used_blocks=sum(u.get("used_blocks", 0) for u in usages),
            block_size=max((u.get("block_size", 0) for u in usages), default=0)))
    return out


def _response(request_id: str, ev: Chunk) -> generation_pb2.GenerateResponse:
    out = generation_pb2.GenerateResponse(request_id=request_id, token_ids=ev.token_ids, text=ev.text,
                                          prompt_tokens=ev.prompt_tokens)
    if ev.finish_reason is not None:
        out.finish_reason = ev.finish_reason
        out.stats.CopyFrom(common_pb2.SpecStats(**ev.stats))
    return out


async def start_server(router: Router, tokenizer, limits: Limits, info: dict, host: str = "localhost",
                       port: int = 50051, credentials: grpc.ServerCredentials | None = None,
                       interceptors: tuple = ()):
    """Starts the public server; returns (server, bound port). Health is SERVING while the
    verifier answers. `credentials`: TLS (None: plaintext); `interceptors`: e.g. the API-key
    check (router/auth.py)."""
    server = grpc.aio.server(interceptors=list(interceptors) or None, options=[
        ("grpc.max_receive_message_length", limits.max_message_bytes),
        ("grpc.max_send_message_length", 64 * 1024 * 1024),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", 5000),
        ("grpc.keepalive_permit_without_calls", 1),
    ])
    generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(router, tokenizer, limits, info), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    if bound == 0:
        raise OSError(f"cannot listen on {address}")

    async def set_health(up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    router.on_serving_change = lambda up: asyncio.get_running_loop().create_task(set_health(up))
    await server.start()
    await set_health(router.serving)
    return server, bound
