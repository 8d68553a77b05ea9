"""The engines as gRPC services, driven through GrpcVerifierLink + GrpcDrafterLink.

- real servers on free localhost ports with the demo pair, run (a) in this process (on the
  servers' own threads) and (b) as `python -m verifier` / `python -m drafter` subprocesses;
  the round protocol over the links (prefill -> draft -> verify -> extend,
  tests/router/link_harness.py) gives exactly the greedy tokens and acceptance counts of the
  in-process LocalSpeculator;
- errors: a stale tag is StaleMessage, bad input ValueError, a killed drafter EngineUnavailable
  within the per-call timeout; grpc.health.v1 reports SERVING.

The wire codec has its own tests: tests/spectandem/test_codec.py.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from router.links import EngineUnavailable
from spectandem.protocol import DrafterPrefillItem, ExtendItem, PlainItem, Tag, VerifierPrefillItem
from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.messages import StaleMessage
from tests.router.link_harness import (MAX_LEN, TREE, _assert_same, _greedy, _local, _seeded, _spawn, _stop,
                                       spawn_pair, speculate)


# ----------------------------------------------------------------------------------------------
# Servers in this process


@pytest.fixture(scope="module")
def ngram_servers():
    """(verifier address, drafter address) of n-gram engines served from this process."""
    from drafter.factory import build_engine as build_drafter
    from drafter.service import start_drafter_server
    from spectandem.config import EngineConfig
    from verifier.factory import build_engine as build_verifier
    from spectandem.feature_layers import resolve_feature_layers
    from verifier.service import start_verifier_server

    target, _ = demo_paths("ngram")
    cfg = SpecConfig(method="ngram", **TREE)
    layers = resolve_feature_layers(None, "ngram", None, target)
    verifier = build_verifier(EngineConfig(target_dir=target, spec=cfg, max_slots=4, max_len=MAX_LEN), layers)
    drafter, _ = build_drafter(EngineConfig(target_dir=target, spec=cfg, max_slots=4, max_len=MAX_LEN))
    servers = [start_verifier_server(verifier, "127.0.0.1", 0),
               start_drafter_server(drafter, "127.0.0.1", 0, max_slots=4, max_len=MAX_LEN)]
    yield tuple(f"127.0.0.1:{s.port}" for s in servers)
    for s in servers:
        s.stop(0)


def _links(addresses, timeout_s: float = 30.0):
    return GrpcVerifierLink(addresses[0], timeout_s), GrpcDrafterLink(addresses[1], timeout_s)


def test_ngram_in_process_servers_match_local(ngram_servers, prompts):
    (expected,), eos, lookahead = _local("ngram", prompts, _greedy(len(prompts)))

    async def main():
        v, d = _links(ngram_servers)
        try:
            assert (await v.info()).feature_layers is None
            got = await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead)
            # Every other round, request 1 decodes as a plain row in the same verify batch.
            mixed = await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead,
                                    plain_rounds=lambda rid, n: rid == "req-1" and n % 2 == 1)
            vi, di = await v.info(), await d.info()
            assert vi.used_slots == 0 and di.used_slots == 0
            # Each service reports the calls it ran and the time inside them (EngineInfo.calls).
            for info, kinds in ((vi, {"prefill", "verify", "release"}), (di, {"prefill", "draft", "release"})):
                assert kinds <= set(info.calls["count"]), info.calls
                assert all(info.calls["count"][k] > 0 and info.calls["busy_s"][k] > 0 for k in kinds), info.calls
            return got, mixed
        finally:
            await v.close()
            await d.close()

    got, mixed = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(mixed, expected, same_stats=False)


def test_stale_tags_and_bad_input(ngram_servers, prompts):
    async def main():
        v, d = _links(ngram_servers)
        try:
            p = prompts[0]
            (r,) = await v.prefill([VerifierPrefillItem(Tag("s", 2, len(p)), p, SamplingParams(), 1)], False)
            assert r.tag == Tag("s", 2, len(p) + 1) and r.features is None
            await d.prefill([DrafterPrefillItem(r.tag, p, r.first_token_id, SamplingParams(), 1, None)])
            for bad in (Tag("s", 1, r.tag.committed_len), Tag("s", 2, r.tag.committed_len - 1)):
                with pytest.raises(StaleMessage, match="epoch 2"):
                    await d.draft([bad])
                with pytest.raises(StaleMessage):
                    await v.verify(None, [PlainItem(bad, r.first_token_id)], False)
                with pytest.raises(StaleMessage):
                    await v.features(bad)
            draft = await d.draft([r.tag])
            assert draft.tags == [r.tag]
            (out,) = await v.verify(draft, [], False)
            with pytest.raises(StaleMessage):  # the same draft again: the verifier moved on
                await v.verify(draft, [], False)
            with pytest.raises(StaleMessage):
                await d.extend([ExtendItem(Tag("s", 2, out.tag.committed_len + 1), out.token_ids, None)])
            assert await d.extend([ExtendItem(Tag("gone", 0, 5), [1], None)]) == ["gone"]
            with pytest.raises(ValueError, match="prompt is empty"):
                await v.prefill([VerifierPrefillItem(Tag("e", 0, 0), [], SamplingParams(), 1)], False)
            with pytest.raises(ValueError, match="neither a tree nor plain"):
                await v.verify(None, [], False)
            await v.release(["s"])
            await d.release(["s"])
        finally:
            await v.close()
            await d.close()

    asyncio.run(main())


def test_a_verify_goes_out_before_on_launch_is_told(ngram_servers, prompts):
    """`on_launch` (the router's cue to hand the round's tokens to their streams, work queued on
    the event loop) comes once the verify call is started, so the call's send runs on the loop
    before that work, not after it."""
    async def main():
        v, d = _links(ngram_servers)
        order = []
        try:
            p = prompts[0]
            (r,) = await v.prefill([VerifierPrefillItem(Tag("o", 0, len(p)), p, SamplingParams(), 1)], False)
            await d.prefill([DrafterPrefillItem(r.tag, p, r.first_token_id, SamplingParams(), 1, None)])
            draft = await d.draft([r.tag])
            start = v.stub.Verify

            def started(request, **kw):
                order.append("call")
                return start(request, **kw)

            v.stub.Verify = started
            (out,) = await v.verify(draft, [], False, on_launch=lambda: order.append("launched"))
            assert out.tag.request_id == "o"
            await v.release(["o"])
            await d.release(["o"])
        finally:
            await v.close()
            await d.close()
        return order

    assert asyncio.run(main()) == ["call", "launched"]


# ----------------------------------------------------------------------------------------------
# Real entry points in subprocesses


@pytest.fixture(scope="module")
def eagle3_processes(tmp_path_factory):
    """`python -m verifier` and `python -m drafter` without model flags: the demo EAGLE-3 pair
    (the verifier derives its feature layers from the head's config)."""
    with spawn_pair(tmp_path_factory.mktemp("logs")) as addresses:
        yield addresses


def test_eagle3_subprocesses_match_local(eagle3_processes, prompts):
    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)))

    async def main():
        v, d = _links(eagle3_processes)
        try:
            vi, di = await v.info(), await d.info()
            assert (vi.role, di.role, di.kind) == ("verifier", "drafter", "eagle3")
            assert vi.feature_layers == di.feature_layers == (2, 4, 5)
            assert vi.max_len == di.max_len == MAX_LEN and vi.max_slots == 4
            return (await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead),
                    await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead),
                    await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead, with_draft=True),
                    await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead, with_draft=True))
        finally:
            await v.close()
            await d.close()

    got, got_seeded, got_with_draft, got_seeded_with_draft = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    # Each round's catch-up carried by the next Draft call: the same tokens and trees.
    _assert_same(got_with_draft, expected)
    _assert_same(got_seeded_with_draft, expected_seeded)
    assert any(s.token_ids != g.token_ids for s, g in zip(got_seeded, got))  # it really sampled


