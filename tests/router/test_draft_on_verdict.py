"""The verdict hand-off of one process (router/links_local.py): a verifier link given its drafter
link hands a sequential round's verdicts to the drafter's worker thread, which catches up and
drafts the next trees while the router commits the round, and hands them to the verifier's
thread at once as early trees (TreeHandOff.post_early), which the next round's verify takes
without a draft call; a draft call takes them as made. Real demo engines behind the in-process
links, each with a thread of its own (here on the CPU): greedy tokens equal plain decoding's and
sampled ones the same seeds' without the hand-off, the made trees are those a draft call makes,
a call that asks for other trees drafts them, and catch-ups the drafter absorbed ahead are left
out of every later call once."""

from __future__ import annotations

import asyncio
import time

import pytest

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.local import LocalSpeculator
from router.loop import Router
from router.requests import RouterConfig
from router.serve import draft_on_verdict, resolve_serve_flags
from spectandem.channel import TreeHandOff
from spectandem.cli import build_parser
from spectandem.config import Platform, SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.protocol import DrafterPrefillItem, ExtendItem, Tag, VerifierPrefillItem
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.test_plain_steps import _serve


@pytest.fixture(scope="module")
def plain():
    return LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)


def _spec():
    return LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=256)


def _links(spec, hand_verdicts=True):
    trees = TreeHandOff()
    dlink = LocalDrafterLink(spec.drafter, trees=trees)
    vlink = LocalVerifierLink(spec.verifier, trees=trees, drafter=dlink if hand_verdicts else None)
    return vlink, dlink


def _router(spec, hand_verdicts=True, pipeline="sequential", max_len=256):
    vlink, dlink = _links(spec, hand_verdicts)
    return Router(vlink, dlink, spec.tokenizer, RouterConfig(
        max_len=max_len, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline=pipeline, tree_channel=True)), vlink, dlink


@pytest.mark.parametrize("pipeline", ["sequential", "auto"])
def test_rounds_drafted_on_the_verdict_give_the_targets_tokens(plain, pipeline):
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:5]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (40, 7, 33, 40, 19)]
    want = [c.token_ids for c in plain.generate(prompts, params)]
    router, vlink, dlink = _router(spec, pipeline=pipeline)
    got = _serve(router, prompts, params, engines=(spec.verifier, spec.drafter))
    assert [t for t, _, _ in got] == want
    c = router.counters
    assert c.num_drafts > 0 and c.stale_dropped == 0 and c.fallback_rounds == 0
    # The drafter made next trees on the verdicts, and the verifies took them early.
    assert dlink.drafter.next_trees.made > 0 and c.early_tree_rounds > 0 and vlink.trees.early_rows_taken > 0
    if pipeline == "sequential":
        # Every drafted request-round but each request's first drafted one was an early tree, less
        # the requests that joined or left between two rounds (a request's last round makes none).
        assert vlink.trees.early_rows_taken >= c.num_drafts - 3 * len(prompts)
    assert dlink.clock.stats()["count"].get("draft_next", 0) > 0
    assert not spec.verifier.requests and not spec.drafter.requests
    assert dlink.drafter.next_trees.empty   # released with their requests


def test_in_one_process_the_rounds_the_early_trees_serve_make_no_draft_call(plain):
    """In one process, as across processes (tests/router/test_draft_on_verdict_links.py), a tree
    round the early trees serve makes no draft call: its verify names the early trees; every other
    tree round makes its draft call, sent before its verify (router/loop.py `_sequential_round`).
    Most rounds are of the first kind, and the tokens are plain decoding's."""
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:3]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (30, 30, 12)]
    want = [c.token_ids for c in plain.generate(prompts, params)]
    router, vlink, dlink = _router(spec)
    calls = []
    verify, draft = vlink.verify, dlink.draft

    async def verify_logged(draft_handle, *args, **kw):
        route = draft_handle.payload if draft_handle is not None else None
        calls.append(("verify", getattr(route, "round_id", None), bool(getattr(route, "early_tags", ()))))
        return await verify(draft_handle, *args, **kw)

    async def draft_logged(tags, num_steps=None, extend=(), post_round=0):
        calls.append(("draft", post_round))
        return await draft(tags, num_steps, extend, post_round)

    vlink.verify, dlink.draft = verify_logged, draft_logged
    got = _serve(router, prompts, params, engines=(spec.verifier, spec.drafter))
    assert [t for t, _, _ in got] == want
    order = {}
    for i, call in enumerate(calls):
        if call[0] == "draft" and call[1]:
            order.setdefault(call[1], {})["draft"] = i
        elif call[0] == "verify" and call[1]:
            order.setdefault(call[1], {})["verify"] = (i, call[2])
    early = [o for o in order.values() if o["verify"][1]]
    called = [o for o in order.values() if not o["verify"][1]]
    assert all("draft" not in o for o in early), calls
    assert all("draft" in o and o["draft"] < o["verify"][0] for o in called), calls
    assert len(early) > 2 * len(called) and router.counters.early_tree_rounds == len(early), calls
    assert dlink.drafter.next_trees.taken == 0   # no draft call found a made tree: the verifies took them


