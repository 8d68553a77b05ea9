"""On the CPU: the padded static-shape catch-up (what CatchUpGraphs replays), run eagerly, leaves an
EagleProposer in the state the eager `catch_up` leaves it in: the same cache lengths, and last
hidden, logits and committed K/V entries to a few ulps, with exactly the new pairs' rows (and the
trash row) written. Both demo heads, ragged pair counts (1..5), padding rows, prefills in the
prefill pair buckets, catch-ups past the largest pair bucket (run eagerly), and the next drafts
equal."""

from __future__ import annotations

import pytest
import torch

from drafter.catchup_graphs import CatchUpGraphs
from drafter.proposers import DraftRequest, EagleProposer
from spectandem.config import SamplingParams, SpecConfig

MAX_LEN = 128
# Padded and unpadded sgemm block differently, and how far apart they round depends on the CPU's
# kernels: on one machine hidden values of about 7 differed by 1.0e-5 and logits by 1.5e-5 (these
# tolerances passed on others at 1e-5). A wrong row, position or mask moves them by 1e-2 or more.
ATOL = 5e-5
RTOL = 1e-5
# `target` and `head` (the demo target, each demo head; fp32): tests/drafter/conftest.py.


def _pair(head, cfg, monkeypatch, **buckets) -> tuple[EagleProposer, EagleProposer, list[int]]:
    """(eager proposer, proposer catching up through the static eager path, the largest pair count
    of each catch-up that went through the static path)."""
    eager = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    static = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    graphs = CatchUpGraphs(head, static.cache, graph=False, **buckets)
    static.catch_up_graphs = graphs
    calls, run = [], graphs.run

    def spy(slots, base, token_ids, features):
        calls.append(max(len(t) for t in token_ids))
        return run(slots, base, token_ids, features)

    monkeypatch.setattr(graphs, "run", spy)
    return eager, static, calls


def _requests(b: int, g: torch.Generator, step: int) -> list[DraftRequest]:
    return [DraftRequest(f"r{i}", torch.randint(1, 4096, (3 + step * i,), generator=g).tolist(), SamplingParams(),
                         0, False) for i in range(b)]


def _rows(p: EagleProposer, reqs, num_new) -> list[int]:
    """Physical rows of each request's newest `num_new` entries."""
    rows = []
    for r, n in zip(reqs, num_new):
        end = p.cache_len[r.request_id]
        slot = torch.tensor([p.slots.of[r.request_id]])
        rows += p.cache.rows(slot, torch.arange(end - n, end)[None])[0].tolist()
    return rows


def _catch_up_both(eager, static, reqs, num_new, g) -> None:
    """One catch-up of `num_new` pairs per request on both proposers; their states must agree."""
    feats = [torch.randn(n, eager.head.spec.feature_size, generator=g) for n in num_new]
    before = [static.cache.k[0].clone(), static.cache.v[0].clone()]
    for p in (eager, static):
        p.catch_up(reqs, num_new, feats)
    for r in reqs:
        rid = r.request_id
        assert static.cache_len[rid] == eager.cache_len[rid] == r.committed_len - 1
        torch.testing.assert_close(static.last_hidden[rid], eager.last_hidden[rid], atol=ATOL, rtol=RTOL)
        torch.testing.assert_close(static.last_logits[rid], eager.last_logits[rid], atol=ATOL, rtol=RTOL)
    # Every committed entry: the same K/V to an ulp or so (both proposers allocate the same rows;
    # the CPU's sgemm rounds a row differently for another number of rows, so padded projections
    # are not bit for bit). The catch-up changed only the new pairs' rows and the trash row (the
    # last); draft scratch is not compared (drafted from hidden states equal to a few ulps).
    committed = _rows(static, reqs, [static.cache_len[r.request_id] for r in reqs])
    assert committed == _rows(eager, reqs, [eager.cache_len[r.request_id] for r in reqs])
    changed = torch.zeros(static.cache.k[0].shape[0] - 1, dtype=torch.bool)
    for mine, theirs, old in zip((static.cache.k[0], static.cache.v[0]), (eager.cache.k[0], eager.cache.v[0]), before):
        torch.testing.assert_close(mine[committed], theirs[committed], atol=ATOL, rtol=RTOL)
        changed |= (mine[:-1] != old[:-1]).flatten(1).any(1)
    assert set(changed.nonzero()[:, 0].tolist()) == set(_rows(static, reqs, num_new))


def _same_drafts(eager, static, reqs) -> None:
    a, s = eager.propose(reqs), static.propose(reqs)
    assert torch.equal(a.token_ids, s.token_ids) and torch.equal(a.parents, s.parents)
    torch.testing.assert_close(a.scores, s.scores, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("b", [1, 3, 5])
def test_static_catch_up_equals_eager(head, b, topk, monkeypatch):
    """A prefill (b = 5: 22 pairs, in a prefill's pair bucket of 32), then rounds of 1..5 new pairs per
    request; B = 3 and 5 run with padding rows (buckets 4 and 8)."""
    g = torch.Generator().manual_seed(10 * b + topk)
    cfg = SpecConfig(method=head.spec.kind, num_steps=4, topk=topk, num_draft_tokens=5)
    eager, static, calls = _pair(head, cfg, monkeypatch)
    reqs = _requests(b, g, step=5)
    prefill = [r.committed_len - 1 for r in reqs]
    _catch_up_both(eager, static, reqs, prefill, g)
    assert calls == [max(prefill)]       # prefills too: up to 512 pairs (PREFILL_PAIR_BUCKETS)
    calls.clear()
    for k in range(4):
        _same_drafts(eager, static, reqs)
        new = [1 + (i + 2 * k) % 5 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
        _catch_up_both(eager, static, reqs, new, g)
        assert calls[-1] == max(new)
    _same_drafts(eager, static, reqs)


def test_catch_up_past_the_largest_pair_bucket_runs_eagerly(head, monkeypatch):
    """With pair buckets (1, 2, 4): catch-ups of 4 pairs go through the static path, of 5 eagerly,
    in any order, and the states stay equal."""
    g = torch.Generator().manual_seed(7)
    cfg = SpecConfig(method=head.spec.kind, num_steps=3, topk=1, num_draft_tokens=4)
    eager, static, calls = _pair(head, cfg, monkeypatch, pair_buckets=(1, 2, 4))
    reqs = _requests(2, g, step=2)                                # prefills of 2 and 4 pairs
    _catch_up_both(eager, static, reqs, [2, 4], g)
    for new in ([5, 1], [1, 4], [3, 5], [4, 4]):
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
        _catch_up_both(eager, static, reqs, new, g)
        _same_drafts(eager, static, reqs)
    assert calls == [4, 4, 4]


def test_catch_up_graphs_supports(head):
    cache = EagleProposer(head, SpecConfig(method=head.spec.kind), 1, 32).cache
    graphs = CatchUpGraphs(head, cache, graph=False)
    assert graphs.supports(1, 1) and graphs.supports(64, 16)
    assert not graphs.supports(65, 1)
    # Prefills: up to 512 pairs per request, at most 2048 padded pairs per graph.
    assert graphs.supports(1, 17) and graphs.supports(1, 512) and graphs.supports(8, 256) and graphs.supports(64, 32)
    assert not graphs.supports(1, 513) and not graphs.supports(9, 256) and not graphs.supports(64, 33)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        CatchUpGraphs(head, cache)
