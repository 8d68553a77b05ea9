"""Draft trees over the tree channel with real engines: `python -m verifier` / `python -m drafter`
processes given --tree-channel, and the Ray actors of start_engines(tree_channel=True). Each
round's Draft (with a `post_round`) and Verify (with a TreeRoute) go out together, as the
router's rounds send them (tests/router/link_harness.py `speculate(posted=...)`): greedy and
seeded outputs equal the in-process engines' token for token, sampled trees (which carry their
draft probabilities) included. A draft that fails tells the verifier at once, and a verify
waiting on a drafter that is killed returns without its trees; neither waits out its timeout."""

from __future__ import annotations

import asyncio
import signal
import socket
import time

import pytest

from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink
from spectandem.demo import demo_paths
from spectandem.config import SpecConfig
from spectandem.messages import StaleMessage
from spectandem.protocol import DraftHandle, PlainItem, Tag, TreeRoute, VerifierPrefillItem
from tests.router.conftest import RAY_CLUSTERS
from tests.router.link_harness import (MAX_LEN, TREE, _assert_same, _greedy, _local, _seeded, _spawn, _stop,
                                       speculate)


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


async def _tree_state(link) -> str:
    return (await link.info()).extra.get("tree_channel", "")


async def _until_up(*links, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    for link in links:
        while await _tree_state(link) != "up":
            assert time.monotonic() < deadline, f"the tree channel is {await _tree_state(link)!r}"
            await asyncio.sleep(0.05)


@pytest.fixture
def processes(tmp_path):
    """(verifier process, address), (drafter process, address): the demo EAGLE-3 pair with a tree channel."""
    trees = _address()
    tree = ["--num-steps", str(TREE["num_steps"]), "--topk", str(TREE["topk"]),
            "--num-draft-tokens", str(TREE["num_draft_tokens"])]
    procs = []
    try:
        procs.append(_spawn(["-m", "verifier", "--max-slots", "4", "--max-len", str(MAX_LEN), "--tree-channel", trees],
                            tmp_path / "v.log"))
        procs.append(_spawn(["-m", "drafter", "--max-slots", "4", "--max-len", str(MAX_LEN), *tree,
                             "--tree-channel", trees], tmp_path / "d.log"))
        yield procs
    finally:
        for p, _ in procs:
            _stop(p)


def test_grpc_engines_take_trees_over_the_channel_and_match_local(processes, prompts):
    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)))
    (_, v_addr), (_, d_addr) = processes

    async def main():
        v, d = GrpcVerifierLink(v_addr), GrpcDrafterLink(d_addr)
        try:
            await _until_up(v, d)
            posted, posted_seeded = [], []
            got = await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead, posted=posted)
            got_seeded = await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead, posted=posted_seeded)
            return got, got_seeded, posted, posted_seeded
        finally:
            await v.close()
            await d.close()

    got, got_seeded, posted, posted_seeded = asyncio.run(main())
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    assert len(posted) > 5 and len(posted_seeded) > 5


async def _prefilled(v, d, prompt: list[int], rid: str = "r0") -> Tag:
    """`rid` prefilled on both engines; -> its tag."""
    from spectandem.config import SamplingParams
    from spectandem.protocol import DrafterPrefillItem

    params = SamplingParams(max_tokens=16)
    (res,) = await v.prefill([VerifierPrefillItem(Tag(rid, 0, len(prompt)), prompt, params, 7)], want_features=True)
    assert await d.prefill([DrafterPrefillItem(res.tag, prompt, res.first_token_id, params, 7, res.features)]) == []
    return res.tag


def test_a_failed_draft_tells_the_verifier_at_once(processes):
    (_, v_addr), (_, d_addr) = processes

    async def main():
        v, d = GrpcVerifierLink(v_addr), GrpcDrafterLink(d_addr)
        try:
            await _until_up(v, d)
            tag = await _prefilled(v, d, [5, 6, 7, 8])
            other = await _prefilled(v, d, [9, 10, 11], "r1")
            stale = Tag(tag.request_id, tag.epoch, tag.committed_len + 3)
            t0 = time.monotonic()
            route = DraftHandle([stale], TreeRoute(77, 60.0))
            draft, outs = await asyncio.gather(d.draft([stale], None, [], post_round=77),
                                               v.verify(route, [PlainItem(other, 11)], want_features=False),
                                               return_exceptions=True)
            return draft, outs, time.monotonic() - t0
        finally:
            await v.close()
            await d.close()

    draft, outs, took = asyncio.run(main())
    assert isinstance(draft, StaleMessage)
    # The verify went on with its plain row alone, without waiting its 60 s for the tree.
    assert [o.tag.request_id for o in outs] == ["r1"] and len(outs[0].token_ids) == 1
    assert took < 50


def test_a_verify_waiting_on_a_killed_drafter_returns_without_its_trees(processes):
    (_, v_addr), (drafter, _) = processes

    async def main():
        v = GrpcVerifierLink(v_addr)
        try:
            await _until_up(v)
            other = await _prefilled_verifier_only(v)
            t0 = time.monotonic()
            waiting = asyncio.ensure_future(v.verify(DraftHandle([], TreeRoute(5, 60.0)), [PlainItem(other, 3)],
                                                     want_features=False))
            await asyncio.sleep(0.5)
            drafter.send_signal(signal.SIGKILL)
            outs = await waiting
            return outs, time.monotonic() - t0, await _tree_state(v)
        finally:
            await v.close()

    outs, took, state = asyncio.run(main())
    assert [o.tag.request_id for o in outs] == ["solo"]
    assert took < 50 and state == "waiting"


async def _prefilled_verifier_only(v) -> Tag:
    from spectandem.config import SamplingParams

    (res,) = await v.prefill([VerifierPrefillItem(Tag("solo", 0, 3), [1, 2, 3], SamplingParams(max_tokens=8), 3)],
                             want_features=False)
    return res.tag


@pytest.mark.slow
@RAY_CLUSTERS
def test_ray_actors_take_trees_over_the_channel_and_match_local(prompts):
    import ray

    from router.links_ray import ray_init, start_engines

    (expected, expected_seeded), eos, lookahead = _local("eagle3", prompts, _greedy(len(prompts)),
                                                         _seeded(len(prompts)))
    started_here = not ray.is_initialized()
    ray_init(None, num_cpus=2)
    target, draft = demo_paths("eagle3")
    v, d, cleanup = start_engines(target, draft, SpecConfig(method="eagle3", **TREE), 4, MAX_LEN, device="cpu",
                                  tree_channel=True)

    async def main():
        await _until_up(v, d)
        posted, posted_seeded = [], []
        return (await speculate(v, d, prompts, _greedy(len(prompts)), eos, lookahead, posted=posted),
                await speculate(v, d, prompts, _seeded(len(prompts)), eos, lookahead, posted=posted_seeded),
                posted, posted_seeded)

    try:
        got, got_seeded, posted, posted_seeded = asyncio.run(main())
    finally:
        cleanup()
        if started_here:
            ray.shutdown()
    _assert_same(got, expected)
    _assert_same(got_seeded, expected_seeded)
    assert len(posted) > 5 and len(posted_seeded) > 5
