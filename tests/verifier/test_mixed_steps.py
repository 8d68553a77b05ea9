"""Prefills carried in a verify or decode step (verifier/runner.py `prompt_rows`,
`verify_and_prefill`, `decode_greedy`'s prompts; VerifierEngine.verify_with_prefill,
decode_with_prefill): the step's own results, the prompts' logits and features and the KV they
leave equal those of a prefill of their own followed by the step, in fp32 on the CPU, on the
dense path and on the tree attention's torch reference."""

from __future__ import annotations

import pytest
import torch

from spectandem.config import SamplingParams
from spectandem.demo import demo_paths
from spectandem.messages import DraftTree
from verifier import runner as runner_module
from verifier.engine import NewRequests, VerifierEngine
from verifier.runner import load_runner, mixed_count, prompt_rows

RUNNING = [[5, 6, 7, 8, 9, 10, 11], [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14]]
NEW = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [7, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]]
FEATURES = (2, 4, 6)


def test_prompt_rows_example():
    owner, base, tokens, parents, valid = prompt_rows([[1, 2, 3], [4, 5, 6, 7, 8]], 4)
    assert owner == [0, 1, 1] and base == [0, 0, 4]
    assert tokens.tolist() == [[1, 2, 3, 0], [4, 5, 6, 7], [8, 0, 0, 0]]
    assert valid.tolist() == [[True, True, True, False], [True] * 4, [True, False, False, False]]
    assert parents.tolist() == [[-1, 0, 1, 2]] * 3


def test_mixed_count_keeps_the_rows_within_the_budget(monkeypatch):
    monkeypatch.setattr(runner_module, "MIXED_PREFILL_TOKENS", 16)
    assert mixed_count([3, 5, 8], 4) == 2      # rows of 4 nodes: 4 + 8 = 12 fit, 8 more make 20
    assert mixed_count([3, 5, 8], 1) == 3      # 16 tokens: all
    assert mixed_count([3, 5, 9], 1) == 2
    assert mixed_count([17], 1) == 0
    assert mixed_count([], 5) == 0


def _pair(tree_attention: bool):
    """Two runners of the demo target, each with RUNNING prefilled in slots 0 and 1."""
    out = []
    for _ in range(2):
        runner, _ = load_runner(demo_paths("eagle3")[0], FEATURES, 6, 256)
        runner.triton_attention = tree_attention   # on the CPU: the tree attention's torch reference
        runner.prefill([0, 1], RUNNING)
        out.append(runner)
    return out


def _chain(b: int, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 200, (b, n), generator=g), torch.arange(-1, n - 1).expand(b, n).clone(),
            torch.ones(b, n, dtype=torch.bool))


@pytest.mark.parametrize("tree_attention", [False, True])
@pytest.mark.parametrize("n", [1, 3, 5])
def test_verify_and_prefill_equals_a_prefill_then_the_verify(tree_attention, n):
    mixed, apart = _pair(tree_attention)
    toks, parents, valid = _chain(2, n, n)
    lens = [len(p) for p in RUNNING]
    logits, feats, k, first, per = mixed.verify_and_prefill([0, 1], lens, toks, parents, valid, [2, 3, 4], NEW)
    assert k == 3
    ref_first, ref_per = apart.prefill([2, 3, 4], NEW)
    ref_logits, ref_feats = apart.verify([0, 1], lens, toks, parents, valid)
    torch.testing.assert_close(logits, ref_logits, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(feats, ref_feats, atol=5e-5, rtol=1e-5)
    torch.testing.assert_close(first, ref_first, atol=5e-5, rtol=1e-5)
    assert first.argmax(-1).tolist() == ref_first.argmax(-1).tolist()
    for got, want, p in zip(per, ref_per, NEW):
        assert got.shape == (len(p), want.shape[-1])
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)
    # The prompts' KV, and nothing past it, is what a prefill of their own leaves: a next step reads it.
    assert mixed.cache.stats() == apart.cache.stats()
    step = _chain(3, 2, 99)
    nxt = [mixed.verify([2, 3, 4], [len(p) for p in NEW], *step)[0] for mixed in (mixed, apart)]
    torch.testing.assert_close(nxt[0], nxt[1], atol=5e-5, rtol=1e-5)


