"""The drafter engine (drafter/engine.py) over an EagleProposer on the real demo target and heads
(fp32, CPU): add, extend, stale verdicts, removal, sampled draft probabilities and their store,
and held-back rounds absorbed in one catch-up."""

import pytest
import torch

from drafter.engine import DrafterEngine, DraftProbStore
from drafter.proposers import EagleProposer
from spectandem.config import SamplingParams
from spectandem.messages import StaleMessage
from spectandem.protocol import Tag, Verdict
from tests.drafter.proposer_helpers import LOOSE, MAX_LEN, _cfg, _features, _tokens


def _verify_output(rid, committed_len, tokens, feats) -> Verdict:
    return Verdict(Tag(rid, 0, committed_len), token_ids=tokens, num_accepted=len(tokens) - 1, num_draft_tokens=4,
                   features=feats)


def _engine(head, **kw) -> DrafterEngine:
    cfg = _cfg(head, num_steps=3, topk=2, num_draft_tokens=6, **kw)
    return DrafterEngine(EagleProposer(head, cfg, max_slots=4, max_len=MAX_LEN), cfg)


def test_engine_add_extend_and_stale(head) -> None:
    engine = _engine(head)
    prompt = _tokens(10, seed=60)
    engine.add("a", prompt, 77, SamplingParams(), seed=1, features=_features(head, 10, seed=61))
    engine.add("b", prompt[:6], 78, SamplingParams(), seed=2, features=_features(head, 6, seed=62))
    prop = engine.proposer
    assert engine.requests["a"].committed_len == 11 and prop.cache_len["a"] == 10
    assert engine.requests["b"].committed_len == 7 and prop.cache_len["b"] == 6

    tree = engine.draft(["a", "b"])
    assert tree.committed_lens == [11, 7]
    assert tree.token_ids[:, 0].tolist() == [77, 78]
    assert tree.node_valid.all() and tree.draft_probs is None

    engine.extend([_verify_output("a", 14, [5, 6, 7], _features(head, 3, seed=63)),
                   _verify_output("b", 8, [9], _features(head, 1, seed=64))])
    assert engine.requests["a"].token_ids[-4:] == [77, 5, 6, 7]
    for rid in ("a", "b"):
        assert prop.cache_len[rid] == engine.requests[rid].committed_len - 1
    state = {rid: (engine.requests[rid].committed_len, prop.cache_len[rid], prop.last_logits[rid].clone())
             for rid in ("a", "b")}

    with pytest.raises(StaleMessage):           # "a" is at 14: 3 more tokens make 17, not 18
        engine.extend([_verify_output("a", 18, [1, 2, 3], _features(head, 3, seed=65))])
    with pytest.raises(StaleMessage):           # a repeated (old) verdict
        engine.extend([_verify_output("a", 14, [5, 6, 7], _features(head, 3, seed=63))])
    # a stale verdict in a batch leaves every request of the batch as it was
    with pytest.raises(StaleMessage):
        engine.extend([_verify_output("b", 9, [4], _features(head, 1, seed=66)),
                       _verify_output("a", 99, [1], _features(head, 1, seed=67))])
    for rid, (committed, cached, logits) in state.items():
        assert engine.requests[rid].committed_len == committed
        assert prop.cache_len[rid] == cached
        assert torch.equal(prop.last_logits[rid], logits)
    # and the valid verdict still goes through afterwards
    engine.extend([_verify_output("b", 9, [4], _features(head, 1, seed=66))])
    assert engine.requests["b"].committed_len == 9 and prop.cache_len["b"] == 8

    engine.remove("a")
    assert "a" not in engine.requests and "a" not in prop.cache_len and "a" not in prop.slots.of


def test_engine_sampled_draft_probs_are_tagged(head) -> None:
    engine = _engine(head)
    params = SamplingParams(temperature=1.0, seed=3)
    engine.add("s", _tokens(8, seed=70), 12, params, seed=3, features=_features(head, 8, seed=71))
    tree = engine.draft(["s"])
    assert tree.sampled == [True]
    assert tree.draft_probs is not None and tree.draft_probs.shape[-1] == head.spec.vocab_size
    inner = tree.draft_probs[0].sum(-1)
    assert torch.allclose(inner[0], torch.tensor(1.0, dtype=torch.float64))
    with pytest.raises(StaleMessage):
        engine.store.take("s", 8)
    rows = engine.store.take("s", 9)            # a stale take must not consume the round's rows
    torch.testing.assert_close(rows, tree.draft_probs[0, : rows.shape[0]], atol=0, rtol=0)
    assert len(engine.store) == 0


def test_draft_prob_store() -> None:
    store = DraftProbStore()
    probs = torch.full((3, 5), 0.2, dtype=torch.float64)
    store.put("x", 10, probs)
    with pytest.raises(StaleMessage, match="10"):
        store.take("x", 11)
    assert len(store) == 1
    assert store.take("x", 10) is probs
    assert len(store) == 0
    store.put("x", 12, probs)
    store.put("x", 13, probs * 2)               # a new round replaces the old rows
    with pytest.raises(StaleMessage):
        store.take("x", 12)
    store.drop("x")
    store.drop("x")
    assert len(store) == 0



def test_engine_extend_absorbs_held_back_rounds_in_one_catch_up(head) -> None:
    """Rounds a request was decoded plainly come in one call, in order (the router's backlog):
    the engine joins them into one catch-up, which leaves the head where two calls leave it
    (catch-up over several pairs equals pair by pair, up to summation order)."""
    prompt = _tokens(10, seed=70)
    feats = [_features(head, 10, seed=71), _features(head, 1, seed=72), _features(head, 2, seed=73)]
    engines = [_engine(head), _engine(head)]
    for e in engines:
        e.add("a", prompt, 77, SamplingParams(), seed=1, features=feats[0])
        e.add("b", prompt[:6], 78, SamplingParams(), seed=2, features=_features(head, 6, seed=74))
    rounds = [_verify_output("a", 12, [5], feats[1]), _verify_output("a", 14, [6, 7], feats[2])]
    for out in rounds:
        engines[0].extend([out])
    calls = []
    inner = engines[1].proposer.catch_up
    engines[1].proposer.catch_up = lambda reqs, n, f: (calls.append(list(n)), inner(reqs, n, f))
    engines[1].extend([*rounds, _verify_output("b", 8, [9], _features(head, 1, seed=75))])
    assert calls == [[3, 1]], "both held-back rounds of 'a' in one catch-up, beside 'b'"
    one, two = (e.proposer for e in engines)
    assert engines[1].requests["a"].token_ids == engines[0].requests["a"].token_ids
    assert one.cache_len["a"] == two.cache_len["a"] == 13
    torch.testing.assert_close(two.last_logits["a"], one.last_logits["a"], **LOOSE)
    with pytest.raises(StaleMessage):        # a gap between the rounds is refused, nothing applied
        engines[1].extend([_verify_output("b", 10, [1], _features(head, 1, seed=76)),
                           _verify_output("b", 13, [2], _features(head, 1, seed=77))])
    assert engines[1].requests["b"].committed_len == 8
