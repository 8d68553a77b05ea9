"""Bad input on the public APIs, over real gRPC and real HTTP against a served router: the prompt
character cap and tokenisation off the event loop, malformed protobuf and invalid UTF-8, lone
surrogates and deep nesting in JSON bodies, seeds over the whole uint64 range, and the exact form
of the authorization header. Each bad request gets a clear error and the server stays up."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.auth import check_bearer
from router.openai_http import OpenAIFront
from router.openai_protocol import MAX_JSON_DEPTH, ChatTemplate
from router.server import Limits, prompt_char_limit, start_server
from spectandem import Client, SamplingParams
from spectandem.config import SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from router.serve import free_port
from tests.router.conftest import Served

KEY = "input-test-key-42"
AUTH = (("authorization", f"Bearer {KEY}"),)
MAX_LEN = 512
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|>"


@pytest.fixture(scope="module")
def server():
    s = Served(["--backend", "local", "--max-len", str(MAX_LEN), "--max-running", "8", "--api-key", KEY,
                "--http-port", str(free_port())]).wait_ready()
    yield s
    s.close()


def generate(server_or_stub, req: generation_pb2.GenerateRequest, metadata=AUTH, timeout=60):
    stub = getattr(server_or_stub, "stub", server_or_stub)
    toks, reason = [], ""
    for chunk in stub.Generate(req, metadata=metadata, timeout=timeout):
        toks += list(chunk.token_ids)
        reason = chunk.finish_reason or reason
    return toks, reason


def grpc_error(stub, req) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        generate(stub, req)
    return err.value


def http(server, path: str, body: bytes | dict | None = None, headers: dict | None = None, timeout=60):
    """-> (status, parsed JSON body)."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server.state['http_port']}{path}", data=data,
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {KEY}",
                                          **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=10).status


def still_serving(server) -> None:
    """A good request after the bad ones still generates."""
    toks, reason = generate(server, generation_pb2.GenerateRequest(
        text="def add(a, b):", params=common_pb2.SamplingParams(max_tokens=4, ignore_eos=True)))
    assert len(toks) == 4 and reason == "length"


# ------------------------------------------------------------------ prompt character cap (item 8)

def test_character_cap_is_advertised_and_safe(server):
    tok = server.state["router"].tokenizer
    with Client(server.address, api_key=KEY, timeout=30) as c:
        cap = c.model_info()["max_prompt_chars"]
    assert cap == prompt_char_limit(tok, MAX_LEN) > 0
    # The cap never refuses a prompt that fits: the longest token, repeated to fill the context
    # less one token, decodes to a text within it.
    vocab = tok.get_vocab(with_added_tokens=True)
    longest_id = vocab[max(vocab, key=len)]
    widest = tok.decode([longest_id] * (MAX_LEN - 1))
    assert len(widest) <= cap


def test_prompt_over_the_character_cap_is_refused_naming_the_field(server):
    with Client(server.address, api_key=KEY, timeout=30) as c:
        cap = c.model_info()["max_prompt_chars"]
    text = "a" * (cap + 1)
    err = grpc_error(server.stub, generation_pb2.GenerateRequest(text=text, params=common_pb2.SamplingParams(
        max_tokens=4)))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt.text" in err.details() and str(cap) in err.details() and str(cap + 1) in err.details()
    status, body = http(server, "/v1/completions", {"prompt": text, "max_tokens": 4})
    assert status == 400 and body["error"]["param"] == "prompt" and str(cap) in body["error"]["message"]
    still_serving(server)


