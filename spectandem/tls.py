"""TLS for spectandem's ports: credentials built once from PEM files, and the flags that name them.

Who uses what:
    public port of `spectandem serve` (gRPC and the HTTP front)  --tls-cert --tls-key [--tls-client-ca]
    `spectandem drafter|verifier` (and python -m drafter|verifier) --tls-cert --tls-key [--tls-client-ca]
    the router's links to the engines                             --internal-tls-ca
                                                                  [--internal-tls-cert --internal-tls-key]

`--tls-client-ca` turns TLS into mutual TLS: a client must present a certificate signed by that
CA, or the handshake fails. When `serve --backend grpc` starts the engines itself, one internal
certificate (serverAuth and clientAuth, names `localhost`) is both the engines' server
certificate and the router's client certificate, and the internal CA is the engines' client CA:
three flags secure both directions of every internal call.

File errors are `ValueError`s naming the flag and the path, raised at startup.
"""

from __future__ import annotations

import argparse
import ssl
from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | None, flag: str) -> bytes | None:
    if path is None:
        return None
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read ({exc.strerror})") from None


@dataclass(frozen=True, kw_only=True)
class ServerTls:
    """A listening port's TLS: certificate chain and key (PEM), and the CA that client certificates
    must chain to (mTLS) or None (any client may connect over TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self):
        for flag, path in (("--tls-cert", self.cert), ("--tls-key", self.key), ("--tls-client-ca", self.client_ca)):
            _read(path, flag)  # fail at startup, naming the flag, not on the first handshake

    @classmethod
    def from_flags(cls, cert: str | None, key: str | None, client_ca: str | None) -> ServerTls | None:
        """None when TLS is off; ValueError for a half-given pair."""
        if cert is None and key is None:
            if client_ca is not None:
                raise ValueError("--tls-client-ca needs --tls-cert and --tls-key "
                                 "(mTLS is TLS plus client certificates)")
            return None
        if cert is None or key is None:
            raise ValueError("--tls-cert and --tls-key go together; got only "
                             + ("--tls-cert" if cert is not None else "--tls-key"))
        return cls(cert=cert, key=key, client_ca=client_ca)

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(_read(self.key, "--tls-key"), _read(self.cert, "--tls-cert"))],
                                           root_certificates=_read(self.client_ca, "--tls-client-ca"),
                                           require_client_auth=self.client_ca is not None)

    def ssl_context(self) -> ssl.SSLContext:
        """The same policy for an HTTP (aiohttp) listener."""
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.client_ca is not None:
            ctx.load_verify_locations(self.client_ca)
            ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx

    def flags(self) -> list[str]:
        """The command-line flags that rebuild this policy in another process."""
        return ["--tls-cert", self.cert, "--tls-key", self.key] + (
            ["--tls-client-ca", self.client_ca] if self.client_ca else [])


@dataclass(frozen=True, kw_only=True)
class ClientTls:
    """How the router reaches TLS engines: the CA their certificates chain to, and an optional
    client certificate and key (for engines that require one)."""

    ca: str
    cert: str | None = None
    key: str | None = None

    @classmethod
    def from_flags(cls, ca: str | None, cert: str | None, key: str | None) -> ClientTls | None:
        if ca is None:
            if cert is not None or key is not None:
                raise ValueError("--internal-tls-cert/--internal-tls-key need --internal-tls-ca "
                                 "(the CA the engines' certificates chain to)")
            return None
        if (cert is None) != (key is None):
            raise ValueError("--internal-tls-cert and --internal-tls-key go together")
        out = cls(ca=ca, cert=cert, key=key)
        out.grpc_credentials()  # read the files now: a bad path fails at startup
        return out

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "--internal-tls-ca"),
                                            private_key=_read(self.key, "--internal-tls-key"),
                                            certificate_chain=_read(self.cert, "--internal-tls-cert"))

    def engine_tls(self) -> ServerTls:
        """The TLS of engines this router starts itself: its own certificate as theirs, and
        mutual TLS against the internal CA (so only holders of an internal certificate get in)."""
        if self.cert is None:
            raise ValueError("engines started by `serve --backend grpc` with --internal-tls-ca also need "
                             "--internal-tls-cert and --internal-tls-key (their server certificate)")
        return ServerTls(cert=self.cert, key=self.key, client_ca=self.ca)


def add_server_tls_flags(p: argparse.ArgumentParser, what: str = "this port") -> None:
    p.add_argument("--tls-cert", default=None, metavar="PEM", help=f"serve {what} over TLS: certificate chain")
    p.add_argument("--tls-key", default=None, metavar="PEM", help="private key of --tls-cert")
    p.add_argument("--tls-client-ca", default=None, metavar="PEM",
                   help="require client certificates signed by this CA (mutual TLS)")


def server_tls_from_args(args: argparse.Namespace) -> ServerTls | None:
    return ServerTls.from_flags(args.tls_cert, args.tls_key, args.tls_client_ca)
