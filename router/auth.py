"""API-key authentication of the public API (gRPC and HTTP): `authorization: Bearer KEY`.

What stays open without a key, on purpose: `grpc.health.v1.Health` (load balancers and
Kubernetes probes carry no credentials) and server reflection (it describes the API, it serves
nothing); on HTTP, `/health` and `/metrics`. Everything else answers UNAUTHENTICATED (HTTP 401).

The key is compared in constant time. It comes from `--api-key` or SPECTANDEM_API_KEY, read in
the entry point only.
"""

from __future__ import annotations

import hmac

import grpc

OPEN_GRPC_PREFIXES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                      "/grpc.reflection.v1.ServerReflection/")


def check_bearer(header: str | None, api_key: str) -> str | None:
    """None when `header` is exactly "Bearer " + `api_key` (the scheme spelled `Bearer`, one
    space, the key, nothing else), else the reason it is refused."""
    if not header:
        return "missing API key: send the header 'authorization: Bearer <key>'"
    expected = ("Bearer " + api_key).encode("utf-8", "surrogateescape")
    if not hmac.compare_digest(header.encode("utf-8", "surrogateescape"), expected):
        return "invalid API key: the authorization header must be exactly 'Bearer <key>'"
    return None


def _denied(handler: grpc.RpcMethodHandler, reason: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that aborts with UNAUTHENTICATED."""

    async def unary_response(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)

    async def stream_response(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, reason)
        yield  # never reached: makes this an async generator, as a streaming handler must be

    kinds = {(False, False): (grpc.unary_unary_rpc_method_handler, unary_response),
             (False, True): (grpc.unary_stream_rpc_method_handler, stream_response),
             (True, False): (grpc.stream_unary_rpc_method_handler, unary_response),
             (True, True): (grpc.stream_stream_rpc_method_handler, stream_response)}
    make, fn = kinds[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return make(fn, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str):
        if not api_key:
            raise ValueError("the API key must be a non-empty string")
        self.api_key = api_key

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(OPEN_GRPC_PREFIXES):
            return handler
        header = next((v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"), None)
        reason = check_bearer(header if isinstance(header, str) else None, self.api_key)
        return handler if reason is None else _denied(handler, reason)
