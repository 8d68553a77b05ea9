"""Drafting on the verdict across processes (drafter/next_trees.py): `python -m verifier` /
`python -m drafter` processes with a feature channel and a tree channel, and the Ray actors of
start_engines, driven by the router. A verify that names requests to draft next sends their
verdicts (features by reference on the feature channel) to the drafter over the tree channel;
the drafter catches up and drafts while the router commits, and the router's next draft call
takes the trees made, and the drafter posts them early, which the verifier's next verify takes
where they hold its requests. Greedy tokens equal plain decoding's and seeded ones the in-process
engines' without the hand-off, token for token; the drafter's info counts the trees it made and
the draft calls took, the verifier's the verifies that took early trees. Negative control: a
verifier link not asked to hand verdicts on sends none."""

from __future__ import annotations

import asyncio
import socket

import pytest

from router.links_grpc import GrpcDrafterLink, GrpcVerifierLink
from router.local import LocalSpeculator
from router.loop import Router
from router.requests import RouterConfig
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.router.conftest import RAY_CLUSTERS
from tests.router.link_harness import MAX_LEN, TREE, _spawn, _stop
from tests.router.test_plain_steps import served
from tests.router.test_tree_channel_links import _until_up


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@pytest.fixture(scope="module")
def reference():
    """The demo pair in-process: (plain engine, EAGLE-3 engines) for the expected tokens."""
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=MAX_LEN)
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3", **TREE), max_slots=8, max_len=MAX_LEN)
    return plain, spec


def _work(tokenizer):
    from tests.e2e.conftest import PROMPT_TEXTS

    prompts = [tokenizer.encode(x).ids for x in PROMPT_TEXTS[:4]]
    greedy = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 9, 33, 26)]
    seeded = [SamplingParams(max_tokens=30, temperature=0.9, seed=7 + i, ignore_eos=True) for i in range(4)]
    return prompts, greedy, seeded


class _VerdictFirst:
    """The drafter link, holding each router draft call until the drafter has made trees on the
    round's verdict; once a call has taken such a tree, the calls go straight through. Which
    reaches the drafter first, the verdict or the draft call, is a race the draft call can win
    every time on a busy machine; holding it fixes the order, so the test sees the hand-off.
    A call is held at most `wait_s`, well inside the router's drafter timeout: a round whose
    requests are at their bounds makes no tree to wait for (and a round the early trees serve
    makes no draft call). `every_call`: every call is
    held, also once one has taken a made tree."""

    def __init__(self, link, wait_s: float = 2.0, every_call: bool = False):
        self.link, self.wait_s, self.every_call = link, wait_s, every_call
        self.calls = self.made_before = 0
        self.took = False

    def __getattr__(self, name):
        return getattr(self.link, name)

    async def draft(self, *args, **kwargs):
        if self.took and not self.every_call:
            return await self.link.draft(*args, **kwargs)
        made, taken = await _counts(self.link)
        if self.calls:   # the first draft call follows a prefill, not a verdict
            deadline = asyncio.get_running_loop().time() + self.wait_s
            while made <= self.made_before and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
                made, taken = await _counts(self.link)
        self.calls += 1
        handle = await self.link.draft(*args, **kwargs)
        made, after = await _counts(self.link)
        self.made_before, self.took = made, after > taken
        return handle


async def _route(v, d, spec, prompts, params):
    if v.hands_verdicts:
        d = _VerdictFirst(d)
    router = Router(v, d, spec.tokenizer, RouterConfig(
        max_len=MAX_LEN, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline="sequential", tree_channel=True))
    got = await served(router, prompts, params)
    return [t for t, _, _ in got], router.counters


async def _counts(d) -> tuple[int, int]:
    extra = (await d.info()).extra
    return int(extra.get("next_trees_made", 0)), int(extra.get("next_trees_taken", 0))


async def _early_reads(d) -> int:
    """The drafter's feature messages copied out of the payload ring where a verdict told where
    they lie, ahead of their headers."""
    return int((await d.info()).extra.get("feature_early_reads", 0))


@pytest.fixture
def processes(tmp_path):
    """(verifier address, drafter address): the demo EAGLE-3 pair with a feature and a tree channel."""
    features, trees = _address(), _address()
    tree = ["--num-steps", str(TREE["num_steps"]), "--topk", str(TREE["topk"]),
            "--num-draft-tokens", str(TREE["num_draft_tokens"])]
    procs = []
    try:
        procs.append(_spawn(["-m", "verifier", "--max-slots", "8", "--max-len", str(MAX_LEN),
                             "--feature-channel", features, "--tree-channel", trees], tmp_path / "v.log"))
        procs.append(_spawn(["-m", "drafter", "--max-slots", "8", "--max-len", str(MAX_LEN), *tree,
                             "--feature-channel", features, "--tree-channel", trees], tmp_path / "d.log"))
        yield procs[0][1], procs[1][1]
    finally:
        for p, _ in procs:
            _stop(p)


