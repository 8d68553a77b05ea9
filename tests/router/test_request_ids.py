"""Request ids: one in use by a request that has not ended is refused alone and at once
(ALREADY_EXISTS over gRPC, 409 over HTTP), every other request unharmed; an id is free again
the moment its request has ended. And an engine's refusal of one request at admission fails
that request alone, never the batch."""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request

import grpc
import pytest

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Failure, Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from router.serve import free_port
from tests.router.conftest import Served, collect, request


@pytest.fixture(scope="module")
def server():
    port = free_port()
    s = Served(["--backend", "local", "--max-len", "256", "--max-running", "8", "--http-port", str(port)]).wait_ready()
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference():
    t, d = demo_paths("eagle3")
    return LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)


def _with_id(req, request_id: str):
    req.request_id = request_id
    return req


def _stream_in_thread(stub, req, started: threading.Event, out: dict, key):
    def run():
        toks = []
        try:
            for chunk in stub.Generate(req, timeout=120):
                toks += list(chunk.token_ids)
                started.set()
            out[key] = toks
        except grpc.RpcError as exc:
            out[key] = exc
            started.set()
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_an_id_in_use_is_refused_alone_over_grpc(server, reference):
    prompts = [reference.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(3)]
    want = reference.generate(prompts, [SamplingParams(max_tokens=150, ignore_eos=True)] * 3)
    out: dict = {}
    started = [threading.Event() for _ in prompts]
    threads = [_stream_in_thread(server.stub, _with_id(request(ids=p, max_tokens=150, ignore_eos=True), f"id-{i}"),
                                 started[i], out, i) for i, p in enumerate(prompts)]
    for e in started:
        assert e.wait(60)
    with pytest.raises(grpc.RpcError) as err:
        collect(server.stub, _with_id(request(ids=prompts[0], max_tokens=5), "id-0"), timeout=30)
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "request_id" in err.value.details() and "id-0" in err.value.details()
    for t in threads:
        t.join(150)
        assert not t.is_alive()
    for i in range(3):
        assert out[i] == want[i].token_ids, out[i]
    # Ended: the id is free again at once, for a request that runs to its end.
    toks, _, reason, _ = collect(server.stub, _with_id(request(ids=prompts[0], max_tokens=150, ignore_eos=True),
                                                       "id-0"))
    assert toks == want[0].token_ids and reason == "length"


def _post(port: int, body: dict, request_id: str):
    req = urllib.request.Request(f"http://localhost:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_an_id_in_use_is_refused_alone_over_http(server, reference):
    port = server.state["http_port"]
    prompt = PROMPT_TEXTS[3]
    want = reference.generate([reference.tokenizer.encode(prompt).ids], [SamplingParams(max_tokens=150,
                                                                                         ignore_eos=True)])[0]
    started, out = threading.Event(), {}
    t = _stream_in_thread(server.stub, _with_id(request(text=prompt, max_tokens=150, ignore_eos=True), "http-1"),
                          started, out, "grpc")
    assert started.wait(60)
    status, body = _post(port, {"model": "target", "prompt": prompt, "max_tokens": 5}, "http-1")
    assert status == 409, body
    assert "request_id" in body["error"]["message"] and body["error"]["code"] == "ALREADY_EXISTS"
    t.join(150)
    assert out["grpc"] == want.token_ids
    status, body = _post(port, {"model": "target", "prompt": prompt, "max_tokens": 5, "temperature": 0}, "http-1")
    assert status == 200 and body["choices"][0]["finish_reason"] == "length"


class RefusesOne(LocalVerifierLink):
    """Router-logic fake: the real in-process verifier, except that it refuses (ValueError, as an
    engine refuses bad input) any prefill batch holding the request id `bad`."""

    def __init__(self, engine, bad: str):
        super().__init__(engine)
        self.bad = bad

    async def prefill(self, items, want_features):
        if any(i.tag.request_id == self.bad for i in items):
            raise ValueError(f"request id {self.bad!r} refused")
        return await super().prefill(items, want_features)


def test_a_request_the_verifier_refuses_fails_alone(reference):
    prompts = [reference.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(4)]
    want = reference.generate(prompts, [SamplingParams(max_tokens=24)] * 4)

    async def main():
        spec = reference
        router = Router(RefusesOne(spec.verifier, "r2"), LocalDrafterLink(spec.drafter), spec.tokenizer,
                        RouterConfig(max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead,
                                     want_features=True, pipeline="sequential"))
        router.start()
        try:
            reqs = [router.submit(p, SamplingParams(max_tokens=24), f"r{i}") for i, p in enumerate(prompts)]

            async def drain(req):
                toks = []
                while True:
                    ev = await asyncio.wait_for(req.events.get(), 60)
                    if isinstance(ev, Failure):
                        return ev
                    toks += ev.token_ids
                    if ev.finish_reason:
                        return toks
            return await asyncio.gather(*(drain(r) for r in reqs))
        finally:
            await router.stop()

    got = asyncio.run(main())
    assert isinstance(got[2], Failure) and got[2].code == "INVALID_ARGUMENT" and "r2" in got[2].message
    for i in (0, 1, 3):
        assert got[i] == want[i].token_ids
    assert not reference.verifier.requests and not reference.drafter.requests