class GatedTokenizer:
    """The served tokenizer, but encoding waits until the test opens the gate, and records the
    thread it ran on."""

    def __init__(self, inner):
        self.inner, self.entered, self.gate, self.threads = inner, threading.Event(), threading.Event(), []

    def _wait(self):
        self.threads.append(threading.get_ident())
        self.entered.set()
        assert self.gate.wait(60), "the test never opened the gate"

    def encode(self, *a, **kw):
        self._wait()
        return self.inner.encode(*a, **kw)

    def encode_batch(self, *a, **kw):
        self._wait()
        return self.inner.encode_batch(*a, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


async def _start_http(front: OpenAIFront):
    from aiohttp import web

    runner = web.AppRunner(front.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, runner.addresses[0][1]


@pytest.mark.parametrize("path", ["grpc", "http-completions", "http-chat"])
def test_tokenisation_runs_off_the_event_loop(server, path):
    """While one prompt is being tokenised (held in the tokenizer by a gate), the same event loop
    still answers health checks and generates another stream; then the held request completes."""
    router = server.state["router"]
    gated = GatedTokenizer(router.tokenizer)
    limits = Limits(max_context=MAX_LEN, vocab_size=router.tokenizer.get_vocab_size(),
                    max_prompt_chars=prompt_char_limit(router.tokenizer, MAX_LEN))
    loop_thread = server.thread.ident
    result: dict = {}
    if path == "grpc":
        srv, port = server.run(start_server(router, gated, limits, {"target_model": "target"}, "localhost", 0))

        def held():
            with grpc.insecure_channel(f"localhost:{port}") as ch:
                result["out"] = generate(generation_pb2_grpc.GenerationStub(ch), generation_pb2.GenerateRequest(
                    text="def f(x):", params=common_pb2.SamplingParams(max_tokens=3, ignore_eos=True)), metadata=None)

        def stop():
            server.run(srv.stop(0))
    else:
        front = OpenAIFront(router, gated, limits, "target", chat_template=ChatTemplate(TEMPLATE))
        runner, port = server.run(_start_http(front))
        chat = path == "http-chat"
        body = ({"messages": [{"role": "user", "content": "def f(x):"}]} if chat else {"prompt": "def f(x):"})
        body.update(max_tokens=3, ignore_eos=True)

        def held():
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/{'chat/' if chat else ''}completions",
                                         data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as resp:
                result["out"] = json.loads(resp.read())["usage"]["completion_tokens"]

        def stop():
            server.run(runner.cleanup())
    worker = threading.Thread(target=held, daemon=True)
    try:
        worker.start()
        assert gated.entered.wait(30), "the request never reached the tokenizer"
        # The loop is free: health answers, and another request streams to its end.
        assert health(server.address) == health_pb2.HealthCheckResponse.SERVING
        still_serving(server)
        assert worker.is_alive() and "out" not in result
    finally:
        gated.gate.set()
        worker.join(60)
        stop()
    assert gated.threads and loop_thread not in gated.threads
    if path == "grpc":
        assert len(result["out"][0]) == 3 and result["out"][1] == "length"
    else:
        assert result["out"] == 3


# ------------------------------------------------------------------ malformed protobuf (item 9)

def _raw_generate(server, data: bytes, method: str = "Generate"):
    with grpc.insecure_channel(server.address) as ch:
        if method == "Generate":
            call = ch.unary_stream(f"/spectandem.v1.Generation/{method}")
            return list(call(data, metadata=AUTH, timeout=30))
        return ch.unary_unary(f"/spectandem.v1.Generation/{method}")(data, metadata=AUTH, timeout=30)


def _with_bytes(msg, placeholder: str, raw: bytes) -> bytes:
    """`msg` serialized, with the UTF-8 of `placeholder` replaced by `raw` (same length)."""
    assert len(placeholder.encode()) == len(raw)
    data = msg.SerializeToString()
    assert data.count(placeholder.encode()) == 1
    return data.replace(placeholder.encode(), raw)


P = "XXXXXX"
BAD = b"ab\xff\xfecd"
VALID = generation_pb2.GenerateRequest(text="def f(x):", params=common_pb2.SamplingParams(max_tokens=4)
                                       ).SerializeToString()
MALFORMED = {
    "prompt.text": _with_bytes(generation_pb2.GenerateRequest(text=P), P, BAD),
    "params.stop[1]": _with_bytes(generation_pb2.GenerateRequest(
        text="x", params=common_pb2.SamplingParams(max_tokens=4, stop=["ok", P, "fine"])), P, BAD),
    "request_id": _with_bytes(generation_pb2.GenerateRequest(request_id=P, text="x"), P, BAD),
    "truncated": VALID[:-3],
    "garbage": b"\xff\xff\xff\xff\xff",
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_requests_are_invalid_argument_naming_the_field(server, case):
    with pytest.raises(grpc.RpcError) as err:
        _raw_generate(server, MALFORMED[case])
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    if case in ("truncated", "garbage"):
        assert "not a valid spectandem.v1.GenerateRequest" in err.value.details()
    else:
        assert err.value.details() == f"{case} is not valid UTF-8"
    still_serving(server)


def test_malformed_model_info_request_is_invalid_argument(server):
    with pytest.raises(grpc.RpcError) as err:
        _raw_generate(server, b"\xff\xff\xff", "GetModelInfo")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid spectandem.v1.GetModelInfoRequest" in err.value.details()
    assert generation_pb2.ModelInfo.FromString(_raw_generate(server, b"", "GetModelInfo")).max_context == MAX_LEN


# ------------------------------------------------------------------ JSON bodies (item 9)

@pytest.mark.parametrize("raw, param", [
    ('{"prompt": "abc\\ud800def", "max_tokens": 4}', "prompt"),
    ('{"prompt": "abc", "max_tokens": 4, "stop": ["x", "\\udfff"]}', "stop"),
    ('{"prompt": ["\\ud83d"], "max_tokens": 4}', "prompt"),
])
def test_lone_surrogates_are_400_naming_the_field(server, raw, param):
    status, body = http(server, "/v1/completions", raw.encode())
    assert status == 400, body
    assert body["error"]["param"] == param and "lone surrogate" in body["error"]["message"]
    assert body["error"]["code"] == "INVALID_ARGUMENT"
    still_serving(server)


@pytest.mark.parametrize("depth", [100_000, MAX_JSON_DEPTH + 1])
def test_deeply_nested_json_is_400(server, depth):
    raw = '{"prompt": "abc", "max_tokens": 4, "extra": ' + "[" * depth + "]" * depth + "}"
    status, body = http(server, "/v1/completions", raw.encode())
    assert status == 400, body
    assert f"more than {MAX_JSON_DEPTH} levels" in body["error"]["message"]
    assert http(server, "/health")[0] == 200
    still_serving(server)


def test_json_at_the_depth_limit_is_accepted(server):
    nested = "[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1)
    raw = '{"prompt": "abc", "max_tokens": 2, "ignore_eos": true, "extra": ' + nested + "}"
    status, body = http(server, "/v1/completions", raw.encode())
    assert status == 200, body


# ------------------------------------------------------------------ seeds over uint64 (item 9)

@pytest.fixture(scope="module")
def reference():
    t, d = demo_paths("eagle3")
    return LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=4, max_len=MAX_LEN)


@pytest.mark.parametrize("seed", [2**64 - 1, 2**63])
def test_full_uint64_seed_is_reproducible_and_equals_the_reference(server, reference, seed):
    text = "def fib(n):"
    params = SamplingParams(max_tokens=16, temperature=0.9, seed=seed, ignore_eos=True)
    expected = reference.generate([reference.tokenizer.encode(text).ids], [params])[0].token_ids
    with Client(server.address, api_key=KEY, timeout=60) as c:
        first = c.generate(text, params).token_ids
        second = c.generate(text, params).token_ids
    assert first == second == expected
    status, body = http(server, "/v1/completions", {"prompt": text, "max_tokens": 16, "temperature": 0.9,
                                                    "seed": seed, "ignore_eos": True, "return_token_ids": True})
    assert status == 200 and body["choices"][0]["token_ids"] == expected
    # A different seed draws different tokens (the seed is not truncated on the way).
    other = reference.generate([reference.tokenizer.encode(text).ids],
                               [SamplingParams(max_tokens=16, temperature=0.9, seed=seed - 2**62, ignore_eos=True)])
    assert other[0].token_ids != expected


def test_seed_past_uint64_is_refused_naming_the_field(server):
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\), got 18446744073709551616"):
        SamplingParams(seed=2**64)
    with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64\)"):
        SamplingParams(seed=-1)
    for seed in (2**64, -1):
        status, body = http(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "seed": seed})
        assert status == 400 and body["error"]["param"] == "seed"
        assert "[0, 2**64)" in body["error"]["message"]


