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
from google.protobuf.descriptor import FieldDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.links import DuplicateRequest, EngineUnavailable
from router.loop import Failure, Router, StreamEvent
from spectandem.config import SamplingParams
from spectandem.errors import ListenError
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
    # A text prompt of more characters cannot fit the context (prompt_char_limit); refused before
    # it is tokenised. 0: only the message size bounds it.
    max_prompt_chars: int = 0


def prompt_char_limit(tokenizer, max_context: int) -> int:
    """The most characters a text prompt of fewer than `max_context` tokens can have: each token
    covers at most as many characters as its longest vocabulary string (for byte-level BPE, one
    character per byte; for SentencePiece, one per character; added tokens as written), so a text
    of more than (max_context - 1) * K characters needs at least max_context tokens. Refusing
    such texts before tokenising them never refuses a prompt that would fit."""
    longest = max((len(t) for t in tokenizer.get_vocab(with_added_tokens=True)), default=1)
    return max(1, max_context - 1) * max(1, longest)


def encode_text(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`. Called in a worker thread: `encode_batch` releases the GIL while the
    tokenizer works (`encode` holds it), so the event loop keeps serving meanwhile."""
    return tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids


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


async def validate(request: generation_pb2.GenerateRequest, tokenizer,
                   limits: Limits) -> tuple[list[int], SamplingParams]:
    """-> (prompt token ids, sampling params), or InvalidRequest naming the field and the limit.
    A text prompt over `limits.max_prompt_chars` is refused before tokenisation, and tokenisation
    runs in a worker thread, off the event loop."""
    if len(request.request_id) > limits.max_request_id_chars:
        raise InvalidRequest(f"request_id has {len(request.request_id)} characters; the limit is "
                             f"{limits.max_request_id_chars}")
    kind = request.WhichOneof("prompt")
    if kind is None:
        raise InvalidRequest("prompt is missing: set prompt.text or prompt.token_ids")
    if kind == "text":
        if not request.text:
            raise InvalidRequest("prompt.text is empty")
        if limits.max_prompt_chars and len(request.text) > limits.max_prompt_chars:
            raise InvalidRequest(f"prompt.text has {len(request.text)} characters; the limit is "
                                 f"{limits.max_prompt_chars} (more cannot fit the context of {limits.max_context} "
                                 "tokens)")
        ids = await asyncio.to_thread(encode_text, tokenizer, request.text)
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


class MalformedRequest:
    """What the public service's deserializers hand a handler for bytes that are not a valid
    request message (grpc-python answers UNKNOWN when a deserializer raises): the handler answers
    INVALID_ARGUMENT with `message`."""

    def __init__(self, message: str):
        self.message = message


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]  # IndexError past the end: truncated
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise IndexError("varint too long")


def invalid_utf8_field(descriptor, data: bytes, prefix: str = "") -> str | None:
    """The first string field in `data` (the wire format of a `descriptor` message) that is not
    valid UTF-8, named as the API names it ("prompt.text", "params.stop[2]"), or None when there is
    none or the bytes are malformed elsewhere."""
    seen: dict[int, int] = {}
    pos = 0
    try:
        while pos < len(data):
            key, pos = _varint(data, pos)
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
                continue
            if wire in (1, 5):
                pos += 8 if wire == 1 else 4
                continue
            if wire != 2:
                return None
            length, pos = _varint(data, pos)
            if pos + length > len(data):
                return None
            chunk, pos = data[pos:pos + length], pos + length
            field = descriptor.fields_by_number.get(number)
            if field is None:
                continue
            name = prefix + (f"{field.containing_oneof.name}." if field.containing_oneof else "") + field.name
            if field.is_repeated:
                seen[number] = seen.get(number, -1) + 1
                name += f"[{seen[number]}]"
            if field.type == FieldDescriptor.TYPE_STRING:
                try:
                    chunk.decode("utf-8")
                except UnicodeDecodeError:
                    return name
            elif field.type == FieldDescriptor.TYPE_MESSAGE:
                found = invalid_utf8_field(field.message_type, chunk, name + ".")
                if found is not None:
                    return found
    except IndexError:
        return None
    return None


def lenient_deserializer(message_class):
    """A request deserializer that never raises: the message, or a MalformedRequest naming the
    field with invalid UTF-8 where there is one."""
    full_name = message_class.DESCRIPTOR.full_name

    def parse(data: bytes):
        try:
            return message_class.FromString(data)
        except Exception:  # google.protobuf.message.DecodeError
            field = invalid_utf8_field(message_class.DESCRIPTOR, data)
            if field is not None:
                return MalformedRequest(f"{field} is not valid UTF-8")
            return MalformedRequest(f"the request is not a valid {full_name} (truncated or malformed protobuf)")
    return parse


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
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        try:
            prompt_ids, params = await validate(request, self.tokenizer, self.limits)
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
                assert isinstance(ev, StreamEvent)
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
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return generation_pb2.ModelInfo(**self.info)

    async def GetServerStats(self, request, context):
        if isinstance(request, MalformedRequest):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await server_stats(self.router)


def add_generation_service(servicer: GenerationServicer, server) -> None:
    """Registers `servicer` as the generated `add_GenerationServicer_to_server` does, but with
    deserializers that hand a malformed request to the handler (INVALID_ARGUMENT naming the field)
    instead of raising (which grpc-python answers with UNKNOWN)."""
    methods = {"Generate": (grpc.unary_stream_rpc_method_handler, generation_pb2.GenerateRequest,
                            generation_pb2.GenerateResponse),
               "GetModelInfo": (grpc.unary_unary_rpc_method_handler, generation_pb2.GetModelInfoRequest,
                                generation_pb2.ModelInfo),
               "GetServerStats": (grpc.unary_unary_rpc_method_handler, generation_pb2.GetServerStatsRequest,
                                  generation_pb2.ServerStats)}
    handlers = {name: make(getattr(servicer, name), request_deserializer=lenient_deserializer(request_class),
                           response_serializer=response_class.SerializeToString)
                for name, (make, request_class, response_class) in methods.items()}
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


async def server_stats(router) -> generation_pb2.ServerStats:
    """The router's counters, its queues, both sides' KV usage and the verifiers' decode-ahead
    counts (from the engines' info)."""
    from dataclasses import asdict

    counters = asdict(router.counters)
    out = generation_pb2.ServerStats(**counters, running=len(router.running), waiting=len(router.waiting))

    async def info(link):
        if link is None:
            return None
        try:
            return await asyncio.wait_for(link.info(), 5)
        except Exception:  # an engine that does not answer reports nothing
            return None
    routers = getattr(router, "replicas", None) or [router]  # a ReplicaSet sums its pairs
    for field_name, side in (("verifier_kv", "verifier"), ("drafter_kv", "drafter")):
        infos = [i for i in [await info(getattr(r, side)) for r in routers] if i is not None]
        usages = [i.kv for i in infos]
        getattr(out, field_name).CopyFrom(generation_pb2.KvUsage(
            num_blocks=sum(u.get("num_blocks", 0) for u in usages),
            used_blocks=sum(u.get("used_blocks", 0) for u in usages),
            block_size=max((u.get("block_size", 0) for u in usages), default=0)))
        if side == "verifier":
            from router.metrics import decode_ahead_sums

            ahead = decode_ahead_sums(infos)
            out.decode_ahead_taken, out.decode_ahead_forgotten = ahead["taken"], ahead["forgotten"]
    return out


def _response(request_id: str, ev: StreamEvent) -> generation_pb2.GenerateResponse:
    out = generation_pb2.GenerateResponse(request_id=request_id, token_ids=ev.token_ids, text=ev.text,
                                          prompt_tokens=ev.prompt_tokens)
    if ev.finish_reason is not None:
        out.finish_reason = ev.finish_reason
        out.stats.CopyFrom(common_pb2.SpecStats(**ev.stats))
    return out


def check_port_free(host: str, port: int, flag: str) -> None:
    """ListenError (one line, naming `flag`) where host:port is in use or not ours to take; gRPC
    would find the same, but log it at length first. Port 0 (any free one) passes."""
    if port == 0:
        return
    import errno
    import socket

    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise ListenError(f"{flag} {port}: cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the server binds: TIME_WAIT is free
            try:
                s.bind(addr)
            except OSError as exc:
                if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                    raise ListenError(f"{flag} {port}: cannot listen on {host}:{port}: {exc.strerror}") from None


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
        ("grpc.so_reuseport", 0),   # a port in use is refused, not shared with the server holding it
    ])
    add_generation_service(GenerationServicer(router, tokenizer, limits, info), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    address = f"{host}:{port}"
    check_port_free(host, port, "--port")
    try:
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as exc:
        raise ListenError(f"--port {port}: cannot listen on {address}: {exc}") from None
    if bound == 0:
        raise ListenError(f"--port {port}: cannot listen on {address}: in use or not an address of this host")

    async def set_health(up: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if up else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    router.on_serving_change = lambda up: asyncio.get_running_loop().create_task(set_health(up))
    await server.start()
    await set_health(router.serving)
    return server, bound
