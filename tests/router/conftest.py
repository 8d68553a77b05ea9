"""A served router in a background thread, for end-to-end tests over real gRPC; the link tests'
prompts (token ids)."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest

from spectandem.checkpoint import load_tokenizer
from spectandem.demo import demo_paths
from spectandem.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from tests.router.link_harness import PROMPT_TEXTS

# The tests that use Ray (a local cluster, or `spectandem serve` starting one) share one xdist
# group: they run one after another in one worker, so two clusters never start at once on a
# 2-core machine. Mark the tests, not their modules: a module's gRPC and in-process tests then run
# on the other worker meanwhile.
RAY_CLUSTERS = pytest.mark.xdist_group("ray")


class Served:
    def __init__(self, argv: list[str], configure=None):
        """`configure(args)`, when given, runs on the parsed flags before the server starts: a
        benchmark in this process passes serve's process-wide settings (router/serve.py
        configure_process) there, as `spectandem serve` makes them; tests leave the process as it is."""
        from router.serve import serve_async
        from spectandem.cli import build_parser

        # The HTTP front and metrics are off unless a test asks (their fixed default ports would
        # collide between concurrent test runs); later flags in argv win. IPv4 only: "localhost"
        # binds 127.0.0.1 and ::1 at one port where both are free, and where another test's server
        # holds the port on one of them, a client of "localhost" could reach that server instead.
        self.args = build_parser().parse_args(["serve", "--host", "127.0.0.1", "--port", "0", "--http-port", "0",
                                               "--metrics-port", "0", *argv])
        if configure is not None:
            configure(self.args)
        self.state: dict = {}
        self.loop = asyncio.new_event_loop()
        self.stop = None
        self.error = None

        def run():
            asyncio.set_event_loop(self.loop)
            self.stop = asyncio.Event()
            try:
                self.loop.run_until_complete(serve_async(self.args, ready_message=False, stop_event=self.stop,
                                                         state=self.state))
            except BaseException as exc:  # surfaced by wait_ready
                self.error = exc

        self.thread = threading.Thread(target=run, name="served-event-loop", daemon=True)
        self.thread.start()

    def wait_ready(self, timeout: float = 180.0) -> "Served":
        deadline = time.monotonic() + timeout
        while "port" not in self.state:
            if self.error is not None:
                raise self.error
            if time.monotonic() > deadline:
                raise TimeoutError("server did not come up")
            time.sleep(0.1)
        self.address = f"{self.args.host}:{self.state['port']}"
        self.channel = grpc.insecure_channel(self.address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        return self

    def run(self, coro):
        """Runs a coroutine on the server's loop (to inspect router state safely)."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(60)

    def slots_in_use(self) -> tuple[int, int]:
        async def q():
            v = (await self.state["verifier"].info()).used_slots
            d = (await self.state["drafter"].info()).used_slots if self.state["drafter"] else 0
            return v, d
        return self.run(q())

    def close(self):
        self.channel.close()
        self.loop.call_soon_threadsafe(self.stop.set)
        self.thread.join(240)
        # The next server must not start while this one still holds engines (a Ray placement group).
        assert not self.thread.is_alive(), "the server did not shut down in 240 s"


def request(text=None, ids=None, **params) -> generation_pb2.GenerateRequest:
    p = common_pb2.SamplingParams(**params)
    if ids is not None:
        return generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids), params=p)
    return generation_pb2.GenerateRequest(text=text, params=p)


def collect(stub, req, timeout=120) -> tuple[list[int], str, str, object]:
    toks, text, reason, stats = [], "", "", None
    for chunk in stub.Generate(req, timeout=timeout):
        toks += list(chunk.token_ids)
        text += chunk.text
        if chunk.finish_reason:
            reason, stats = chunk.finish_reason, chunk.stats
    return toks, text, reason, stats


@pytest.fixture(scope="module")
def local_server():
    s = Served(["--backend", "local", "--max-len", "512", "--max-running", "64"]).wait_ready()
    yield s
    s.close()


@pytest.fixture(scope="module")
def prompt_texts() -> list[str]:
    """The texts `prompts` encodes; a module that needs another list (or order) overrides this."""
    return PROMPT_TEXTS


@pytest.fixture(scope="module")
def prompts(prompt_texts) -> list[list[int]]:
    tok = load_tokenizer(demo_paths("none")[0])
    return [tok.encode(t).ids for t in prompt_texts]