# ------------------------------------------------------------------ authorization (item 10)

NEAR_MISSES = ["bearer " + KEY, "BEARER " + KEY, "Bearer  " + KEY, "Bearer " + KEY + " ", "Bearer" + KEY,
               " Bearer " + KEY, "Bearer\t" + KEY, "Basic " + KEY, KEY, "Bearer " + KEY + "x", "Bearer " + KEY[:-1]]


def test_check_bearer_takes_exactly_bearer_space_key():
    assert check_bearer("Bearer " + KEY, KEY) is None
    for header in NEAR_MISSES:
        assert check_bearer(header, KEY) is not None, header
    assert "missing" in check_bearer(None, KEY) and "missing" in check_bearer("", KEY)


# grpc-python refuses to send a tab in a metadata value (INTERNAL "Invalid metadata", client side).
@pytest.mark.parametrize("header", [h for h in NEAR_MISSES if "\t" not in h])
def test_grpc_refuses_near_miss_authorization(server, header):
    req = generation_pb2.GenerateRequest(text="x", params=common_pb2.SamplingParams(max_tokens=2))
    with pytest.raises(grpc.RpcError) as err:
        generate(server, req, metadata=(("authorization", header),))
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value.details()


# In HTTP, whitespace around a header value is not part of the value (RFC 9110, 5.5): the parser
# drops it, so " Bearer KEY" and "Bearer KEY " arrive as the exact form.
@pytest.mark.parametrize("header", [h for h in NEAR_MISSES if h == h.strip()])
def test_http_refuses_near_miss_authorization(server, header):
    status, body = http(server, "/v1/completions", {"prompt": "x", "max_tokens": 2},
                        headers={"Authorization": header})
    assert status == 401 and body["error"]["code"] == "UNAUTHENTICATED"


def test_exact_bearer_is_accepted_on_both(server):
    still_serving(server)
    status, body = http(server, "/v1/completions", {"prompt": "x", "max_tokens": 2, "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 2


def test_full_uint64_seed_crosses_the_engine_wire_exactly():
    """The gRPC backend's engine messages carry a seed of 2**64 - 1 unchanged, to both engines."""
    from spectandem.protocol import DrafterPrefillItem, Tag, VerifierPrefillItem
    from spectandem import codec

    seed = 2**64 - 1
    params = SamplingParams(max_tokens=4, temperature=0.9, seed=seed)
    v = codec.verifier_prefill_item_from_msg(codec.verifier_prefill_item_to_msg(
        VerifierPrefillItem(Tag("r", 0, 3), [1, 2, 3], params, seed)))
    d = codec.drafter_prefill_item_from_msg(codec.drafter_prefill_item_to_msg(
        DrafterPrefillItem(Tag("r", 0, 4), [1, 2, 3], 5, params, seed, None)))
    assert v.seed == d.seed == v.params.seed == d.params.seed == seed
    assert SamplingParams(temperature=1.0).resolved_seed() < 2**64