def test_sampled_requests_draw_the_same_tokens_with_and_without_the_hand_off():
    """Sampled drafts: the made trees carry their own draft probabilities, and every draw is named
    by (seed, position) (spectandem/rng.py), so the same seeds give the same tokens either way."""
    prompts_text = PROMPT_TEXTS[:4]
    outs = []
    for hand in (False, True):
        spec = _spec()
        prompts = [spec.tokenizer.encode(x).ids for x in prompts_text]
        params = [SamplingParams(max_tokens=30, temperature=0.8, top_p=0.95, seed=11 + i, ignore_eos=True)
                  for i in range(len(prompts))]
        router, _, dlink = _router(spec, hand_verdicts=hand)
        outs.append([t for t, _, _ in _serve(router, prompts, params, engines=(spec.verifier, spec.drafter))])
        assert (dlink.drafter.next_trees.made > 0) == hand and (router.counters.early_tree_rounds > 0) == hand
        assert router.counters.num_drafts > 0
    assert outs[0] == outs[1]


def test_a_request_ends_where_its_bound_says_and_no_tree_is_made_past_it(plain):
    """max_tokens and the context: `_next_drafts`'s bounds keep the drafter from drafting for a
    request's last round, and the tokens still equal plain decoding's at the context's end."""
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:3]]
    max_len = max(len(p) for p in prompts) + 24
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (5, 200, 17)]
    reference = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=max_len)
    want = [(c.token_ids, c.finish_reason) for c in reference.generate(prompts, params)]
    router, vlink, dlink = _router(spec, max_len=max_len)
    got = _serve(router, prompts, params, engines=(spec.verifier, spec.drafter))
    assert [(t, r) for t, _, r in got] == want
    used = dlink.drafter.next_trees.taken + vlink.trees.early_rows_taken
    assert used > 0 and dlink.drafter.next_trees.made <= used + len(prompts)   # at most one unused per request (a stop)


def test_a_round_that_prefills_new_requests_in_its_verify_hands_its_verdicts_on(plain):
    """Mixed prefill (requests arriving while others run ride in the round's verify step): that
    verify hands the running requests' verdicts on too, and every request's tokens are exact."""
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:5]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (48, 40, 20, 30, 25)]
    want = [c.token_ids for c in plain.generate(prompts, params)]
    vlink, dlink = _links(spec)
    router = Router(vlink, dlink, spec.tokenizer, RouterConfig(
        max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline="sequential", tree_channel=True, mixed_prefill=True, admit_beside_draft=False))
    handed = []
    verify_prefill = vlink.verify_prefill

    async def recording(*args, **kwargs):
        handed.append(bool(kwargs.get("draft_next")))
        return await verify_prefill(*args, **kwargs)
    vlink.verify_prefill = recording

    async def go():
        router.start()

        async def one(i):
            if i >= 2:   # the later ones arrive while the first two run
                deadline = time.monotonic() + 10.0
                while vlink.trees.early_rows_taken < 2 * i and time.monotonic() < deadline:
                    await asyncio.sleep(0.001)
            req = router.submit(prompts[i], params[i])
            toks = []
            while True:
                ev = await req.events.get()
                toks += ev.token_ids
                if ev.finish_reason:
                    return toks
        try:
            return await asyncio.gather(*(one(i) for i in range(len(prompts))))
        finally:
            await router.stop()
    got = asyncio.run(go())
    assert got == want
    assert router.counters.mixed_prefills > 0 and any(handed)
    assert router.counters.stale_dropped == 0 and router.counters.early_tree_rounds > 0


def test_verdicts_on_which_no_tree_is_made_post_an_empty_early_frame():
    """Where the drafter makes no tree on a round's verdicts (none below its bound, or a request it
    does not hold), it says so at once (`post(None, [])`, an empty EARLY frame across processes), so a
    verify that takes only the early trees goes on without them (spectandem/channel/trees.py)."""
    from drafter.calls import DrafterCalls

    calls = DrafterCalls(_spec().drafter)
    posted = []
    record = lambda tree, tags: posted.append((tree, tags))   # noqa: E731
    calls.draft_on([ExtendItem(Tag("nobody", 0, 9), [1, 2], None)], {"nobody": 100}, post=record)
    calls.draft_on([], {}, post=record)
    assert posted == [(None, []), (None, [])]
    assert calls.next_trees.made == 0