@pytest.mark.slow
def test_grpc_engines_draft_on_the_verdict_and_stay_exact(processes, reference):
    plain, spec = reference
    prompts, greedy, seeded = _work(spec.tokenizer)
    want = [c.token_ids for c in plain.generate(prompts, greedy)]
    want_seeded = [c.token_ids for c in spec.generate(prompts, seeded)]
    v_addr, d_addr = processes

    async def main():
        v, d = GrpcVerifierLink(v_addr, hands_verdicts=True), GrpcDrafterLink(d_addr)
        control = GrpcVerifierLink(v_addr)   # not asked: no verdict goes
        try:
            await _until_up(v, d)
            got_control, control_counters = await _route(control, d, spec, prompts, greedy)
            before = await _counts(d), await _early_reads(d)
            calls_before = (await d.info()).calls["count"].get("draft", 0)
            got, counters = await _route(v, d, spec, prompts, greedy)
            after = await _counts(d), await _early_reads(d)
            draft_calls = (await d.info()).calls["count"].get("draft", 0) - calls_before
            got_seeded, _ = await _route(v, d, spec, prompts, seeded)
            ring = (await v.info()).extra
            return (got_control, control_counters, before, got, counters, draft_calls, after, got_seeded,
                    await _counts(d), (await d.info()).calls, ring)
        finally:
            for link in (v, d, control):
                await link.close()
    (got_control, control_counters, before, got, counters, draft_calls, after, got_seeded, last, calls,
     ring) = asyncio.run(main())
    assert got_control == want and got == want and got_seeded == want_seeded
    assert before == ((0, 0), 0)                    # the control sent no verdicts
    # The rounds the early trees served made no draft call: the drafter answered one call per
    # other round (each request's first drafted one, and those after a round without them).
    assert control_counters.early_tree_rounds == 0 and counters.early_tree_rounds > 0
    assert draft_calls + counters.early_tree_rounds <= counters.rounds and draft_calls < counters.rounds - 5
    # Whether the drafter copies a verdict's features out of the ring ahead of their message's
    # header (FeatureReceiver.early_reads) depends on which of the two reaches it first, a race
    # under load; tests/spectandem/test_channel.py makes both orders.
    (made, taken), _ = after
    assert counters.num_drafts > 0 and counters.stale_dropped == 0 and counters.fallback_rounds == 0
    # Trees were made on the verdicts and served: verified early (no draft call), or taken by a
    # draft call (held until the drafter had made them) where the verify could not take them.
    assert made > 0 and taken + ring.get("early_trees_taken", 0) > 0, (made, taken, ring)
    assert last[0] > made                           # the seeded requests' rounds too
    # The work on each verdict is timed by its parts too (EngineInfo.calls: profile_serve's report).
    parts = ("draft_next.decode", "draft_next.catch_up", "draft_next.features", "draft_next.features.hand_out",
             "draft_next.absorb", "draft_next.engine", "draft_next.post")
    assert all(calls["count"].get(k, 0) > 0 for k in parts), calls["count"]
    # The verifier's messages went through the payload ring (its info counts them, over gRPC too),
    # and some of its verifies took the trees posted early.
    assert ring.get("feature_ring_messages", 0) > 0 and ring.get("early_trees_taken", 0) > 0, ring


@pytest.mark.slow
@RAY_CLUSTERS
def test_ray_actors_draft_on_the_verdict_and_stay_exact(reference):
    import ray

    from router.links_ray import ray_init, start_engines

    plain, spec = reference
    prompts, greedy, _ = _work(spec.tokenizer)
    want = [c.token_ids for c in plain.generate(prompts, greedy)]
    started_here = not ray.is_initialized()
    ray_init(None, num_cpus=2)
    target, draft = demo_paths("eagle3")
    v, d, cleanup = start_engines(target, draft, SpecConfig(method="eagle3", **TREE), 8, MAX_LEN, device="cpu",
                                  feature_channel="auto", tree_channel=True, draft_on_verdict=True)

    first, join = SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)
    want_joined = [c.token_ids for c in plain.generate(prompts[:2], [first, join])]

    async def main():
        await _until_up(v, d)
        got, counters = await _route(v, d, spec, prompts, greedy)
        info = await _counts(d), await _early_reads(d), (await v.info()).extra
        return got, counters, *info, await _joined(v, d, spec, prompts, first, join)

    try:
        assert v.hands_verdicts
        got, counters, (made, taken), early, verifier, joined = asyncio.run(main())
    finally:
        cleanup()
        if started_here:
            ray.shutdown()
    assert got == want
    assert counters.num_drafts > 0 and counters.stale_dropped == 0
    assert made > 0   # early reads: see the gRPC test
    assert verifier.get("early_trees_taken", 0) > 0, verifier   # made trees that served
    assert counters.early_tree_rounds > 0   # ... in rounds that made no draft call
    # A request admitted in a verify step: its drafter prefill went with the verdicts (one
    # prefill call, the first request's).
    got_joined, joined_counters, calls = joined
    assert got_joined == want_joined and joined_counters.mixed_prefills == 1
    assert joined_counters.prefills_with_verdicts == 1 and calls == (1, 1)


