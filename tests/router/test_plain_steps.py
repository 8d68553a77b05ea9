"""Multi-step plain rounds (RouterConfig.plain_steps): a round without drafts whose requests are
all greedy decodes up to plain_steps tokens each in one verifier call (VerifierEngine.decode).
Real demo engines behind in-process links; tokens, finish reasons and text must equal plain
decoding's one step at a time (LocalSpeculator), with max_tokens, eos and stop strings falling
inside a call's steps; a request whose max_tokens ends inside the steps does not cut the others'
(only the batch's tail is cut, and such rounds are not measurements for "auto"); a sampled request in
the round makes it one step; with a drafter whose
speculation is switched off, the multi-token catch-ups reach it and tokens stay exact. The
steps cross the gRPC codec; a verify that mixes steps with drafts is refused."""

from __future__ import annotations

import asyncio

import pytest

from spectandem.protocol import PlainItem, Tag
from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS


class CountingVerifier(LocalVerifierLink):
    def __init__(self, engine):
        super().__init__(engine)
        self.steps: list[tuple[int, ...]] = []     # per verify call: each plain item's steps

    async def verify(self, draft, plain, want_features, on_launch=None):
        self.steps.append(tuple(p.steps for p in plain))
        return await super().verify(draft, plain, want_features, on_launch)


@pytest.fixture(scope="module")
def plain():
    return LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=256)


async def served(router: Router, prompts, params, engines=()) -> list[tuple[list[int], str, str]]:
    """Each request's (tokens, text, finish reason), the router started and stopped in the running
    event loop; then waits (up to 1 s) until `engines` hold nothing."""
    router.start()

    async def run(prompt, p):
        req = router.submit(prompt, p)
        toks, text = [], ""
        while True:
            ev = await req.events.get()
            toks += ev.token_ids
            text += ev.text
            if ev.finish_reason:
                return toks, text, ev.finish_reason
    try:
        got = await asyncio.gather(*(run(x, p) for x, p in zip(prompts, params)))
        for _ in range(50):
            if not any(e.requests for e in engines):
                break
            await asyncio.sleep(0.02)
        return got
    finally:
        await router.stop()


def _serve(router: Router, prompts, params, engines=()) -> list[tuple[list[int], str, str]]:
    """`served` in an event loop of its own."""
    return asyncio.run(served(router, prompts, params, engines))


def _expected(spec: LocalSpeculator, prompts, params):
    return [(c.token_ids, c.finish_reason) for c in spec.generate(prompts, params)]


def test_multi_step_plain_rounds_equal_one_step_decoding(plain):
    prompts = [plain.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:6]]
    # max_tokens that no step count divides; eos on; a stop string that ends one request early.
    params = [SamplingParams(max_tokens=m) for m in (5, 13, 40, 1, 22)] + [SamplingParams(max_tokens=40, stop=["(self"])]
    want = _expected(plain, prompts[:5], params[:5])
    vlink = CountingVerifier(plain.verifier)
    router = Router(vlink, None, plain.tokenizer, RouterConfig(max_len=256, eos_token_ids=plain.eos_token_ids,
                                                               lookahead=1, want_features=False, plain_steps=4))
    # "auto" keeping plain (a router without a drafter measures no mode: nothing to choose between).
    router._modes.choose = lambda num_running, drafter_up: "plain"
    recorded, record = [], router._modes.record
    router._modes.record = lambda mode, tokens, *rest, **kw: (recorded.append(tokens), record(mode, tokens, *rest, **kw))
    got = _serve(router, prompts, params, [plain.verifier])
    assert [(t, r) for t, _, r in got[:5]] == want
    for (toks, text, _), (wt, _) in zip(got[:5], want):
        assert text == plain.tokenizer.decode(wt)
    # The stop string: the text ends before it, as one-step decoding would end it.
    reference = plain.generate([prompts[5]], [SamplingParams(max_tokens=40)])[0]
    full = plain.tokenizer.decode(reference.token_ids)
    assert "(self" in full, "the stop-string case needs a continuation that contains it"
    assert got[5][2] == "stop" and got[5][1] == full[: full.index("(self")]
    assert max(max(s) for s in vlink.steps) == 4, vlink.steps
    assert len(vlink.steps) < sum(len(t) for t, _, _ in got) / 2     # far fewer calls than tokens
    # Rounds cut short by the requests' ends are not measurements of the mode's rate.
    full = [s for s in vlink.steps if min(s) == 4]
    assert 0 < len(full) < len(vlink.steps) and len(recorded) == len(full)
    assert not plain.verifier.requests


