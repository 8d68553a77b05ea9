"""Chained verifies (VerifierEngine.arm_next / take_verdict / launch_next and
LocalVerifierLink.stage_next; router/loop.py): in an "ahead" round the verifier, once it has
the verdict, starts the verify of the verdict's next
tree (drafted ahead, staged by the router) before the router asks for it. Real demo engines on
the CPU (fp32): the tokens equal plain decoding's, greedy and sampled; every chained launch is
used at batch 1; a launched verify that the router does not send (another tree, a release, a
decode) is dropped and the verdict is still exact."""

from __future__ import annotations

import asyncio

import pytest

from router.links import EngineUnavailable
from spectandem.protocol import Tag
from router.links_local import LocalChain, LocalDrafterLink, LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.messages import ReadyTree, trees_from_ready
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.link_harness import collect, drained

MAX_LEN = 256
CFG = SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4, ahead_width=4)

def _pair():
    spec = LocalSpeculator(*demo_paths("eagle3"), CFG, max_slots=4, max_len=MAX_LEN)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=4, max_len=MAX_LEN)
    return spec, plain


def _router(spec, vlink, dlink) -> Router:
    """A started Router in "ahead" over these links."""
    router = Router(vlink, dlink, spec.tokenizer,
                    RouterConfig(max_len=MAX_LEN, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead,
                                 want_features=True, pipeline="ahead"), chained=LocalChain(vlink, dlink))
    router.start()
    return router


def _serve(spec, prompts, params, chain: bool, dlink=None, vlink=None):
    """The prompts through a Router in "ahead" over the speculator's engines -> (tokens per
    prompt, router counters, verifier link)."""
    vlink = vlink or LocalVerifierLink(spec.verifier, chain=chain)
    dlink = dlink or LocalDrafterLink(spec.drafter)

    async def main():
        router = _router(spec, vlink, dlink)
        try:
            got = await asyncio.gather(*(collect(router, p, sp) for p, sp in zip(prompts, params)))
            await drained(spec)
            return [toks for toks, _ in got], router.counters
        finally:
            await router.stop()

    toks, counters = asyncio.run(main())
    return toks, counters, vlink


def test_chained_greedy_batch1_equals_plain_and_every_launch_is_used():
    spec, plain = _pair()
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[0]).ids
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    expected = plain.generate([prompt], [params])[0].token_ids
    before = spec.verifier.chained
    dlink = LocalDrafterLink(spec.drafter)
    (got,), c, vlink = _serve(spec, [prompt], [params], chain=True, dlink=dlink)
    assert got == expected
    used = spec.verifier.chained - before
    # Every hit's next round is a router-held tree; the verifier started most of them itself
    # (all but those too near the end, where the router does not arm), and used each one.
    assert c.ready_trees == c.draft_ahead_hits > 0
    assert vlink.chained_launches == used > 0
    # The trees went from the drafter's worker straight to the verifier (direct_stage), before
    # the router's own stage_next, in every armed round (each launch had them).
    assert vlink.direct_staged >= vlink.chained_launches
    # After each launch the drafter's next call started from the verifier's worker (pre_ahead),
    # and the router's own call of the same arguments took its reply every time.
    assert dlink.pre_ahead_used == vlink.chained_launches
    # Only rounds within lookahead tokens of the end are not armed (router/loop.py: _chains).
    assert used >= c.ready_trees - spec.lookahead
    assert not spec.verifier.requests and not spec.drafter.requests


@pytest.mark.parametrize("guard,ahead_after_miss,early", [(True, False, False), (True, True, False),
                                                          (True, True, True), (False, False, False),
                                                          (True, True, "corrupt")],
                         ids=["pre-draft", "ahead-after-miss", "early-launch", "control-double-absorb",
                              "control-early-tokens"])
