"""Security of a served router: TLS and mTLS on the public gRPC port and the HTTP front, the API
key (health and reflection stay open), mutual TLS between the router and engine services started
by `serve --backend grpc`, and no unsafe deserialization anywhere in the source tree."""

from __future__ import annotations

import ast
import asyncio
import json
import ssl
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from router.auth import ApiKeyInterceptor
from router.server import Limits, start_server
from spectandem import Client, SamplingParams, Unauthenticated
from spectandem.tls import ClientTls, ServerTls
from router.serve import free_port
from tests.router.conftest import Served, collect, request

KEY = "test-key-0123456789"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def server(pki):
    """TLS (server certificate only) and an API key on the public gRPC port and the HTTP front."""
    s = Served(["--backend", "local", "--max-len", "256", "--max-running", "4", "--api-key", KEY,
                "--tls-cert", str(pki.server_cert), "--tls-key", str(pki.server_key),
                "--http-port", str(free_port())]).wait_ready()
    yield s
    s.close()


def creds(pki, client: str | None = None, ca: str = "ca") -> grpc.ChannelCredentials:
    """TLS trusting `ca`; with `client` ("client" or "rogue") also presenting that certificate."""
    kw = dict(private_key=pki.read(f"{client}_key"), certificate_chain=pki.read(f"{client}_cert")) if client else {}
    return grpc.ssl_channel_credentials(root_certificates=pki.read(ca), **kw)


def health(channel: grpc.Channel, timeout: float = 5.0):
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="spectandem.v1.Generation"),
                                                     timeout=timeout).status


def test_tls_and_api_key_on_grpc(server, pki):
    with Client(server.address, tls=creds(pki), api_key=KEY, timeout=60) as c:
        done = c.generate("def add(a, b):", SamplingParams(max_tokens=8, ignore_eos=True))
        assert len(done.token_ids) == 8
    with Client(server.address, tls=creds(pki), timeout=30, max_retries=0) as c:
        c.wait_for_ready(30)                     # health is open without the key
        with pytest.raises(Unauthenticated, match="missing API key"):
            c.generate("def add(a, b):", SamplingParams(max_tokens=8))
        with pytest.raises(Unauthenticated):
            c.model_info()
    with Client(server.address, tls=creds(pki), api_key="wrong", timeout=30, max_retries=0) as c:
        with pytest.raises(Unauthenticated, match="invalid API key"):
            c.generate("def add(a, b):", SamplingParams(max_tokens=8))

    with grpc.secure_channel(server.address, creds(pki)) as channel:
        assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            timeout=5)
        names = {s.name for r in replies for s in r.list_services_response.service}
        assert "spectandem.v1.Generation" in names    # reflection is open too


@pytest.mark.parametrize("channel_kind", ["plaintext", "untrusted CA"])
def test_tls_port_refuses_plaintext_and_untrusted_certificates(server, pki, channel_kind):
    channel = (grpc.insecure_channel(server.address) if channel_kind == "plaintext"
               else grpc.secure_channel(server.address, creds(pki, ca="rogue_cert")))
    with channel, pytest.raises(grpc.RpcError) as err:
        health(channel, timeout=3)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mtls_rejects_clients_without_a_trusted_certificate(server, pki):
    """A second public port on the same router, requiring client certificates (as --tls-client-ca)."""
    router = server.state["router"]
    with Client(server.address, tls=creds(pki), api_key=KEY, timeout=30) as c:
        info = c.model_info()
    tls = ServerTls(cert=str(pki.server_cert), key=str(pki.server_key), client_ca=str(pki.ca))
    srv, port = server.run(start_server(router, router.tokenizer, Limits(max_context=info["max_context"],
                                                                         vocab_size=info["vocab_size"]),
                                        info, "localhost", 0, credentials=tls.grpc_credentials(),
                                        interceptors=[ApiKeyInterceptor(KEY)]))
    address = f"localhost:{port}"
    try:
        with grpc.secure_channel(address, creds(pki, client="client")) as channel:
            assert health(channel) == health_pb2.HealthCheckResponse.SERVING
        with Client(address, tls=creds(pki, client="client"), api_key=KEY, timeout=60) as c:
            assert len(c.generate("x = ", SamplingParams(max_tokens=4, ignore_eos=True)).token_ids) == 4
        for channel in (grpc.secure_channel(address, creds(pki)),                   # no client certificate
                        grpc.secure_channel(address, creds(pki, client="rogue")),   # one from another CA
                        grpc.insecure_channel(address)):
            with channel, pytest.raises(grpc.RpcError) as err:
                health(channel, timeout=3)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.run(srv.stop(0))


