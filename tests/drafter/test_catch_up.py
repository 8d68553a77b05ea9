"""Draft-head catch-up on the real demo target and heads (fp32, CPU).

Catch-up writes K/V for every new (feature p, token p + 1) pair but runs the rest of the layer
only for each request's last pair. These tests hold it to the full computation, to each
request run alone, and to one catch-up over all pairs.
"""

import pytest
import torch

from drafter.proposers import EagleProposer
from spectandem.kv_cache import KVCache
from tests.drafter.proposer_helpers import (ATOL, LOOSE, MAX_LEN, _cfg, _entries, _features, _gen, _request,
                                            _tokens)


# ---------------------------------------------------------------- DraftHead.run: reduced == full

@torch.no_grad()
def test_reduced_query_rows_equal_full(head) -> None:
    s = head.spec
    b, base, num_new = 3, torch.tensor([0, 4, 9]), torch.tensor([6, 2, 5])
    t = int(num_new.max())
    toks = torch.randint(0, s.vocab_size, (b, t), generator=_gen(1))
    hidden = head.project(torch.randn(b, t, s.feature_size, generator=_gen(2)))
    caches = [KVCache(1, 4, s.num_kv_heads, 32, s.head_dim, torch.float32) for _ in range(2)]
    prefix = torch.randn(caches[0].k[0].shape, generator=_gen(3))      # earlier entries (and garbage)
    for c in caches:
        c.k[0].copy_(prefix)
        c.v[0].copy_(-prefix)
    slots = torch.tensor([2, 0, 3])
    ar = torch.arange(t)
    positions = base[:, None] + ar                                       # [B, T]
    live = ar[None] < num_new[:, None]                                   # [B, T]
    write = torch.where(live, positions, caches[0].trash_index)
    end = base + num_new
    span = int(end.max())
    cols = torch.arange(span)

    last = (num_new - 1)[:, None]                                        # [B, 1]
    reduced_mask = (cols[None, None] < end[:, None, None])               # [B, 1, span]
    reduced = head.run(toks, hidden, positions, caches[0].batch(slots, write, span), reduced_mask, last)

    every = ar.expand(b, t)                                              # [B, T]
    full_mask = (cols[None, None] <= positions[..., None]) & (cols[None, None] < end[:, None, None])
    full = head.run(toks, hidden, positions, caches[1].batch(slots, write, span), full_mask, every)

    assert reduced.shape == (b, 1, s.hidden_size)
    assert full.shape == (b, t, s.hidden_size)
    assert head.logits(reduced).shape == (b, 1, s.draft_vocab_size)
    torch.testing.assert_close(reduced[:, 0], full[torch.arange(b), num_new - 1], atol=ATOL, rtol=0)
    torch.testing.assert_close(head.logits(reduced)[:, 0], head.logits(full)[torch.arange(b), num_new - 1],
                               atol=ATOL, rtol=0)
    real = slice(0, caches[0].max_len)                                   # all but the trash row
    assert torch.equal(caches[0].k[0][:, :, real], caches[1].k[0][:, :, real])
    assert torch.equal(caches[0].v[0][:, :, real], caches[1].v[0][:, :, real])
    # exactly the new entries were written, each request in its own slot
    changed = (caches[0].k[0][:, :, real] != prefix[:, :, real]).any(-1).any(1)    # [slots, max_len]
    expected = torch.zeros_like(changed)
    for i in range(b):
        expected[slots[i], base[i]: end[i]] = True
    assert torch.equal(changed, expected)


# ---------------------------------------------------------------- EagleProposer.catch_up

