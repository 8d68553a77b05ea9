"""`spectandem serve --decode-ahead` through its public gRPC API, with every backend (the engines
in-process, as gRPC engine processes, as actors on a local Ray cluster), demo target, fp32 on the
CPU: greedy requests of several lengths at once give, token for token, what plain decoding gives
them alone (LocalSpeculator), and the verifier's decode-ahead counts reach the router the way a
user reads them, in its engine info, in GetServerStats (`spectandem stats`) and in /metrics
(spectandem:num_decode_ahead_taken_total), non-zero: the chunks queued after each call were taken. Without the flag (the CPU's default) the
verifier reports no decode ahead and the metric stays at 0."""

from __future__ import annotations

import threading
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.local import LocalSpeculator
from router.serve import free_port
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS
from spectandem.v1 import generation_pb2
from tests.router.conftest import RAY_CLUSTERS, Served, collect, request

MAX_TOKENS = (40, 23, 33, 40, 17, 29)


@pytest.fixture(scope="module")
def expected():
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=len(MAX_TOKENS), max_len=256)
    prompts = [plain.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(len(MAX_TOKENS))]
    outs = [plain.generate([p], [SamplingParams(max_tokens=m)])[0].token_ids for p, m in zip(prompts, MAX_TOKENS)]
    return prompts, outs


def _metric(server, name: str) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.state['metrics_port']}/metrics", timeout=10).read()
    for family in text_string_to_metric_families(text.decode()):
        for sample in family.samples:
            if sample.name == "spectandem:" + name:
                return sample.value
    raise AssertionError(f"/metrics has no spectandem:{name}")


def _run(backend: str, expected, *flags: str) -> tuple[dict, float]:
    """Serves the requests at once -> (the verifier's decode_ahead info, the taken counter of
    /metrics), once GetServerStats has been checked to agree with the info."""
    prompts, want = expected
    server = Served(["--backend", backend, "--method", "none", "--max-len", "256", "--max-running", "8",
                     "--plain-steps", "4", "--metrics-port", str(free_port()), *flags]).wait_ready(300)
    try:
        got: dict[int, list[int]] = {}

        def one(i):
            got[i] = collect(server.stub, request(ids=prompts[i], max_tokens=MAX_TOKENS[i]))[0]

        threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(180)
        assert [got.get(i) for i in range(len(prompts))] == want
        info = server.run(server.state["verifier"].info())
        stats = server.stub.GetServerStats(generation_pb2.GetServerStatsRequest(), timeout=30)
        assert (stats.decode_ahead_taken, stats.decode_ahead_forgotten) == (info.decode_ahead.get("taken", 0),
                                                                           info.decode_ahead.get("forgotten", 0))
        return info.decode_ahead, _metric(server, "num_decode_ahead_taken_total")
    finally:
        server.close()


def test_local_backend(expected):
    ahead, taken = _run("local", expected, "--decode-ahead")
    assert ahead["taken"] > 0 and taken == ahead["taken"]


def test_grpc_backend(expected):
    ahead, taken = _run("grpc", expected, "--decode-ahead")
    assert ahead["taken"] > 0 and taken == ahead["taken"]


@RAY_CLUSTERS
def test_ray_backend(expected):
    ahead, taken = _run("ray", expected, "--decode-ahead")
    assert ahead["taken"] > 0 and taken == ahead["taken"]


def test_off_by_default_on_the_cpu(expected):
    """The negative control: the same requests, no decode ahead, nothing counted."""
    ahead, taken = _run("local", expected)
    assert ahead == {} and taken == 0
