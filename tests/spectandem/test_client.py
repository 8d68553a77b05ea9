"""The client SDK and `spectandem generate --address` against a scripted fake Generation server.

The fake is a grpc.aio server on its own event loop in a background thread, with
grpc.health.v1; each test gives it a script: one list of steps per Generate call, where a step is
a response to send, a pause, or a status to abort with.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from spectandem import AsyncClient, Client, Completion, SamplingParams
from spectandem.client import (GENERATION_SERVICE, Chunk, DeadlineExceeded, InvalidArgument, SpectandemError,
                               Unavailable)
from spectandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
STATS = common_pb2.SpecStats(num_rounds=3, draft_tokens=12, accepted_tokens=4, accept_length=7 / 3,
                             fallback_rounds=1, plain_rounds=2)
EXPECTED_STATS = {"num_rounds": 3, "draft_tokens": 12, "accepted_tokens": 4, "accept_length": 2.3333,
                  "fallback_rounds": 1, "plain_rounds": 2, "prompt_tokens": 5}


def ok_script(request_id: str = "req-1") -> list:
    """A three-chunk completion: 'Hello' 'world' '!' = tokens [1, 2] [3] [4, 5, 6, 7]."""
    R = generation_pb2.GenerateResponse
    return [R(request_id=request_id, token_ids=[1, 2], text="Hello", prompt_tokens=5),
            R(request_id=request_id, token_ids=[3], text=" world"),
            R(request_id=request_id, token_ids=[4, 5, 6, 7], text="!", finish_reason="length", stats=STATS)]


def fail(code: grpc.StatusCode, details: str = "scripted failure") -> tuple:
    return ("abort", code, details)


def pause(seconds: float) -> tuple:
    return ("sleep", seconds)


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    """Plays `scripts[i]` for the i-th Generate call (the last script repeats) and records requests."""

    def __init__(self):
        self.reset([ok_script()])

    def reset(self, scripts: list[list]) -> None:
        self.scripts = scripts
        self.requests: list[generation_pb2.GenerateRequest] = []
        self.cancelled = threading.Event()

    async def Generate(self, request, context):
        self.requests.append(request)
        script = self.scripts[min(len(self.requests), len(self.scripts)) - 1]
        try:
            for step in script:
                if isinstance(step, generation_pb2.GenerateResponse):
                    yield step
                elif step[0] == "sleep":
                    await asyncio.sleep(step[1])
                else:
                    await context.abort(step[1], step[2])
        except (asyncio.CancelledError, GeneratorExit):
            # A client that leaves: grpc.aio cancels the handler where it awaits inside this
            # generator (CancelledError), or closes the generator where the cancel lands while a
            # chunk is being written (GeneratorExit at the yield).
            self.cancelled.set()
            raise

    async def GetModelInfo(self, request, context):
        return generation_pb2.ModelInfo(target_model="tiny-target", method="eagle3", num_steps=4, topk=1,
                                        num_draft_tokens=5, max_context=2048, vocab_size=32000, backend="local")


class FakeServer:
    def __init__(self):
        self.fake = FakeGeneration()
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        assert self._started.wait(10), "fake server did not start"
        self.address = f"127.0.0.1:{self.port}"

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._start())
        self._started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.server = grpc.aio.server()
        generation_pb2_grpc.add_GenerationServicer_to_server(self.fake, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        await self.health.set(GENERATION_SERVICE, health_pb2.HealthCheckResponse.SERVING)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()

    def set_health(self, status) -> None:
        asyncio.run_coroutine_threadsafe(self.health.set(GENERATION_SERVICE, status), self.loop).result(5)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(None), self.loop).result(5)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def server():
    s = FakeServer()
    yield s
    s.stop()


@pytest.fixture
def fake(server):
    server.fake.reset([ok_script()])
    server.set_health(health_pb2.HealthCheckResponse.SERVING)
    return server.fake


def expected_completion(request_id: str = "req-1") -> Completion:
    return Completion(request_id=request_id, text="Hello world!", token_ids=[1, 2, 3, 4, 5, 6, 7],
                      finish_reason="length", stats=EXPECTED_STATS)


def test_generate_collects_the_stream(server, fake):
    params = SamplingParams(max_tokens=7, temperature=0.7, top_p=0.9, top_k=20, seed=11, stop_token_ids=(2,),
                            stop=("\n\n",))
    with Client(server.address, timeout=5) as client:
        assert client.generate("Hi there", params, request_id="req-1") == expected_completion()
    (req,) = fake.requests
    assert req.request_id == "req-1" and req.WhichOneof("prompt") == "text" and req.text == "Hi there"
    p = req.params
    assert (p.max_tokens, p.top_k, list(p.stop_token_ids), list(p.stop)) == (7, 20, [2], ["\n\n"])
    assert p.temperature == pytest.approx(0.7) and p.top_p == pytest.approx(0.9)
    assert p.HasField("seed") and p.seed == 11


def test_token_prompt_and_default_params(server, fake):
    with Client(server.address, timeout=5) as client:
        client.generate([5, 6, 7])
    (req,) = fake.requests
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == [5, 6, 7]
    assert req.params.max_tokens == SamplingParams().max_tokens
    assert not req.params.HasField("seed")  # unset: the server draws one
    with Client(server.address) as client, pytest.raises(TypeError, match="prompt"):
        client.stream(b"bytes")


def test_stream_yields_chunks_in_order(server, fake):
    with Client(server.address, timeout=5) as client:
        chunks = list(client.stream("Hi"))
    assert [c.token_ids for c in chunks] == [[1, 2], [3], [4, 5, 6, 7]]
    assert [c.text for c in chunks] == ["Hello", " world", "!"]
    assert [c.finish_reason for c in chunks] == [None, None, "length"]
    assert chunks[0].stats is None and chunks[-1].stats == EXPECTED_STATS
    assert Completion.from_chunks(chunks) == expected_completion()


def test_async_stream_and_generate(server, fake):
    async def main():
        async with AsyncClient(server.address, timeout=5) as client:
            chunks = [c async for c in client.stream("Hi")]
            completion = await client.generate("Hi")
            info = await client.model_info()
            await client.wait_for_ready(2)
        return chunks, completion, info

    chunks, completion, info = asyncio.run(main())
    assert [c.token_ids for c in chunks] == [[1, 2], [3], [4, 5, 6, 7]]
    assert completion == expected_completion()
    assert info["method"] == "eagle3" and info["max_context"] == 2048


def test_model_info(server, fake):
    with Client(server.address, timeout=5) as client:
        info = client.model_info()
    assert info["target_model"] == "tiny-target" and info["num_draft_tokens"] == 5 and info["fused"] is False


def test_unavailable_before_first_chunk_is_retried(server, fake):
    fake.reset([[fail(grpc.StatusCode.UNAVAILABLE)], [fail(grpc.StatusCode.UNAVAILABLE)], ok_script()])
    with Client(server.address, timeout=5, max_retries=3) as client:
        assert client.generate("Hi") == expected_completion()
    assert len(fake.requests) == 3


def test_async_unavailable_before_first_chunk_is_retried(server, fake):
    fake.reset([[fail(grpc.StatusCode.UNAVAILABLE)], [fail(grpc.StatusCode.UNAVAILABLE)], ok_script()])

    async def main():
        async with AsyncClient(server.address, timeout=5) as client:
            return await client.generate("Hi")

    assert asyncio.run(main()) == expected_completion()
    assert len(fake.requests) == 3


def test_retries_are_bounded(server, fake):
    fake.reset([[fail(grpc.StatusCode.UNAVAILABLE, "draining")]])
    with Client(server.address, timeout=5, max_retries=1) as client, pytest.raises(Unavailable, match="draining"):
        client.generate("Hi")
    assert len(fake.requests) == 2


def test_unavailable_after_a_chunk_is_not_retried(server, fake):
    first = ok_script()[0]
    fake.reset([[first, fail(grpc.StatusCode.UNAVAILABLE, "verifier lost")], ok_script()])
    seen: list[Chunk] = []
    with Client(server.address, timeout=5, max_retries=3) as client:
        with pytest.raises(Unavailable, match="verifier lost") as info:
            for chunk in client.stream("Hi"):
                seen.append(chunk)
        with pytest.raises(Unavailable):
            fake.reset([[first, fail(grpc.StatusCode.UNAVAILABLE, "verifier lost")], ok_script()])
            client.generate("Hi")
    assert [c.token_ids for c in seen] == [[1, 2]]  # delivered once, never repeated
    assert len(fake.requests) == 1
    assert info.value.code == grpc.StatusCode.UNAVAILABLE


def test_invalid_argument_maps_to_its_class(server, fake):
    fake.reset([[fail(grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be >= 1, got 0")]])
    with Client(server.address, timeout=5) as client, pytest.raises(InvalidArgument) as info:
        client.generate("Hi")
    assert isinstance(info.value, SpectandemError)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details == "max_tokens must be >= 1, got 0"
    assert len(fake.requests) == 1  # not retried


def test_deadline_shorter_than_the_server(server, fake):
    fake.reset([[pause(2.0)] + ok_script()])
    with Client(server.address, timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(DeadlineExceeded):
            client.generate("Hi")
        assert time.monotonic() - start < 1.5
        fake.reset([[pause(0.5)] + ok_script()])
        assert client.generate("Hi", timeout=5) == expected_completion()  # the per-call override wins


def test_async_deadline(server, fake):
    fake.reset([[pause(2.0)] + ok_script()])

    async def main():
        async with AsyncClient(server.address) as client:
            await client.generate("Hi", timeout=0.3)

    with pytest.raises(DeadlineExceeded):
        asyncio.run(main())


def test_leaving_a_stream_early_cancels_the_request(server, fake):
    fake.reset([ok_script()[:1] + [pause(5.0)] + ok_script()[1:]])
    with Client(server.address, timeout=10) as client:
        stream = client.stream("Hi")
        next(stream)
        stream.close()
        assert fake.cancelled.wait(3)


def test_wait_for_ready_waits_for_serving(server, fake):
    server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    threading.Timer(0.4, server.set_health, args=(health_pb2.HealthCheckResponse.SERVING,)).start()
    with Client(server.address) as client:
        start = time.monotonic()
        client.wait_for_ready(5)
        assert time.monotonic() - start >= 0.3
    server.set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
    with Client(server.address) as client, pytest.raises(DeadlineExceeded, match="NOT_SERVING"):
        client.wait_for_ready(0.4)


def test_wait_for_ready_keeps_trying_an_unreachable_server():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with Client(f"127.0.0.1:{port}") as client, pytest.raises(DeadlineExceeded):
        client.wait_for_ready(0.5)


def test_import_spectandem_is_cheap():
    code = ("import sys, spectandem; assert 'torch' not in sys.modules and 'grpc' not in sys.modules; "
            "from spectandem import Client, AsyncClient, SamplingParams, Completion; "
            "assert 'torch' not in sys.modules; print(Client.__module__)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "spectandem.client"


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "spectandem.cli", "generate", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=30)


def test_cli_generate_address_json(server, fake):
    out = _cli("Hi there", "--address", server.address, "--json", "--max-tokens", "7", "--seed", "3",
               "--timeout", "10")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == {"text": "Hello world!", "token_ids": [1, 2, 3, 4, 5, 6, 7],
                                      "finish_reason": "length", "stats": EXPECTED_STATS}
    (req,) = fake.requests
    assert req.text == "Hi there" and req.params.max_tokens == 7 and req.params.seed == 3


def test_cli_generate_stream_json_and_errors(server, fake):
    out = _cli("Hi", "--address", server.address, "--stream", "--json")
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    assert [line["text"] for line in lines] == ["Hello", " world", "!", "Hello world!"]
    assert lines[2]["finish_reason"] == "length" and lines[-1]["stats"] == EXPECTED_STATS

    fake.reset([[fail(grpc.StatusCode.INVALID_ARGUMENT, "prompt is empty")]])
    out = _cli("", "--address", server.address)
    assert out.returncode == 1 and "INVALID_ARGUMENT: prompt is empty" in out.stderr


def test_channels_try_to_connect_again_within_a_second():
    """The SDK's channels and the router's channels to its engines pace their reconnect tries
    (0.1 s, growing to at most 1 s) instead of gRPC's own backoff (1 s growing to 120 s), under
    which a server that came up 7 s after a channel's first try was seen 1.8 s late, and one back
    from a long outage up to two minutes late. A caller's own value for one of them wins."""
    from spectandem.client_wire import RECONNECT_OPTIONS
    from spectandem.grpc_server import CHANNEL_OPTIONS, LINK_CHANNEL_OPTIONS

    settings = dict(RECONNECT_OPTIONS)
    assert settings["grpc.max_reconnect_backoff_ms"] <= 1000 and settings["grpc.initial_reconnect_backoff_ms"] <= 100
    assert set(RECONNECT_OPTIONS) <= set(LINK_CHANNEL_OPTIONS) and set(CHANNEL_OPTIONS) <= set(LINK_CHANNEL_OPTIONS)
    with Client("localhost:1") as client:
        assert set(RECONNECT_OPTIONS) <= set(client._options)
    mine = ("grpc.max_reconnect_backoff_ms", 5000)
    with Client("localhost:1", options=[mine]) as client:
        assert mine in client._options and dict(client._options)["grpc.max_reconnect_backoff_ms"] == 5000
        assert len([k for k, _ in client._options if k == "grpc.max_reconnect_backoff_ms"]) == 1
    import router.links_grpc as links

    assert links.LINK_CHANNEL_OPTIONS is LINK_CHANNEL_OPTIONS
