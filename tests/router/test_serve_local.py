"""The router and public API over real gRPC, engines in the server's process (local backend):
exactness against the reference loop, concurrency, cancellation, deadlines and bad input."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.v1 import generation_pb2
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import collect, request


@pytest.fixture(scope="module")
def reference():
    t, d = demo_paths("eagle3")
    return LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=64, max_len=512)


def _wait_idle(server, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.slots_in_use() == (0, 0) and server.state["router"].num_active == 0:
            return True
        time.sleep(0.05)
    return False


def test_greedy_and_seeded_equal_reference(local_server, reference):
    prompts = [reference.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:6]]
    greedy = reference.generate(prompts, [SamplingParams(max_tokens=24)] * 6)
    sampled = reference.generate(prompts, [SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7 + i)
                                           for i in range(6)])
    for p, g, s, i in zip(prompts, greedy, sampled, range(6)):
        assert collect(local_server.stub, request(ids=p, max_tokens=24))[0] == g.token_ids
        got = collect(local_server.stub, request(ids=p, max_tokens=24, temperature=0.9, top_p=0.95, seed=7 + i))
        assert got[0] == s.token_ids
        assert got[2] == s.finish_reason and got[3].num_rounds == s.stats.num_rounds
    # The in-process links report their engines' calls as the engine services do (EngineInfo.calls).
    vinfo = local_server.run(local_server.state["verifier"].info())
    dinfo = local_server.run(local_server.state["drafter"].info())
    for info, kinds in ((vinfo, {"prefill", "verify"}), (dinfo, {"prefill", "draft"})):
        assert kinds <= set(info.calls["count"]), info.calls
        assert all(info.calls["count"][k] > 0 and info.calls["busy_s"][k] > 0 for k in kinds), info.calls


def test_64_concurrent_streams(local_server, reference):
    prompts = [reference.tokenizer.encode(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]).ids for i in range(64)]
    expected = reference.generate(prompts, [SamplingParams(max_tokens=16)] * 64)
    results: dict[int, list[int]] = {}

    def worker(i):
        toks, _, reason, _ = collect(local_server.stub, request(ids=prompts[i], max_tokens=16))
        results[i] = toks

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert len(results) == 64
    for i in range(64):
        assert results[i] == expected[i].token_ids, i
    assert _wait_idle(local_server)


def test_text_streaming_and_stop_strings(local_server, reference):
    prompt = PROMPT_TEXTS[0]
    full = collect(local_server.stub, request(text=prompt, max_tokens=40))
    assert full[1] == reference.tokenizer.decode(full[0])
    stop = full[1][10:14]
    cut = collect(local_server.stub, request(text=prompt, max_tokens=40, stop=[stop]))
    assert cut[2] == "stop" and cut[1] == full[1][: full[1].index(stop)]


def test_cancel_mid_stream_releases_both_sides(local_server):
    call = local_server.stub.Generate(request(text=PROMPT_TEXTS[1], max_tokens=400, ignore_eos=True))
    first = next(call)
    assert first.token_ids
    call.cancel()
    assert _wait_idle(local_server)


def test_deadline_mid_stream_releases_both_sides(local_server):
    with pytest.raises(grpc.RpcError) as err:
        collect(local_server.stub, request(text=PROMPT_TEXTS[2], max_tokens=450, ignore_eos=True), timeout=0.3)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert _wait_idle(local_server)


BAD = [
    (request(text="", max_tokens=5), "prompt.text"),
    (generation_pb2.GenerateRequest(), "prompt"),
    (request(ids=[1] * 600, max_tokens=5), "context"),
    (request(text="x", max_tokens=0), "params.max_tokens"),
    (request(text="x", max_tokens=600), "params.max_tokens"),
    (request(text="x", max_tokens=5, temperature=-1.0), "params.temperature"),
    (request(text="x", max_tokens=5, temperature=float("nan")), "params.temperature"),
    (request(text="x", max_tokens=5, temperature=float("inf")), "params.temperature"),
    (request(text="x", max_tokens=5, top_p=0.0), "params.top_p"),
    (request(text="x", max_tokens=5, top_p=1.5), "params.top_p"),
    (request(text="x", max_tokens=5, top_k=-3), "params.top_k"),
    (request(ids=[5, 99999], max_tokens=5), "prompt.token_ids[1]"),
    (request(text="x", max_tokens=5, stop=[f"s{i}" for i in range(17)]), "params.stop"),
    (request(text="x", max_tokens=5, stop=[""]), "params.stop[0]"),
]


@pytest.mark.parametrize("req,field", BAD, ids=[f for _, f in BAD])
def test_bad_input_is_invalid_argument(local_server, req, field):
    with pytest.raises(grpc.RpcError) as err:
        collect(local_server.stub, req)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in err.value.details()


def test_oversized_message_and_server_stays_up(local_server):
    with pytest.raises(grpc.RpcError) as err:
        collect(local_server.stub, request(text="x" * (5 * 1024 * 1024), max_tokens=5))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    toks, _, reason, _ = collect(local_server.stub, request(text="def f():", max_tokens=4))
    assert len(toks) == 4 and reason == "length"
    assert _wait_idle(local_server)


def test_health_and_reflection(local_server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    health = health_pb2_grpc.HealthStub(local_server.channel)
    for name in ("", "spectandem.v1.Generation"):
        assert health.Check(health_pb2.HealthCheckRequest(service=name)).status == health_pb2.HealthCheckResponse.SERVING
    refl = reflection_pb2_grpc.ServerReflectionStub(local_server.channel)
    resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
    names = {s.name for s in resp.list_services_response.service}
    assert "spectandem.v1.Generation" in names and "grpc.health.v1.Health" in names
    info = local_server.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
    assert info.method == "eagle3" and info.max_context == 512 and info.vocab_size == 4096


def test_sdk_against_real_router(local_server, reference):
    import asyncio

    from spectandem import AsyncClient, Client, SamplingParams as SP

    prompt = PROMPT_TEXTS[3]
    ids = reference.tokenizer.encode(prompt).ids
    expected = reference.generate([ids], [SP(max_tokens=20)])[0]
    with Client(local_server.address, timeout=60) as client:
        client.wait_for_ready(30)
        done = client.generate(prompt, SP(max_tokens=20))
        assert done.token_ids == expected.token_ids and done.finish_reason == expected.finish_reason
        assert done.text == reference.tokenizer.decode(expected.token_ids)
        chunks = list(client.stream(ids, SP(max_tokens=20)))
        assert [t for c in chunks for t in c.token_ids] == expected.token_ids
        assert client.model_info()["method"] == "eagle3"

    async def run():
        async with AsyncClient(local_server.address, timeout=60) as client:
            got = []
            async for c in client.stream(prompt, SP(max_tokens=20)):
                got += c.token_ids
            return got
    assert asyncio.run(run()) == expected.token_ids
