"""The OpenAI-compatible HTTP front, answered through the official `openai` client: the same
tokens as the gRPC API (streaming or not), OpenAI-style errors naming the field, chat only with a
chat template, and a disconnect that stops the request."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request

import openai
import pytest

from router.openai_http import OpenAIFront
from router.openai_protocol import ChatTemplate
from router.ops import start_http
from router.server import Limits
from tests.e2e.conftest import PROMPT_TEXTS
from router.serve import free_port
from tests.router.conftest import Served, collect, request

TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


@pytest.fixture(scope="module")
def server():
    port = free_port()  # /metrics shares the HTTP front's port
    s = Served(["--backend", "local", "--max-len", "256", "--max-running", "8",
                "--http-port", str(port), "--metrics-port", str(port)]).wait_ready()
    yield s
    s.close()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"http://localhost:{server.state['http_port']}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


def grpc_result(server, **kw):
    toks, text, reason, _ = collect(server.stub, request(**kw))
    return toks, text, reason


def test_models(client):
    models = client.models.list().data
    assert [m.id for m in models] == ["target"]


def test_completion_equals_grpc(server, client):
    for i, prompt in enumerate(PROMPT_TEXTS[:3]):
        toks, text, reason = grpc_result(server, text=prompt, max_tokens=20)
        got = client.completions.create(model="target", prompt=prompt, max_tokens=20, temperature=0,
                                        extra_body={"return_token_ids": True})
        c = got.choices[0]
        assert (c.text, c.finish_reason) == (text, reason), i
        assert c.model_extra["token_ids"] == toks
        assert got.usage.completion_tokens == len(toks)
        assert got.usage.prompt_tokens == len(c.model_extra["prompt_token_ids"])


def test_streaming_equals_grpc(server, client):
    toks, text, reason = grpc_result(server, text=PROMPT_TEXTS[3], max_tokens=30, ignore_eos=True)
    chunks = list(client.completions.create(model="target", prompt=PROMPT_TEXTS[3], max_tokens=30, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "return_token_ids": True}))
    body = [c for c in chunks if c.choices]
    assert len(body) > 1  # it really streamed
    assert "".join(c.choices[0].text for c in body) == text
    assert [t for c in body for t in c.choices[0].model_extra["token_ids"]] == toks
    assert body[-1].choices[0].finish_reason == reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert chunks[-1].usage.completion_tokens == 30


def test_token_prompt_sampling_and_stop_equal_grpc(server, client):
    ids = server.state["router"].tokenizer.encode(PROMPT_TEXTS[4]).ids
    toks, text, _ = grpc_result(server, ids=ids, max_tokens=24, temperature=0.9, top_p=0.95, top_k=20, seed=11)
    got = client.completions.create(model="target", prompt=ids, max_tokens=24, temperature=0.9, top_p=0.95, seed=11,
                                    extra_body={"top_k": 20, "return_token_ids": True})
    assert got.choices[0].model_extra["token_ids"] == toks and got.choices[0].text == text
    full = grpc_result(server, text=PROMPT_TEXTS[0], max_tokens=40)[1]
    stop = full[10:14]
    cut = grpc_result(server, text=PROMPT_TEXTS[0], max_tokens=40, stop=[stop])
    got = client.completions.create(model="target", prompt=PROMPT_TEXTS[0], max_tokens=40, temperature=0, stop=stop)
    assert (got.choices[0].text, got.choices[0].finish_reason) == (cut[1], "stop")


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens=-3), "max_tokens"),
    (dict(temperature=-1), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(max_tokens=300), "max_tokens"),                  # prompt + max_tokens past the 256 context
    (dict(prompt="word " * 300), "prompt"),                # the prompt alone is past the context
    (dict(prompt=[10, 99999999]), "prompt"),               # outside the vocabulary
    (dict(stop=["x"] * 17), "stop"),
    (dict(n=2), "n"),
    (dict(logprobs=2), "logprobs"),
    (dict(extra_body={"top_k": -5}), "top_k"),
])
def test_errors_are_400_naming_the_field(server, client, kwargs, param):
    args = dict(model="target", prompt="Hello", max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400
    body = err.value.body
    assert body["param"] == param and body["type"] == "invalid_request_error" and body["code"] == "INVALID_ARGUMENT"
    assert param in body["message"]


def test_grpc_and_http_refuse_alike(server, client):
    import grpc

    with pytest.raises(grpc.RpcError) as g:
        collect(server.stub, request(text="Hello", max_tokens=4, top_p=1.5))
    with pytest.raises(openai.BadRequestError) as h:
        client.completions.create(model="target", prompt="Hello", max_tokens=4, top_p=1.5)
    assert g.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert h.value.body["message"] == g.value.details().removeprefix("params.")


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="Hello", max_tokens=4)
    assert err.value.body["param"] == "model"


def test_chat_without_template_is_refused(client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hi"}])
    assert "no chat template" in err.value.body["message"]


def test_chat_with_template_equals_grpc(server):
    """A second front on the same router, for a model whose tokenizer_config.json has a template."""
    from spectandem.v1 import generation_pb2

    router = server.state["router"]
    info = server.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    front = OpenAIFront(router, router.tokenizer, Limits(max_context=info.max_context, vocab_size=info.vocab_size),
                        "target", chat_template=ChatTemplate(TEMPLATE))
    runner, port = server.run(start_http(front.app(), "localhost", 0))
    try:
        messages = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def add(a, b):"}]
        rendered = "<|system|>You write Python.\n<|user|>def add(a, b):\n<|assistant|>"
        ids = router.tokenizer.encode(rendered, add_special_tokens=False).ids
        toks, text, reason = grpc_result(server, ids=ids, max_tokens=16)
        with openai.OpenAI(base_url=f"http://localhost:{port}/v1", api_key="unused", max_retries=0) as c:
            got = c.chat.completions.create(model="target", messages=messages, max_completion_tokens=16,
                                            temperature=0)
            assert got.choices[0].message.content == text and got.choices[0].message.role == "assistant"
            assert got.usage.prompt_tokens == len(ids) and got.choices[0].finish_reason == reason
            chunks = list(c.chat.completions.create(model="target", messages=messages, max_tokens=16, temperature=0,
                                                    stream=True))
            assert chunks[0].choices[0].delta.role == "assistant"
            assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == text
            with pytest.raises(openai.BadRequestError) as err:
                c.chat.completions.create(model="target", messages=[], max_tokens=4)
            assert err.value.body["param"] == "messages"
    finally:
        server.run(runner.cleanup())


def test_disconnect_mid_stream_cancels(server, client):
    router = server.state["router"]
    cancelled = router.counters.requests_cancelled
    stream = client.completions.create(model="target", prompt=PROMPT_TEXTS[1], max_tokens=240, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 10
    while (router.num_active or router.counters.requests_cancelled == cancelled) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert router.num_active == 0 and router.counters.requests_cancelled == cancelled + 1


def test_health_and_shared_metrics_port(server):
    base = f"http://localhost:{server.state['http_port']}"
    assert json.loads(urllib.request.urlopen(base + "/health", timeout=10).read()) == {"status": "ok"}
    metrics = urllib.request.urlopen(base + "/metrics", timeout=10).read().decode()
    assert "spectandem:num_requests_finished_total" in metrics
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(base + "/v1/nothing", timeout=10)
    assert err.value.code == 404 and "error" in json.loads(err.value.read())