def test_http_front_tls_and_api_key(server, pki):
    base = f"https://localhost:{server.state['http_port']}"
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    with openai.OpenAI(base_url=base + "/v1", api_key=KEY, max_retries=0, timeout=60,
                       http_client=openai.DefaultHttpxClient(verify=ctx)) as c:
        got = c.completions.create(model="target", prompt="def add(a, b):", max_tokens=8, temperature=0)
        assert got.usage.completion_tokens == 8
    with openai.OpenAI(base_url=base + "/v1", api_key="wrong", max_retries=0, timeout=60,
                       http_client=openai.DefaultHttpxClient(verify=ctx)) as c:
        with pytest.raises(openai.AuthenticationError) as err:
            c.models.list()
    assert err.value.status_code == 401 and err.value.body["code"] == "UNAUTHENTICATED"
    assert json.loads(urllib.request.urlopen(base + "/health", context=ctx, timeout=10).read())["status"] == "ok"
    with pytest.raises((urllib.error.URLError, ConnectionError)):  # plaintext HTTP to the TLS port
        urllib.request.urlopen(f"http://localhost:{server.state['http_port']}/health", timeout=10)


def test_internal_mtls_between_router_and_engine_services(pki):
    """serve --backend grpc with --internal-tls-*: the engines it starts listen on loopback with
    mutual TLS; the router's links get through, a client without the internal certificate does not."""
    s = Served(["--backend", "grpc", "--max-len", "256", "--max-running", "4", "--internal-tls-ca", str(pki.ca),
                "--internal-tls-cert", str(pki.server_cert), "--internal-tls-key", str(pki.server_key)]).wait_ready()
    try:
        toks, _, reason, stats = collect(s.stub, request(text="def add(a, b):", max_tokens=12, ignore_eos=True))
        assert len(toks) == 12 and stats.accepted_tokens > 0          # the drafter took part, over mTLS
        for role in ("verifier", "drafter"):
            cmd = s.state["procs"][role].argv
            assert cmd[cmd.index("--host") + 1] == "127.0.0.1" and "--tls-client-ca" in cmd
        from router.links_grpc import GrpcVerifierLink

        address = s.state["verifier"].address

        async def reachable(credentials) -> bool:
            link = GrpcVerifierLink(address, timeout_s=3, credentials=credentials)
            try:
                await link.info()
                return True
            except Exception:
                return False
            finally:
                await link.close()

        internal = ClientTls(ca=str(pki.ca), cert=str(pki.server_cert), key=str(pki.server_key))
        assert asyncio.run(reachable(internal.grpc_credentials()))
        assert not asyncio.run(reachable(None))                                           # plaintext
        assert not asyncio.run(reachable(ClientTls(ca=str(pki.ca)).grpc_credentials()))  # no client certificate
        assert not asyncio.run(reachable(creds(pki, client="rogue")))                     # another CA's
    finally:
        s.close()