def test_a_prompt_past_the_budget_is_left_to_the_caller(monkeypatch):
    monkeypatch.setattr(runner_module, "MIXED_PREFILL_TOKENS", 20)
    mixed, _ = _pair(False)
    toks, parents, valid = _chain(2, 5, 1)
    *_, k, first, per = mixed.verify_and_prefill([0, 1], [7, 12], toks, parents, valid, [2, 3, 4], NEW)
    assert k == 2 and first.shape[0] == 2 and len(per) == 2    # 15 + 5 nodes; the third's 15 more do not fit
    assert mixed.cache.blocks.tables.get(4) in (None, [])       # nothing of it written


@pytest.mark.parametrize("features", [True, False])
def test_decode_greedy_with_prompts_equals_a_prefill_then_the_decode(features):
    mixed, apart = _pair(True)
    lens, last = [len(p) for p in RUNNING], [p[-1] for p in RUNNING]
    tokens, feats, k, first, per = mixed.decode_greedy([0, 1], lens, last, 4, features, [2, 3], NEW[:2])
    ref_first, ref_per = apart.prefill([2, 3], NEW[:2])
    ref_tokens, ref_feats = apart.decode_greedy([0, 1], lens, last, 4, features)
    assert k == 2 and tokens.tolist() == ref_tokens.tolist()
    if features:
        torch.testing.assert_close(feats, ref_feats, atol=5e-5, rtol=1e-5)
    else:
        assert feats is None and ref_feats is None
    torch.testing.assert_close(first, ref_first, atol=5e-5, rtol=1e-5)
    for got, want in zip(per, ref_per):    # the prompts' features whether the step's are wanted or not
        torch.testing.assert_close(got, want, atol=5e-5, rtol=1e-5)


def _engines():
    out = []
    for _ in range(2):
        runner, model = load_runner(demo_paths("eagle3")[0], FEATURES, 6, 256)
        engine = VerifierEngine(runner, 6, model.spec.vocab_size)
        engine.prefill(["a", "b"], RUNNING, [SamplingParams()] * 2, [1, 2])
        out.append(engine)
    return out


def _new(ids):
    params = [SamplingParams(), SamplingParams(temperature=0.8, seed=7), SamplingParams(temperature=1.1, top_k=20)]
    return NewRequests(ids, NEW, params, [11, 12, 13])


def test_engine_verify_with_prefill_equals_prefill_then_verify():
    """First tokens (greedy and seeded samples), features, verdicts and the state after are the
    same; and the next verify of every request agrees."""
    mixed, apart = _engines()
    n = 4
    toks, parents, valid = _chain(2, n, 5)
    tree = lambda e: DraftTree(request_ids=["a", "b"], committed_lens=[e.committed_len("a"), e.committed_len("b")],
                               token_ids=toks, parents=parents, node_valid=valid, scores=torch.zeros(2, n))
    verdicts, outs = mixed.verify_with_prefill(tree(mixed), _new(["x", "y", "z"]))
    ref_outs = apart.prefill(*_new(["x", "y", "z"]).prefill_args())
    ref_verdicts = apart.verify(tree(apart))
    assert [o.first_token_id for o in outs] == [o.first_token_id for o in ref_outs]
    for o, r in zip(outs, ref_outs):
        torch.testing.assert_close(o.features, r.features, atol=5e-5, rtol=1e-5)
    assert [(v.tag, v.token_ids, v.num_accepted) for v in verdicts] == \
        [(v.tag, v.token_ids, v.num_accepted) for v in ref_verdicts]
    assert {k: r.token_ids for k, r in mixed.requests.items()} == {k: r.token_ids for k, r in apart.requests.items()}
    nxt = []
    for e in (mixed, apart):
        ids = sorted(e.requests)
        nxt.append(e.decode(ids, [e.committed_len(i) for i in ids], 1) if all(
            e.requests[i].params.greedy for i in ids) else e.verify(DraftTree(
                request_ids=ids, committed_lens=[e.committed_len(i) for i in ids],
                token_ids=torch.tensor([[e.requests[i].token_ids[-1]] for i in ids]),
                parents=torch.full((len(ids), 1), -1), node_valid=torch.ones(len(ids), 1, dtype=torch.bool),
                scores=torch.zeros(len(ids), 1))))
    assert [v.token_ids for v in nxt[0]] == [v.token_ids for v in nxt[1]]


def test_engine_decode_with_prefill_equals_prefill_then_decode():
    mixed, apart = _engines()
    verdicts, outs = mixed.decode_with_prefill(["a", "b"], [8, 13], 3, _new(["x", "y", "z"]))
    ref_outs = apart.prefill(*_new(["x", "y", "z"]).prefill_args())
    ref = apart.decode(["a", "b"], [8, 13], 3)
    assert [o.first_token_id for o in outs] == [o.first_token_id for o in ref_outs]
    assert [v.token_ids for v in verdicts] == [v.token_ids for v in ref]
    torch.testing.assert_close(verdicts[1].features, ref[1].features, atol=5e-5, rtol=1e-5)