def test_pre_draft_answers_the_draft_after_a_miss(guard, ahead_after_miss, early):
    """An armed verdict without a tree (a miss): the verifier's worker starts the drafter's
    catch-up and the next round's draft at once (LocalDrafterLink.pre_draft), and the router's
    draft call takes that tree; its extend call absorbs nothing twice. Tokens equal plain
    decoding's. With `ahead_after_miss` (the GPU's default), the draft-ahead for that tree
    follows in the drafter's worker and answers the router's draft-ahead call, while the
    router's extend of the miss waits only for the pre-draft. Control: with the double-absorb
    guard off, the router's extend absorbs the verdict again and the drafter goes down (the
    test's checks must see it). With `early` (the GPU's default), each miss's tree is launched
    as soon as its chain is drafted, its forward reading the drafter's tokens where they were
    drafted, and the host's tree confirms that launch. Control: with those device tokens
    changed, the tokens are no longer plain decoding's: the forward reads them."""
    spec, plain = _pair()
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[0]).ids   # the demo head misses often on it
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    expected = plain.generate([prompt], [params])[0].token_ids
    dlink = LocalDrafterLink(spec.drafter)
    dlink.ahead_after_miss = ahead_after_miss
    vlink = LocalVerifierLink(spec.verifier, chain=True)
    vlink.launch_missed_early = bool(early)
    if early == "corrupt":
        launch = vlink._launch_missed_early

        def corrupted(tree, tokens, ready):
            tokens = (tokens + 1) % spec.verifier.vocab_size
            return launch(tree, tokens, ready)
        vlink._launch_missed_early = corrupted
    if not guard:
        dlink._unabsorbed = lambda items: items
    (got,), c, vlink = _serve(spec, [prompt], [params], chain=True, dlink=dlink, vlink=vlink)
    if early == "corrupt":
        assert got != expected and vlink.missed_early_launches > 0
        return
    assert got == expected
    ok = c.fallback_rounds == 0 and c.draft_ahead_misses > 0 and dlink.pre_draft_used >= c.draft_ahead_misses // 2
    assert ok == guard, (c, dlink.pre_draft_used)
    if guard:   # every chained launch still had its pre-ahead
        assert dlink.pre_ahead_used == vlink.chained_launches > 0
        # Each pre-draft's tree was launched from the drafter's worker (`_launch_missed`) and the
        # router's verify of it took that forward (the engine counts both kinds of launch).
        assert vlink.missed_launches == dlink.pre_draft_used == spec.verifier.launched_early > 0
        # With it on, each of those trees had its draft-ahead from the drafter's worker, and
        # the router's draft-ahead call of that round took it (off: none).
        assert dlink.ahead_after_miss_used == (dlink.pre_draft_used if ahead_after_miss else 0)
        # Early: every one of those launches went out from the drafter's tokens and was
        # confirmed by the host's tree (off: none).
        assert vlink.missed_early_launches == spec.verifier.launched_from_device == (
            vlink.missed_launches if early else 0)


def test_chained_batch_sampled_and_greedy_equal_unchained():
    """Three requests at once (one sampled at temperature 0.3, under
    the drafts-sampling threshold: deterministic drafts, draws keyed by its seed): the same
    tokens with and without chaining, and the greedy ones equal plain decoding's."""
    spec, plain = _pair()
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:3]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True),
              SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.3, seed=11),
              SamplingParams(max_tokens=40, ignore_eos=True)]
    unchained, _, off = _serve(spec, prompts, params, chain=False)
    chained, _, on = _serve(spec, prompts, params, chain=True)
    assert off.chained_launches == 0 and on.chained_launches > 0
    assert chained == unchained
    for i in (0, 2):
        assert chained[i] == plain.generate([prompts[i]], [params[i]])[0].token_ids


def _chain_once(spec, rid: str, tree_for):
    """Prefill `rid`, verify a root-only tree armed for chaining, stage `tree_for(verdict)` for the
    verdict's outcome and launch -> (committed tokens so far, whether it launched)."""
    eng = spec.verifier
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[1]).ids
    first = eng.prefill([rid], [prompt], [SamplingParams(max_tokens=32)], [0])[0].first_token_id
    n = eng.committed_len(rid)
    root = trees_from_ready([rid], [n], [ReadyTree((first,), (-1,), (0.0,))])
    eng.arm_next([rid], [n])
    out = eng.verify(root)[0]
    launched = eng.launch_next(eng.take_verdict(), [{tuple(out.token_ids): tree_for(out.token_ids)}])
    return list(eng.requests[rid].token_ids), launched


