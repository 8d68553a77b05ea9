"""The direct feature channel end to end on CPU (gloo): `python -m verifier` and `python -m
drafter` started with the same --feature-channel, driven through the gRPC links, and `spectandem
serve --backend grpc --feature-channel`.

- greedy and seeded-sampling tokens (and the drafts: stats) equal the in-process speculator's,
  while every prefill and verify reply carried ChannelRefs, never tensors;
- features that do not come (a stale reference) make the drafter report the request unknown;
  the re-prefill from the verifier's Features call resumes it with the same tokens;
- the drafter killed mid-stream: every request completes with the same tokens, and the
  verifier's sender reports the channel broken (it then returns features inline);
- the Ray actors with a channel (start_engines(feature_channel="auto")): the same tokens, and
  ChannelRefs where object refs went before;
- `serve --backend grpc` opens the channel by default (its payloads in the shared-memory ring,
  mapped by the drafter) and streams the same greedy tokens as with --no-feature-channel; a
  channel that cannot come up (its port taken) leaves features to the router, tokens unchanged.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink
from router.serve import free_port
from spectandem.channel import ChannelRef
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.router.conftest import RAY_CLUSTERS, Served, collect, request
from tests.router.link_harness import MAX_LEN, TREE, _assert_same, _greedy, _local, _seeded, spawn_pair, speculate


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


class RecordingVerifier(GrpcVerifierLink):
    """Keeps every feature handle the router side received."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.handles: list = []

    async def prefill(self, items, want_features):
        results = await super().prefill(items, want_features)
        self.handles += [r.features for r in results]
        return results

    async def verify(self, draft, plain, want_features, on_launch=None):
        results = await super().verify(draft, plain, want_features, on_launch)
        self.handles += [r.features for r in results]
        return results


class LosingDrafter(GrpcDrafterLink):
    """Passes request `victim`'s features of round `at` as a reference to a message long gone."""

    def __init__(self, *args, victim: str, at: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.victim, self.at, self.rounds = victim, at, 0

    async def extend(self, items):
        if self.rounds == self.at:
            items = [type(i)(i.tag, i.token_ids, ChannelRef(1, 0)) if i.tag.request_id == self.victim else i
                     for i in items]
        self.rounds += 1
        return await super().extend(items)


async def _channel_state(link) -> str:
    return (await link.info()).extra.get("feature_channel", "")


async def _wait_state(link, state: str, timeout: float = 30.0) -> None:
    for _ in range(int(timeout * 10)):
        if await _channel_state(link) == state:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the feature channel is {await _channel_state(link)!r}, not {state!r}")


@pytest.fixture(scope="module")
def channel_processes(tmp_path_factory):
    with spawn_pair(tmp_path_factory.mktemp("logs"), ["--feature-channel", _address()]) as addresses:
        yield addresses


def test_features_cross_the_channel_and_tokens_match_local(channel_processes, prompts):
    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)))

    async def main():
        v, d = RecordingVerifier(channel_processes[0]), GrpcDrafterLink(channel_processes[1])
        try:
            await _wait_state(v, "up")
            await _wait_state(d, "up")   # the drafter's end may mark itself up a moment after the verifier's
            got = await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead)
            got_seeded = await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead)
            return got, got_seeded, v.handles
        finally:
            await v.close()
            await d.close()

    got, got_seeded, handles = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    assert handles and all(isinstance(h, ChannelRef) for h in handles), {type(h) for h in handles}


def test_features_that_do_not_come_are_resynced(channel_processes, prompts):
    from tests.router.test_links_ray import Seen, speculate as speculate_with_resync   # the loop that resyncs

    (expected,), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)))

    async def main():
        v = GrpcVerifierLink(channel_processes[0])
        d = LosingDrafter(channel_processes[1], victim="req-1", at=2)
        seen = Seen()
        try:
            got = await speculate_with_resync(v, d, prompts, _greedy(len(prompts)), eos, lookahead, seen)
            return got, seen, (await d.info()).used_slots
        finally:
            await v.close()
            await d.close()

    got, seen, used = asyncio.run(main())
    assert seen.resynced == ["req-1"]
    _assert_same(got, expected, same_stats=False)
    assert used == 0