def test_tls_flag_errors_name_the_flag(pki, tmp_path):
    with pytest.raises(ValueError, match="--tls-cert and --tls-key go together"):
        ServerTls.from_flags(str(pki.server_cert), None, None)
    with pytest.raises(ValueError, match="--tls-client-ca needs --tls-cert"):
        ServerTls.from_flags(None, None, str(pki.ca))
    with pytest.raises(ValueError, match="--tls-key .*missing.pem: cannot read"):
        ServerTls.from_flags(str(pki.server_cert), str(tmp_path / "missing.pem"), None)
    with pytest.raises(ValueError, match="need --internal-tls-ca"):
        ClientTls.from_flags(None, str(pki.client_cert), str(pki.client_key))
    with pytest.raises(ValueError, match="also need --internal-tls-cert"):
        ClientTls(ca=str(pki.ca)).engine_tls()


# ---------------------------------------------------------------------------------- no pickles

SOURCE_DIRS = ("spectandem", "router", "drafter", "verifier", "benchmarks", "deploy", "models")
UNSAFE_MODULES = {"pickle", "cPickle", "_pickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}


def unsafe_calls(path: Path) -> list[str]:
    """Deserialization that can run code: {pickle,dill,...}.load(s), torch.load without
    weights_only=True, numpy.load with allow_pickle=True, and ZeroMQ's recv_pyobj."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        fn, owner = node.func.attr, node.func.value
        owner_name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
        kw = {k.arg: k.value for k in node.keywords}
        safe_true = lambda name: isinstance(kw.get(name), ast.Constant) and kw[name].value is True  # noqa: E731
        if owner_name in UNSAFE_MODULES and fn in ("load", "loads", "Unpickler"):
            found.append(f"{path}:{node.lineno}: {owner_name}.{fn}")
        elif owner_name == "torch" and fn == "load" and not safe_true("weights_only"):
            found.append(f"{path}:{node.lineno}: torch.load without weights_only=True")
        elif owner_name in ("np", "numpy") and fn == "load" and safe_true("allow_pickle"):
            found.append(f"{path}:{node.lineno}: numpy.load(allow_pickle=True)")
        elif fn == "recv_pyobj":
            found.append(f"{path}:{node.lineno}: recv_pyobj")
    return found


def test_no_unsafe_deserialization_in_the_source_tree():
    files = [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 30
    assert [f for p in files for f in unsafe_calls(p)] == []


def test_the_scan_finds_what_it_forbids(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import pickle, torch\npickle.loads(b'')\ntorch.load('x')\ntorch.load('x', weights_only=False)\n"
                   "torch.load('x', weights_only=True)\nsock.recv_pyobj()\n")
    assert [f.split(": ", 1)[1] for f in unsafe_calls(bad)] == [
        "pickle.loads", "torch.load without weights_only=True", "torch.load without weights_only=True", "recv_pyobj"]


def test_cli_sends_the_api_key():
    """`spectandem generate --address` and `spectandem stats` reach a keyed server with --api-key
    (or $SPECTANDEM_API_KEY), and are refused without it."""
    import json
    import os
    import subprocess
    import sys

    s = Served(["--backend", "local", "--max-len", "256", "--max-running", "2", "--api-key", KEY]).wait_ready()
    try:
        base = [sys.executable, "-m", "spectandem.cli"]
        env = {k: v for k, v in os.environ.items() if k != "SPECTANDEM_API_KEY"}
        gen = ["generate", "def f():", "--address", s.address, "--max-tokens", "4", "--json"]
        refused = subprocess.run(base + gen, capture_output=True, text=True, timeout=120, env=env)
        assert refused.returncode != 0 and "UNAUTHENTICATED" in refused.stderr
        ok = subprocess.run(base + gen + ["--api-key", KEY], capture_output=True, text=True, timeout=120, env=env)
        assert ok.returncode == 0, ok.stderr
        assert len(json.loads(ok.stdout)["token_ids"]) == 4
        stats = subprocess.run(base + ["stats", "--address", s.address, "--json"], capture_output=True, text=True,
                               timeout=60, env=dict(env, SPECTANDEM_API_KEY=KEY))
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["requests_finished"] >= 1
    finally:
        s.close()