def _reference(plain, tokens: list[int], ready: ReadyTree) -> list:
    """The verdict of `tree` on another engine of the same target (never chained), for a request
    with the same committed tokens."""
    eng = plain.verifier
    eng.prefill(["ref"], [tokens], [SamplingParams(max_tokens=32)], [0], resume=[True])
    out = eng.verify(trees_from_ready(["ref"], [len(tokens)], [ready]))[0]
    eng.release("ref")
    return [out.token_ids, out.num_accepted]


def _greedy_next(plain, tokens: list[int], k: int) -> list[int]:
    eng = plain.verifier
    eng.prefill(["next"], [tokens], [SamplingParams(max_tokens=32)], [0], resume=[True])
    out = eng.decode(["next"], [len(tokens)], k)[0].token_ids
    eng.release("next")
    return out


def test_launched_verify_is_used_only_for_its_own_tree():
    spec, plain = _pair()
    eng = spec.verifier
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[1]).ids
    # The staged tree drafts the target's own two next tokens after the verdict (both accepted).
    first = eng.prefill(["probe"], [prompt], [SamplingParams(max_tokens=32)], [0])[0].first_token_id
    eng.release("probe")
    t1 = _greedy_next(plain, prompt + [first], 1)[0]
    ahead = _greedy_next(plain, prompt + [first, t1], 2)
    chain = lambda toks: ReadyTree((toks[-1], *ahead), (-1, 0, 1), (0.0, -1.0, -2.0))
    tokens, launched = _chain_once(spec, "a", chain)
    assert launched and tokens == prompt + [first, t1]
    n = len(tokens)
    other_ready = ReadyTree((tokens[-1], 9, 4), (-1, 0, 1), (0.0, -1.0, -2.0))
    other = trees_from_ready(["a"], [n], [other_ready])
    expected_other = _reference(plain, tokens, other_ready)
    expected_same = _reference(plain, tokens, chain(tokens))
    # The two trees' verdicts differ (2 accepted against 0): using the wrong launch would show.
    assert expected_same[1] == 2 and expected_same[0][:2] == ahead and expected_other[1] == 0

    # Another tree at the same length: the launch is dropped, the verdict is the fresh one's.
    before = eng.chained
    out = eng.verify(other)[0]
    assert [out.token_ids, out.num_accepted] == expected_other and eng.chained == before and not eng.last_chained
    eng.release("a")

    # Its own tree: served by the launch (and the same verdict as a fresh verify).
    tokens2, launched = _chain_once(spec, "b", chain)
    assert launched and tokens2 == tokens
    out = eng.verify(trees_from_ready(["b"], [n], [chain(tokens)]))[0]
    assert [out.token_ids, out.num_accepted] == expected_same and eng.chained == before + 1 and eng.last_chained
    eng.release("b")


def test_launched_verify_dropped_by_release_decode_and_missing_trees():
    spec, _ = _pair()
    eng = spec.verifier
    chain = lambda toks: ReadyTree((toks[-1], 5), (-1, 0), (0.0, -1.0))
    _, launched = _chain_once(spec, "a", chain)
    assert launched and eng._launched is not None
    eng.release("a")
    assert eng._launched is None and not eng.requests

    tokens, launched = _chain_once(spec, "b", chain)
    assert launched
    out = eng.decode(["b"], [len(tokens)], 2)[0]     # a decode: the launch is dropped, decode is exact
    assert eng._launched is None and len(out.token_ids) == 2
    eng.release("b")

    # No tree for the verdict's outcome, or nothing staged: nothing is launched.
    _, launched = _chain_once(spec, "c", lambda toks: None)
    assert not launched and eng._launched is None
    eng.release("c")
    eng.arm_next(["d"], [1])
    assert eng.launch_next(eng.take_verdict(), [None]) is False    # armed for a verify that never came