@pytest.mark.slow
def test_serve_grpc_with_channel_exact_and_drafter_killed(prompts):
    from tests.router.test_serve_backends import _concurrent

    server = Served(["--backend", "grpc", "--feature-channel", "--max-len", str(MAX_LEN), "--max-running", "8",
                     "--drafter-timeout", "3", "--num-steps", "4", "--topk", "2", "--num-draft-tokens", "8"]
                    ).wait_ready()
    try:
        assert server.run(_channel_state(server.state["verifier"])) == "up"
        (greedy, sampled, long), _, _ = _local("eagle3", prompts, [SamplingParams(max_tokens=20)] * len(prompts),
                                               [SamplingParams(max_tokens=20, temperature=0.9, seed=i)
                                                for i in range(len(prompts))],
                                               [SamplingParams(max_tokens=80, ignore_eos=True)] * len(prompts))
        for i, p in enumerate(prompts):
            assert collect(server.stub, request(ids=p, max_tokens=20))[0] == greedy[i].token_ids
            assert collect(server.stub, request(ids=p, max_tokens=20, temperature=0.9, seed=i))[0] == \
                sampled[i].token_ids
        drafter = server.state["procs"]["drafter"]
        res = _concurrent(server.stub, [request(ids=p, max_tokens=80, ignore_eos=True) for p in prompts],
                          on_first_chunk=lambda: drafter.send_signal(signal.SIGKILL))
        for i in range(len(prompts)):
            toks, reason, _ = res[i]
            assert toks == long[i].token_ids and reason == "length"
        server.run(_wait_state(server.state["verifier"], "broken"))
    finally:
        server.close()


@pytest.mark.slow
@RAY_CLUSTERS
def test_ray_actors_with_channel_match_local(prompts):
    import ray

    from router.links_ray import ray_init, start_engines
    from tests.router.test_links_ray import Seen, speculate as speculate_with_resync

    (expected,), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)))
    started_here = not ray.is_initialized()
    ray_init(None, num_cpus=2)
    target, draft = demo_paths("eagle3")
    v, d, cleanup = start_engines(target, draft, SpecConfig(method="eagle3", **TREE), 4, MAX_LEN, device="cpu",
                                  feature_channel="auto")

    async def main():
        await _wait_state(v, "up")
        await _wait_state(d, "up")   # the drafter's end may mark itself up a moment after the verifier's
        seen = Seen()
        return await speculate_with_resync(v, d, prompts, _greedy(len(prompts)), eos, lookahead, seen), seen

    try:
        got, seen = asyncio.run(main())
    finally:
        cleanup()
        if started_here:
            ray.shutdown()
    _assert_same(got, expected)
    assert not seen.resynced
    assert seen.results and all(isinstance(r.features, ChannelRef) for r in seen.results)


SERVE_FLAGS = ["--backend", "grpc", "--max-len", str(MAX_LEN), "--max-running", "4", "--num-steps",
               str(TREE["num_steps"]), "--topk", str(TREE["topk"]), "--num-draft-tokens", str(TREE["num_draft_tokens"])]


def _served_greedy(server: Served, prompts) -> list[list[int]]:
    return [collect(server.stub, request(ids=p, max_tokens=20))[0] for p in prompts]


def _maps_ring(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "spectandem-ring-" in f.read()


def _channel_metric(server) -> dict[str, float]:
    """/metrics' spectandem:num_feature_channel_messages_total by path."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{server.state['metrics_port']}/metrics", timeout=10).read()
    return {s.labels["path"]: s.value for family in text_string_to_metric_families(text.decode())
            for s in family.samples if s.name == "spectandem:num_feature_channel_messages_total"}


@pytest.mark.slow
def test_serve_grpc_opens_the_channel_by_default_and_streams_the_same_tokens_as_without(prompts):
    (greedy,), _, _ = _local("eagle3", prompts, [SamplingParams(max_tokens=20)] * len(prompts))
    got = {}
    for name, flags in (("default", []), ("off", ["--no-feature-channel"])):
        server = Served(SERVE_FLAGS + flags + ["--metrics-port", str(free_port())]).wait_ready()
        try:
            state = server.run(_channel_state(server.state["verifier"]))
            drafter_pid = server.state["procs"]["drafter"].pid
            tokens = _served_greedy(server, prompts)
            got[name] = (state, _maps_ring(drafter_pid), tokens, _channel_metric(server))
        finally:
            server.close()
    assert got["default"][:2] == ("up", True)     # the drafter maps the verifier's payload ring
    assert got["off"][:2] == ("", False)
    assert got["default"][2] == got["off"][2] == [g.token_ids for g in greedy]
    # /metrics counts the channel's messages by the way they went: the demo pair's fit its slots.
    assert got["default"][3]["ring"] > 0 and got["default"][3]["group"] == 0, got["default"][3]
    assert got["off"][3] == {"ring": 0, "group": 0}


@pytest.mark.slow
def test_serve_grpc_channel_that_cannot_come_up_leaves_features_to_the_router(prompts, caplog):
    (greedy,), _, _ = _local("eagle3", prompts, [SamplingParams(max_tokens=20)] * len(prompts))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"tcp://127.0.0.1:{taken.getsockname()[1]}"
        with caplog.at_level("WARNING", logger="spectandem.serve"):
            server = Served(SERVE_FLAGS + ["--feature-channel", address]).wait_ready()
        try:
            assert server.run(_channel_state(server.state["verifier"])) == "broken"
            assert any("features go through the router" in r.getMessage() for r in caplog.records)
            assert _served_greedy(server, prompts) == [g.token_ids for g in greedy]
        finally:
            server.close()
