"""The operations side of `spectandem serve`: its flags, and what they start beside the gRPC API.

    --http-port      OpenAI-compatible HTTP front (router/openai_http.py); default 8000, 0 = off
    --metrics-port   Prometheus /metrics (router/metrics.py); default 9090, 0 = off; equal to
                     --http-port: served by the HTTP front on its port
    --log-format     text | json (one JSON line per log record and per request event)
    --api-key        require `authorization: Bearer KEY` on the public gRPC and HTTP APIs
                     (the entry point falls back to SPECTANDEM_API_KEY)
    --tls-cert/--tls-key [--tls-client-ca]
                     TLS (mTLS with a client CA) on the public gRPC port and the HTTP front;
                     /metrics on its own port stays plaintext, for an in-cluster scraper
    --internal-tls-ca [--internal-tls-cert --internal-tls-key]
                     TLS to the engines (spectandem/tls.py explains the one-certificate setup
                     for engines that `serve --backend grpc` starts itself)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from spectandem.tls import ClientTls, ServerTls, add_server_tls_flags

SHUTDOWN_GRACE_S = 2.0   # HTTP requests in flight at shutdown get this long (as the gRPC server's grace)


def add_ops_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("HTTP front, metrics, logs and security")
    g.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API port (0 = off)")
    g.add_argument("--metrics-port", type=int, default=9090,
                   help="Prometheus /metrics port (0 = off; the --http-port value: served by the HTTP front)")
    g.add_argument("--log-format", choices=["text", "json"], default="text",
                   help="json: every log line as a JSON object, plus one line per request event")
    g.add_argument("--api-key", default=None,
                   help="require 'authorization: Bearer KEY' on the public API (default: $SPECTANDEM_API_KEY); "
                        "health checks and reflection stay open")
    add_server_tls_flags(g, "the public gRPC port and the HTTP front")
    g.add_argument("--internal-tls-ca", default=None, metavar="PEM",
                   help="reach the drafter and verifier services over TLS, trusting this CA")
    g.add_argument("--internal-tls-cert", default=None, metavar="PEM",
                   help="the router's client certificate for the engines (and, for engines started here, "
                        "their server certificate)")
    g.add_argument("--internal-tls-key", default=None, metavar="PEM", help="private key of --internal-tls-cert")


@dataclass(frozen=True, kw_only=True)
class OpsConfig:
    http_port: int
    metrics_port: int
    log_json: bool = False
    api_key: str | None = None
    public_tls: ServerTls | None = None
    internal_tls: ClientTls | None = None

    def __post_init__(self):
        for flag, port in (("--http-port", self.http_port), ("--metrics-port", self.metrics_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be in [0, 65535] (0 = off), got {port}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key is empty")

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> OpsConfig:
        return cls(http_port=args.http_port, metrics_port=args.metrics_port, log_json=args.log_format == "json",
                   api_key=args.api_key,
                   public_tls=ServerTls.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca),
                   internal_tls=ClientTls.from_flags(args.internal_tls_ca, args.internal_tls_cert,
                                                     args.internal_tls_key))

    def grpc_server_security(self) -> tuple:
        """(credentials or None, interceptors) for the public gRPC server."""
        from router.auth import ApiKeyInterceptor

        creds = self.public_tls.grpc_credentials() if self.public_tls else None
        return creds, ([ApiKeyInterceptor(self.api_key)] if self.api_key else [])

    def link_credentials(self):
        """Channel credentials of the router's links to engine services, or None (plaintext)."""
        return self.internal_tls.grpc_credentials() if self.internal_tls else None

    def engine_flags(self) -> list[str]:
        """TLS flags for engine services this router starts itself."""
        return self.internal_tls.engine_tls().flags() if self.internal_tls else []


class Fronts:
    """The HTTP listeners started beside the gRPC API: ports (None when off) and cleanup."""

    def __init__(self):
        self.http_port: int | None = None
        self.metrics_port: int | None = None
        self.metrics = None
        self._runners: list = []

    async def close(self) -> None:
        for runner in reversed(self._runners):
            await runner.cleanup()
        self._runners = []


async def start_http(app, host: str, port: int, ssl_context=None) -> tuple:
    """Serves `app` on host:port (aiohttp); -> (runner to clean up, bound port). Client
    disconnects cancel the handler, so a streaming request stops when its reader goes. On
    cleanup, requests in flight get SHUTDOWN_GRACE_S to finish."""
    from aiohttp import web

    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
    await runner.setup()
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        from spectandem.errors import ListenError

        raise ListenError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return runner, runner.addresses[0][1]


async def start_fronts(ops: OpsConfig, router, tokenizer, limits, *, model_name: str, host: str, links: dict,
                       positions: int, default_slots: int, chat_template=None) -> Fronts:
    """Hooks metrics and request logs into `router` and starts the HTTP listeners."""
    from router.metrics import Metrics, start_metrics_server
    from router.openai_http import OpenAIFront
    from router.request_log import RequestLog

    fronts = Fronts()
    if ops.log_json:
        router.listeners.append(RequestLog())
    if ops.metrics_port:
        fronts.metrics = Metrics(router, links, positions=positions, default_slots=default_slots)
    try:
        if ops.http_port:
            front = OpenAIFront(router, tokenizer, limits, model_name, chat_template=chat_template,
                                api_key=ops.api_key)
            shared = fronts.metrics.handle if fronts.metrics and ops.metrics_port == ops.http_port else None
            runner, fronts.http_port = await start_http(front.app(shared), host, ops.http_port,
                                                        ops.public_tls.ssl_context() if ops.public_tls else None)
            fronts._runners.append(runner)
            if shared:
                fronts.metrics_port = fronts.http_port
        if fronts.metrics and fronts.metrics_port is None:
            runner, fronts.metrics_port = await start_metrics_server(fronts.metrics, host, ops.metrics_port)
            fronts._runners.append(runner)
    except BaseException:
        await fronts.close()
        raise
    return fronts