async def _prefilled(vlink, dlink, tokenizer, request_id, text):
    prompt = tokenizer.encode(text).ids
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    (res,) = await vlink.prefill([VerifierPrefillItem(Tag(request_id, 0, len(prompt)), prompt, params, 0)], True)
    assert await dlink.prefill([DrafterPrefillItem(res.tag, prompt, res.first_token_id, params, 0,
                                                   res.features)]) == []
    return res.tag


def _same_trees(a, b):
    assert a.request_ids == b.request_ids and a.committed_lens == b.committed_lens
    for name in ("token_ids", "parents", "node_valid"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name


def test_made_trees_are_the_draft_calls_and_other_asks_are_drafted_again():
    """One verify of two drafted requests hands its verdicts on: the next draft call for both
    tags takes the made trees (no draft in the engine), and they equal those the same engines
    make without the hand-off. A call for one of them with a depth cap drafts it again, with
    the catch-up left out that the drafter absorbed; `extend` and `draft_ahead` leave it out
    too."""
    def run(hand):
        spec = _spec()
        vlink, dlink = _links(spec, hand)
        drafts = []
        real = spec.drafter.draft
        spec.drafter.draft = lambda ids, steps=None: drafts.append(list(ids)) or real(ids, steps)

        async def go():
            tags = [await _prefilled(vlink, dlink, spec.tokenizer, rid, text)
                    for rid, text in (("a", PROMPT_TEXTS[0]), ("b", PROMPT_TEXTS[1]))]
            first = await dlink.draft(tags)
            bounds = {"a": 10_000, "b": 10_000}
            out = await (vlink.verify(first, [], True, draft_next=bounds) if hand else vlink.verify(first, [], True))
            items = [ExtendItem(v.tag, list(v.token_ids), v.features) for v in out]
            dlink._thread.submit(lambda: None).result()   # the drafter's queue is through draft_next's work
            drafts.clear()
            second = await dlink.draft([v.tag for v in out], None, items)
            return out, items, second, list(drafts)
        return spec, vlink, dlink, asyncio.run(go())

    _, _, _, (out0, _, second0, drafts0) = run(False)
    spec, vlink, dlink, (out1, items, second1, drafts1) = run(True)
    assert [(v.tag, v.token_ids) for v in out0] == [(v.tag, v.token_ids) for v in out1]
    assert drafts0 == [["a", "b"]] and drafts1 == []        # made on the verdict, not drafted again
    assert second1.tags == second0.tags and second1.unknown == []
    _same_trees(second1.payload, second0.payload)
    assert dlink.drafter.next_trees.made == 2 and dlink.drafter.next_trees.taken == 2
    assert not dlink.drafter.next_trees._absorbed                               # the call's catch-up was left out

    # Another round: a depth cap for "a" drafts it again (its catch-up, absorbed on the verdict,
    # left out), while "b" takes its made tree, of the configured depth.
    drafted = []
    real = spec.drafter.draft
    spec.drafter.draft = lambda ids, steps=None: drafted.append((list(ids), steps)) or real(ids, steps)

    async def again():
        out = await vlink.verify(second1, [], True, draft_next={"a": 10_000, "b": 10_000})
        dlink._thread.submit(lambda: None).result()
        drafted.clear()
        items = [ExtendItem(v.tag, list(v.token_ids), v.features) for v in out]
        return out, await dlink.draft([v.tag for v in out], [2, None], items)
    out2, capped = asyncio.run(again())
    assert drafted == [(["a"], [2])]
    assert capped.tags == [v.tag for v in out2] and capped.payload.request_ids == ["a", "b"]
    assert capped.payload.committed_lens == [v.tag.committed_len for v in out2]
    assert _depth(capped.payload, 0) == 2 and _depth(capped.payload, 1) == spec.drafter.cfg.num_steps
    assert dlink.drafter.next_trees.made == 4 and dlink.drafter.next_trees.taken == 3 and not dlink.drafter.next_trees._absorbed

    # A catch-up absorbed on the verdict and carried again by extend or draft_ahead is left out.
    async def third():
        out = await vlink.verify(capped, [], True, draft_next={"a": 10_000, "b": 10_000})
        items = [ExtendItem(v.tag, list(v.token_ids), v.features) for v in out]
        assert await dlink.extend(items[:1]) == []
        reply = await dlink.draft_ahead([items[1].tag], items[1:])
        return out, reply
    out3, reply = asyncio.run(third())
    assert reply.unknown == [] and not dlink.drafter.next_trees._absorbed
    for v in out3:
        spec.drafter.check_tag(v.tag.request_id, v.tag.epoch, v.tag.committed_len)


def _depth(tree, row: int) -> int:
    parents, valid = tree.parents[row].tolist(), tree.node_valid[row].tolist()
    depth = [0] * len(parents)
    for i, p in enumerate(parents):
        if p >= 0:
            depth[i] = depth[p] + 1
    return max(d for d, ok in zip(depth, valid) if ok)


def test_serve_hands_verdicts_on_where_the_tree_channel_is():
    def resolved(gpus, *argv):
        return draft_on_verdict(resolve_serve_flags(build_parser().parse_args(["serve", *argv]), Platform(gpus=gpus)))

    assert resolved(1, "--backend", "local") is False             # in-process: off unless asked for
    assert resolved(1, "--backend", "local", "--draft-on-verdict") is True
    assert resolved(1, "--backend", "local", "--no-draft-on-verdict") is False
    assert resolved(1, "--backend", "local", "--no-tree-channel") is False
    assert resolved(0, "--backend", "local") is False             # the CPU: one shared thread, no channel
    assert resolved(0, "--backend", "ray") is True and resolved(0, "--backend", "ray", "--no-draft-on-verdict") is False
    assert resolved(0, "--backend", "grpc") is True and resolved(0, "--backend", "grpc", "--no-draft-on-verdict") is False
    for gpus, argv in ((0, ("--backend", "grpc", "--no-tree-channel")), (1, ("--backend", "local", "--no-tree-channel")),
                       (0, ("--backend", "local"))):
        with pytest.raises(ValueError, match="--draft-on-verdict needs the tree channel"):
            resolved(gpus, *argv, "--draft-on-verdict")


def test_a_verifier_link_on_a_shared_thread_cannot_hand_verdicts_on():
    from concurrent.futures import ThreadPoolExecutor

    spec = _spec()
    shared = ThreadPoolExecutor(max_workers=1)
    try:
        with pytest.raises(ValueError, match="worker thread for each engine"):
            LocalVerifierLink(spec.verifier, drafter=LocalDrafterLink(spec.drafter, thread=shared))
    finally:
        shared.shutdown()


def test_a_request_prefilled_in_a_verify_step_reaches_the_drafter_with_the_verdicts_in_process():
    """In one process too: a request admitted in the verify step of a running one's round is
    prefilled on the drafter with that round's verdicts (no prefill call of the router's), and
    greedy and seeded tokens are those without the hand-off."""
    from tests.router.test_draft_on_verdict_links import _joined

    first = SamplingParams(max_tokens=60, ignore_eos=True)
    joins = [SamplingParams(max_tokens=24, ignore_eos=True),
             SamplingParams(max_tokens=24, temperature=0.9, seed=11, ignore_eos=True)]

    def run(hand, join):
        spec = _spec()
        vlink, dlink = _links(spec, hand)
        prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:2]]
        return asyncio.run(_joined(vlink, dlink, spec, prompts, first, join, max_len=256))

    for join in joins:
        got, counters, calls = run(True, join)
        want, control, control_calls = run(False, join)
        assert got == want
        assert counters.mixed_prefills == control.mixed_prefills == 1
        assert counters.prefills_with_verdicts == 1 and calls == (1, 1)
        assert control.prefills_with_verdicts == 0 and control_calls == (2, 0)