@torch.no_grad()
def _manual_catch_up(head, tokens: list[int], feats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented convention, computed in full: pair (feature p, token p + 1) at position p,
    causal attention, output of the last pair. -> (hidden [H], logits [Vd])."""
    n = len(tokens) - 1
    s = head.spec
    cache = KVCache(1, 1, s.num_kv_heads, MAX_LEN, s.head_dim, torch.float32)
    pos = torch.arange(n)[None]
    mask = torch.ones(n, n, dtype=torch.bool).tril()[None]
    out = head.run(torch.tensor([tokens[1:]]), head.project(feats[None]), pos,
                   cache.batch(torch.tensor([0]), pos, n), mask, pos)
    return out[0, -1], head.logits(out[0, -1])


def test_ragged_batch_equals_each_alone(head) -> None:
    cfg = _cfg(head)
    lens = [9, 4, 13]                       # committed lengths after the prefill
    more = [3, 1, 5]                        # pairs absorbed by the extend
    toks = [_tokens(n + m, seed=10 + i) for i, (n, m) in enumerate(zip(lens, more))]
    feats = [_features(head, n + m - 1, seed=20 + i) for i, (n, m) in enumerate(zip(lens, more))]

    batched = EagleProposer(head, cfg, max_slots=4, max_len=MAX_LEN)
    reqs = [_request(f"r{i}", toks[i][: lens[i]]) for i in range(3)]
    batched.catch_up(reqs, [n - 1 for n in lens], [f[: n - 1] for f, n in zip(feats, lens)])
    for i, r in enumerate(reqs):
        assert batched.cache_len[r.request_id] == r.committed_len - 1
        hidden, logits = _manual_catch_up(head, toks[i][: lens[i]], feats[i][: lens[i] - 1])
        torch.testing.assert_close(batched.last_hidden[r.request_id], hidden, **LOOSE)
        torch.testing.assert_close(batched.last_logits[r.request_id], logits, **LOOSE)
    for i, r in enumerate(reqs):
        r.token_ids.extend(toks[i][lens[i]:])
    batched.catch_up(reqs, more, [f[n - 1:] for f, n in zip(feats, lens)])

    for i, r in enumerate(reqs):
        alone = EagleProposer(head, cfg, max_slots=1, max_len=MAX_LEN)
        solo = _request("solo", toks[i])
        alone.catch_up([solo], [len(toks[i]) - 1], [feats[i]])
        rid = r.request_id
        assert batched.cache_len[rid] == r.committed_len - 1 == alone.cache_len["solo"]
        assert batched.last_hidden[rid].shape == (head.spec.hidden_size,)
        assert batched.last_logits[rid].shape == (head.spec.draft_vocab_size,)
        torch.testing.assert_close(batched.last_hidden[rid], alone.last_hidden["solo"], atol=ATOL, rtol=0)
        torch.testing.assert_close(batched.last_logits[rid], alone.last_logits["solo"], atol=ATOL, rtol=0)
        for mine, theirs in zip(_entries(batched, rid), _entries(alone, "solo")):
            torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)
        hidden, logits = _manual_catch_up(head, toks[i], feats[i])
        torch.testing.assert_close(batched.last_logits[rid], logits, **LOOSE)


def test_prefill_then_extend_equals_one_catch_up(head) -> None:
    cfg = _cfg(head)
    toks = _tokens(20, seed=30)
    feats = _features(head, 19, seed=31)
    steps = EagleProposer(head, cfg, max_slots=2, max_len=MAX_LEN)
    req = _request("a", toks[:8])
    steps.catch_up([req], [7], [feats[:7]])
    for end in (11, 12, 20):                     # extends of 3, 1 and 8 pairs
        new = end - req.committed_len
        req.token_ids.extend(toks[req.committed_len: end])
        steps.catch_up([req], [new], [feats[end - 1 - new: end - 1]])
        assert steps.cache_len["a"] == req.committed_len - 1 == end - 1
    once = EagleProposer(head, cfg, max_slots=2, max_len=MAX_LEN)
    once.catch_up([_request("a", toks)], [19], [feats])
    torch.testing.assert_close(steps.last_logits["a"], once.last_logits["a"], atol=ATOL, rtol=0)
    torch.testing.assert_close(steps.last_hidden["a"], once.last_hidden["a"], atol=ATOL, rtol=0)
    for mine, theirs in zip(_entries(steps, "a"), _entries(once, "a")):
        torch.testing.assert_close(mine, theirs, atol=ATOL, rtol=0)


def test_catch_up_rejects_pairs_that_do_not_follow(head) -> None:
    p = EagleProposer(head, _cfg(head), max_slots=1, max_len=MAX_LEN)
    req = _request("a", _tokens(6, seed=40))
    with pytest.raises(AssertionError):
        p.catch_up([req], [4], [_features(head, 4, seed=41)])      # 5 pairs are new, not 4