def test_a_refused_prompt_refuses_the_call_before_anything_runs():
    mixed, _ = _engines()
    before = {k: list(r.token_ids) for k, r in mixed.requests.items()}
    free = list(mixed.free_slots)
    toks, parents, valid = _chain(2, 3, 2)
    tree = DraftTree(request_ids=["a", "b"], committed_lens=[8, 13], token_ids=toks, parents=parents,
                     node_valid=valid, scores=torch.zeros(2, 3))
    for bad in (NewRequests(["x", "a"], NEW[:2], [SamplingParams()] * 2, [1, 2]),       # "a" is active
                NewRequests(["x", "y"], [NEW[0], []], [SamplingParams()] * 2, [1, 2]),   # an empty prompt
                NewRequests(["x"], [[1] * 300], [SamplingParams()], [1])):               # past the context
        with pytest.raises(ValueError):
            mixed.verify_with_prefill(tree, bad)
        with pytest.raises(ValueError):
            mixed.decode_with_prefill(["a", "b"], [8, 13], 2, bad)
    assert {k: r.token_ids for k, r in mixed.requests.items()} == before and mixed.free_slots == free


def test_engine_on_the_transformers_runner_prefills_apart_with_the_same_results():
    """The transformers runner carries no prompts in its verify (verify_and_prefill leaves them
    all): the engine prefills them in the same call, with the results of a prefill then a verify."""
    engines = []
    for _ in range(2):
        runner, model = load_runner(demo_paths("eagle3")[0], FEATURES, 6, 256, force_hf=True)
        engine = VerifierEngine(runner, 6, model.config.vocab_size)
        engine.prefill(["a", "b"], RUNNING, [SamplingParams()] * 2, [1, 2])
        engines.append(engine)
    mixed, apart = engines
    toks, parents, valid = _chain(2, 3, 8)
    tree = DraftTree(request_ids=["a", "b"], committed_lens=[8, 13], token_ids=toks, parents=parents,
                     node_valid=valid, scores=torch.zeros(2, 3))
    verdicts, outs = mixed.verify_with_prefill(tree, _new(["x", "y", "z"]))
    ref_outs = apart.prefill(*_new(["x", "y", "z"]).prefill_args())
    ref = apart.verify(tree)
    assert [o.first_token_id for o in outs] == [o.first_token_id for o in ref_outs]
    assert [(v.tag, v.token_ids) for v in verdicts] == [(v.tag, v.token_ids) for v in ref]


def test_the_service_times_the_verifies_that_carry_prompts_apart():
    """verifier_verify_prefill (what the services run for a verify) times the engine's part of
    every call as "verify.engine", and of a call that carries new requests' prompts also as
    "verify.engine.with_prompts" (EngineInfo.calls), so that a profile tells the two apart."""
    from spectandem.call_clock import CallClock
    from spectandem.protocol import Tag, VerifierPrefillItem
    from verifier.service_core import verifier_verify_prefill

    runner, model = load_runner(demo_paths("eagle3")[0], FEATURES, 6, 256)
    engine = VerifierEngine(runner, 6, model.spec.vocab_size)
    engine.prefill(["a", "b"], RUNNING, [SamplingParams()] * 2, [1, 2])
    clock = CallClock()
    tags = [Tag("a", 0, 8), Tag("b", 0, 13)]
    for k, items in enumerate(([VerifierPrefillItem(Tag("x", 0, len(NEW[0])), NEW[0], SamplingParams(seed=3), 3)],
                               [], [])):
        toks, parents, valid = _chain(2, 3, 20 + k)
        tree = DraftTree(request_ids=["a", "b"], committed_lens=[t.committed_len for t in tags], token_ids=toks,
                         parents=parents, node_valid=valid, scores=torch.zeros(2, 3))
        verdicts, prefilled = verifier_verify_prefill(engine, tree, tags, [], False, items, False, clock=clock)
        assert len(prefilled) == len(items)
        tags = [v.tag for v in verdicts]
    stats = clock.stats()
    assert stats["count"]["verify.engine"] == 3 and stats["count"]["verify.engine.with_prompts"] == 1, stats
    assert 0 < stats["busy_s"]["verify.engine.with_prompts"] < stats["busy_s"]["verify.engine"], stats
