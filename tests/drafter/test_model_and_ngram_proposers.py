"""The proposers other than EAGLE, on the real demo models (fp32, CPU): the draft model's
catch-up and proposals against a plain causal forward and each request alone, and n-gram
lookup."""

import pytest
import torch

from drafter.lm_proposers import DraftModelProposer, NgramProposer
from spectandem.config import SpecConfig
from spectandem.kv_cache import KVCache
from spectandem.modeling.llama import load_llama
from tests.drafter.proposer_helpers import ATOL, MAX_LEN, MODELS, _request, _tokens


@pytest.fixture(scope="module")
def draft_lm():
    return load_llama(f"{MODELS}/draft-lm", torch.float32)


def test_draft_model_catch_up_and_propose(draft_lm) -> None:
    cfg = SpecConfig(method="draft-model", num_steps=3, topk=2, num_draft_tokens=6)
    toks = [_tokens(15, seed=80), _tokens(9, seed=81)]
    steps = DraftModelProposer(draft_lm, cfg, max_slots=2, max_len=MAX_LEN)
    reqs = [_request("a", toks[0][:6]), _request("b", toks[1][:4])]
    steps.catch_up(reqs, [5, 3], [None, None])
    reqs[0].token_ids.extend(toks[0][6:])
    reqs[1].token_ids.extend(toks[1][4:])
    steps.catch_up(reqs, [9, 5], [None, None])
    tree = steps.propose(reqs)
    for i, r in enumerate(reqs):
        assert steps.cache_len[r.request_id] == r.committed_len
        once = DraftModelProposer(draft_lm, cfg, max_slots=1, max_len=MAX_LEN)
        solo = _request("solo", toks[i])
        once.catch_up([solo], [len(toks[i]) - 1], [None])
        torch.testing.assert_close(steps.last_logits[r.request_id], once.last_logits["solo"], atol=ATOL, rtol=0)
        # a plain causal forward over all tokens gives the same next-token logits
        t = len(toks[i])
        cache = KVCache(draft_lm.spec.num_layers, 1, draft_lm.spec.num_kv_heads, MAX_LEN,
                        draft_lm.spec.head_dim, torch.float32)
        pos = torch.arange(t)[None]
        with torch.no_grad():
            hidden, _ = draft_lm(torch.tensor([toks[i]]), pos, cache.batch(torch.tensor([0]), pos, t),
                                 torch.ones(t, t, dtype=torch.bool).tril()[None])
        torch.testing.assert_close(steps.last_logits[r.request_id], draft_lm.logits(hidden)[0, -1],
                                   atol=ATOL, rtol=0)
        alone = once.propose([solo])
        assert torch.equal(alone.token_ids[0], tree.token_ids[i])
        assert torch.equal(alone.parents[0], tree.parents[i])


def test_ngram_lookup() -> None:
    cfg = SpecConfig(method="ngram", num_steps=3, topk=1, num_draft_tokens=8, ngram_max=3, ngram_min=1)
    prop = NgramProposer(cfg)
    reqs = [_request("a", [1, 2, 3, 9, 8, 1, 2, 3]),      # [1, 2, 3] occurred: propose what followed
            _request("b", [5, 6, 7]),                      # nothing repeats
            _request("c", [4, 1, 4, 2, 4])]                # latest earlier occurrence of [4] wins
    tree = prop.propose(reqs)
    assert tree.token_ids.tolist() == [[9, 8, 1], [-1, -1, -1], [2, 4, -1]]
    assert tree.parents.tolist() == [[0, 1, 2]] * 3
    assert tree.scores[1].eq(float("-inf")).all()
    assert tree.scores[0].eq(0).all()