def test_unarmed_verify_never_launches():
    spec, _ = _pair()
    eng = spec.verifier
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[2]).ids
    first = eng.prefill(["x"], [prompt], [SamplingParams(max_tokens=32)], [0])[0].first_token_id
    n = eng.committed_len("x")
    out = eng.verify(trees_from_ready(["x"], [n], [ReadyTree((first,), (-1,), (0.0,))]))[0]
    trees = [{tuple(out.token_ids): ReadyTree((out.token_ids[-1],), (-1,), (0.0,))}]
    assert eng.take_verdict() is None and eng.launch_next(None, trees) is False and eng._launched is None
    eng.release("x")
    assert not eng.requests


def test_failed_pre_draft_fails_the_next_call_once(monkeypatch):
    """A pre-draft whose engine call fails: the router's draft it covers raises EngineUnavailable
    (the router then takes the drafter down), and only that one call."""
    import drafter.service_core

    spec, _ = _pair()
    dlink = LocalDrafterLink(spec.drafter)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(drafter.service_core, "drafter_extend", boom)
    tags = [Tag("gone", 0, 5)]
    assert dlink.pre_draft(tags, [])

    async def main():
        with pytest.raises(EngineUnavailable, match="pre-draft failed: boom"):
            await dlink.draft(tags)
        return await dlink.release(["gone"])

    asyncio.run(main())
    assert dlink.pre_draft_used == 0 and dlink.pre_drafts == 1


def test_failed_pre_ahead_fails_the_next_call_once(monkeypatch):
    """A pre-ahead whose engine call fails: the router's call it covers raises EngineUnavailable
    (the router then takes the drafter down), and only that one call."""
    import drafter.service_core

    spec, _ = _pair()
    dlink = LocalDrafterLink(spec.drafter)

    def boom(*args, **kwargs):
        raise RuntimeError("boom")

    monkeypatch.setattr(drafter.service_core, "drafter_draft_ahead", boom)
    tags = [Tag("gone", 0, 5)]
    assert dlink.pre_ahead(tags, [])

    async def main():
        with pytest.raises(EngineUnavailable, match="pre-ahead failed: boom"):
            await dlink.draft_ahead(tags, [])
        return await dlink.extend([])

    assert asyncio.run(main()) == [] and dlink.pre_ahead_used == 0


def test_holds_keep_the_tokens_and_order_the_handoffs(monkeypatch):
    """The two holds of the GPU path, turned on here on the CPU: the verifier's worker returns a
    verdict only once the drafter's next call has queued its drafting (drafter_first_s), and a
    pre-ahead whose trees went straight to the armed verify reports done only once that verify
    launched from them (launch_first_s). Tokens equal plain decoding's, every launch is still
    used, and every such pre-ahead finished after its staging was taken and after the drafter's
    call its verdict started (the follower, next in the same thread) queued its drafting."""
    from router import link_handoffs

    spec, plain = _pair()
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[0]).ids
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    expected = plain.generate([prompt], [params])[0].token_ids
    events, order, followed = [], [], []
    taken, finish = link_handoffs.StagedTrees.taken, link_handoffs._PreCall.finish
    monkeypatch.setattr(link_handoffs.StagedTrees, "taken", lambda self: (events.append(("taken", id(self))),
                                                                         taken(self)))

    def finished(self, reply):
        if self.staged_into is not None:
            order.append(("taken", id(self.staged_into)) in events)
            follower = self.staged_into.follower
            if follower is not None:
                followed.append(follower is not self and follower.wait_queued(0.0))
        finish(self, reply)
    monkeypatch.setattr(link_handoffs._PreCall, "finish", finished)
    dlink = LocalDrafterLink(spec.drafter)
    dlink.launch_first_s = 5.0
    vlink = LocalVerifierLink(spec.verifier, chain=True)
    vlink.drafter_first_s = 5.0
    (got,), _, _ = _serve(spec, [prompt], [params], chain=True, dlink=dlink, vlink=vlink)
    assert got == expected
    assert dlink.pre_ahead_used == vlink.chained_launches > 0
    assert order and all(order), order
    assert followed and all(followed), followed