async def _joined(v, d, spec, prompts, first, join, max_len: int = MAX_LEN):
    """Serves prompts[0] with `first` and, once it has streamed 8 tokens (rounds whose verdicts
    went to the drafter), prompts[1] with `join`, which the router then prefills in the step of a
    round's verify beside it -> (the two requests' tokens, the router's counters, the drafter's
    prefill calls and prefills taken with verdicts over the run). Every draft call is held for the
    round's verdicts (`_VerdictFirst`): one that overtakes the verdicts bringing a new request's
    prefill finds it unknown, and the router's resync prefills it with a call of its own."""
    if v.hands_verdicts:
        d = _VerdictFirst(d, every_call=True)
    router = Router(v, d, spec.tokenizer, RouterConfig(
        max_len=max_len, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline="sequential", tree_channel=True))

    async def rest(req, toks):
        while True:
            ev = await req.events.get()
            toks += ev.token_ids
            if ev.finish_reason:
                return toks

    async def drafter_prefills():
        info = await d.info()
        return info.calls.get("count", {}).get("prefill", 0), int(info.extra.get("prefills_with_verdicts", 0))

    before = await drafter_prefills()
    router.start()
    try:
        a, got_a = router.submit(prompts[0], first), []
        while len(got_a) < 8:
            ev = await a.events.get()
            assert not ev.finish_reason
            got_a += ev.token_ids
        b = router.submit(prompts[1], join)
        got = await asyncio.gather(rest(a, got_a), rest(b, []))
    finally:
        await router.stop()
    after = await drafter_prefills()
    return got, router.counters, (after[0] - before[0], after[1] - before[1])


@pytest.mark.slow
def test_a_request_prefilled_in_a_verify_step_reaches_the_drafter_with_the_verdicts(processes, reference):
    """A request admitted in the verify step of a running one's round: its drafter prefill goes
    with that verify's verdicts (the drafter takes it, then drafts its first tree with the running
    one's), not as a prefill call of the router's. Greedy and seeded, its tokens and the running
    one's are those without it (the target's, and the in-process engines' seeded draws). Negative
    control: a verifier link that does not hand verdicts on leaves it to the router's prefill call."""
    plain, spec = reference
    prompts, _, _ = _work(spec.tokenizer)
    first = SamplingParams(max_tokens=60, ignore_eos=True)
    greedy = SamplingParams(max_tokens=24, ignore_eos=True)
    seeded = SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)
    want = [c.token_ids for c in plain.generate(prompts[:2], [first, greedy])]
    want_seeded = spec.generate([prompts[1]], [seeded])[0].token_ids
    v_addr, d_addr = processes

    async def main():
        v, d = GrpcVerifierLink(v_addr, hands_verdicts=True), GrpcDrafterLink(d_addr)
        control = GrpcVerifierLink(v_addr)
        try:
            await _until_up(v, d)
            return (await _joined(v, d, spec, prompts, first, greedy), await _joined(v, d, spec, prompts, first, seeded),
                    await _joined(control, d, spec, prompts, first, greedy))
        finally:
            for link in (v, d, control):
                await link.close()

    (got, counters, calls), (got_seeded, counters_seeded, calls_seeded), (got_control, counters_control,
                                                                          calls_control) = asyncio.run(main())
    assert got == want and got_seeded == [want[0], want_seeded] and got_control == want
    for c in (counters, counters_seeded, counters_control):
        assert c.mixed_prefills == 1 and c.stale_dropped == 0 and c.fallback_rounds == 0
    # One prefill call each (the first request's); the joining one's prefill came with the verdicts.
    assert counters.prefills_with_verdicts == 1 and calls == (1, 1)
    assert counters_seeded.prefills_with_verdicts == 1 and calls_seeded == (1, 1)
    assert counters_control.prefills_with_verdicts == 0 and calls_control == (2, 0)