def test_a_request_ending_inside_the_steps_leaves_the_others_full_steps(plain):
    # The first request has 2 tokens left when both have 25 or 2: the call still decodes 4 steps
    # for both (the first keeps 2 of them and ends) instead of cutting both to 2; the second's
    # last call, alone, is cut to the 1 token it still wants.
    prompts = [plain.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:2]]
    params = [SamplingParams(max_tokens=7, ignore_eos=True), SamplingParams(max_tokens=30, ignore_eos=True)]
    want = _expected(plain, prompts, params)
    vlink = CountingVerifier(plain.verifier)
    router = Router(vlink, None, plain.tokenizer, RouterConfig(max_len=256, eos_token_ids=plain.eos_token_ids,
                                                               lookahead=1, want_features=False, plain_steps=4))
    router._modes.choose = lambda num_running, drafter_up: "plain"
    got = _serve(router, prompts, params, [plain.verifier])
    assert [(t, r) for t, _, r in got] == want
    assert [len(t) for t, _, _ in got] == [7, 30]
    both = [s for s in vlink.steps if len(s) == 2]
    assert len(both) == 2 and all(s == (4, 4) for s in both), vlink.steps
    assert vlink.steps[-1] == (1,) and all(s == (4,) for s in vlink.steps[2:-1]), vlink.steps
    assert not plain.verifier.requests


def test_a_sampled_request_makes_the_round_one_step(plain):
    prompts = [plain.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:3]]
    params = [SamplingParams(max_tokens=12), SamplingParams(max_tokens=12, temperature=0.8, seed=7),
              SamplingParams(max_tokens=30)]
    want = _expected(plain, prompts, params)
    vlink = CountingVerifier(plain.verifier)
    router = Router(vlink, None, plain.tokenizer, RouterConfig(max_len=256, eos_token_ids=plain.eos_token_ids,
                                                               lookahead=1, want_features=False, plain_steps=3))
    got = _serve(router, prompts, params)
    assert [(t, r) for t, _, r in got] == want
    # While the sampled request runs, every call is one step; after it ends, the rest chain 3.
    assert all(s == (1,) * len(s) for s in vlink.steps if len(s) == 3)
    assert any(3 in s for s in vlink.steps)


def test_multi_step_plain_rounds_with_a_drafter_switched_off(plain):
    t, d = demo_paths("eagle3")
    spec = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    prompts = [spec.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:4]]
    params = [SamplingParams(max_tokens=40, ignore_eos=True)] * len(prompts)
    want = [c.token_ids for c in plain.generate(prompts, params)]
    vlink = CountingVerifier(spec.verifier)
    # Speculation goes off after every 4 drafted request-rounds (an acceptance length no draft
    # reaches) for 3 rounds of up to 4 plain steps, then is tried again: the drafter catches up
    # on several multi-step rounds at once.
    router = Router(vlink, LocalDrafterLink(spec.drafter), spec.tokenizer, RouterConfig(
        max_len=256, eos_token_ids=spec.eos_token_ids, lookahead=spec.lookahead, want_features=True,
        pipeline="sequential", adaptive_window=4, adaptive_min_accept_length=99.0, adaptive_off_rounds=3,
        plain_steps=4))
    got = _serve(router, prompts, params)
    assert [t for t, _, _ in got] == want
    assert router.counters.plain_rounds > 0 and router.counters.num_drafts > 0
    assert router.counters.fallback_rounds == 0
    assert any(4 in s for s in vlink.steps)


def test_steps_cross_the_grpc_codec():
    from spectandem.codec import plain_item_from_msg, plain_item_to_msg
    from spectandem.v1 import engines_pb2

    item = PlainItem(Tag("a", 2, 17), 99, 5)
    assert plain_item_from_msg(plain_item_to_msg(item)) == item
    old = engines_pb2.PlainItem()                     # a sender that does not set steps: one step
    old.last_token_id = 3
    assert plain_item_from_msg(old).steps == 1


def test_steps_with_drafts_are_refused(plain):
    from spectandem.messages import root_only_tree
    from verifier.service_core import verifier_verify

    eng = plain.verifier
    prompt = plain.tokenizer.encode(PROMPT_TEXTS[0]).ids
    eng.prefill(["x", "y"], [prompt, prompt], [SamplingParams(max_tokens=8)] * 2, [0, 0])
    try:
        n = eng.committed_len("x")
        tree = root_only_tree(["x"], [n], [eng.requests["x"].token_ids[-1]])
        with pytest.raises(ValueError, match=r"plain steps must be 1 in a verify with drafts.*\[2\] with a tree"):
            verifier_verify(eng, tree, [Tag("x", 0, n)], [PlainItem(Tag("y", 0, n), 1, 2)], False)
        with pytest.raises(ValueError, match=r"alike for every plain item; got \[2, 3\]"):
            verifier_verify(eng, None, [], [PlainItem(Tag("x", 0, n), 1, 2), PlainItem(Tag("y", 0, n), 1, 3)], False)
        assert eng.committed_len("x") == eng.committed_len("y") == n    # nothing committed
    finally:
        eng.release("x")
        eng.release("y")