def test_draft_ahead_over_grpc_matches_local(eagle3_processes, prompts):
    """DraftAhead over gRPC, overlapped with Verify: greedy and seeded sampled tokens, and the
    trees (stats), equal the in-process loop with the outcome cache; hits and misses happen, and
    greedy rounds where every request hit verify the outcome trees DraftAhead sent (no Draft)."""
    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)), ahead=True)

    async def main():
        v, d = _links(eagle3_processes)
        flags: list = []
        ready: list = []
        try:
            return (await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead, ahead=flags, ready=ready),
                    await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead, ahead=flags),
                    flags, ready, await d.info())
        finally:
            await v.close()
            await d.close()

    got, got_seeded, flags, ready, info = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    assert flags.count(True) > 0 and flags.count(False) > 0
    assert sum(ready) > 0
    assert info.kv["used_blocks"] == 0


def test_health_and_reflection(eagle3_processes):
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    for address, service in zip(eagle3_processes, ("spectandem.v1.Verifier", "spectandem.v1.Drafter")):
        with grpc.insecure_channel(address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for name in ("", service):
                reply = stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
            assert service in ProtoReflectionDescriptorDatabase(channel).get_services()


def test_killed_drafter_is_unavailable_fast(tmp_path, prompts):
    """`spectandem drafter` (the CLI) on n-gram; SIGKILL it mid-session: the next calls raise
    EngineUnavailable well within the per-call timeout instead of hanging."""
    proc, address = _spawn(["-m", "spectandem.cli", "drafter", "--method", "ngram"], tmp_path / "d.log")
    timeout_s = 5.0

    async def main():
        d = GrpcDrafterLink(address, timeout_s)
        try:
            p = prompts[0]
            tag = Tag("k", 0, len(p) + 1)
            await d.prefill([DrafterPrefillItem(tag, p, 1, SamplingParams(), 1, None)])
            assert (await d.draft([tag])).tags == [tag]
            proc.kill()
            proc.wait()
            for call in (lambda: d.draft([tag]), d.info):
                start = time.monotonic()
                with pytest.raises(EngineUnavailable, match="drafter at"):
                    await call()
                assert time.monotonic() - start < timeout_s
        finally:
            await d.close()

    try:
        asyncio.run(main())
    finally:
        _stop(proc)


def test_unreachable_verifier_is_unavailable():
    async def main():
        v = GrpcVerifierLink("127.0.0.1:1", timeout_s=5.0)
        try:
            with pytest.raises(EngineUnavailable, match="UNAVAILABLE"):
                await v.info()
            with pytest.raises(EngineUnavailable, match="not reachable"):
                await v.wait_ready(0.2)
        finally:
            await v.close()

    asyncio.run(main())