def test_a_prefill_with_the_verdicts_that_the_drafter_does_not_take_is_made_again_by_the_router(plain):
    """The drafter fails to take a joining request's prefill that came with the verdicts: the
    router's next draft call finds the request unknown there, and its resync prefills it; the
    tokens are the target's all the same. A prefill with the verdicts of a request released
    before it came is not taken."""
    from tests.router.test_draft_on_verdict_links import _joined

    first, join = SamplingParams(max_tokens=60, ignore_eos=True), SamplingParams(max_tokens=24, ignore_eos=True)
    spec = _spec()
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:2]]
    want = [c.token_ids for c in plain.generate(prompts, [first, join])]
    vlink, dlink = _links(spec)
    real, calls = spec.drafter.add_many, []

    def add_many(items):
        calls.append([i[0] for i in items])
        if len(calls) == 2:   # the first is the running request's prefill call, the second the joining one's
            raise ValueError("no room")
        return real(items)

    spec.drafter.add_many = add_many
    got, counters, (prefill_calls, with_verdicts) = asyncio.run(_joined(vlink, dlink, spec, prompts, first, join,
                                                                        max_len=256))
    assert got == want
    assert counters.prefills_with_verdicts == 1 and with_verdicts == 0   # sent, not taken
    assert prefill_calls == 2 and len(calls) == 3 and calls[1] == calls[2]   # the resync's
    assert counters.stale_dropped == 0

    # Released before its prefill came with a verdict: not taken.
    tree_calls = dlink.drafter
    tree_calls.release(["gone"])
    item = DrafterPrefillItem(Tag("gone", 0, 3), [1, 2], 3, join, 5, None)
    tree_calls.draft_on([], {"gone": 100}, prefills=[item])
    assert "gone" not in spec.drafter.requests and tree_calls.next_trees.prefilled == 0
