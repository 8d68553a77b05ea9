"""drafter.graphs on the CPU: the padded static-shape draft chain (what a CUDA graph replays),
run eagerly, drafts the same trees as `EagleProposer.propose`'s eager argmax chain, for both
demo heads, padded batch buckets and capped depths."""

from __future__ import annotations

import pytest
import torch

from drafter.graphs import ChainGraphs
from drafter.proposers import DraftRequest, EagleProposer
from spectandem.config import SamplingParams, SpecConfig

MAX_LEN = 128
# `target` and `head` (the demo target, each demo head; fp32): tests/drafter/conftest.py.


def _pair(head, cfg):
    """(eager proposer, proposer drafting chains through the static eager path)."""
    eager = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    static = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    static.chain = ChainGraphs(head, static.cache, graph=False)
    return eager, static


@pytest.mark.parametrize("b", [1, 3, 4])
@pytest.mark.parametrize("num_steps,num_draft_tokens,cap", [(2, 2, None), (4, 5, None), (6, 4, None), (6, 7, 3)])
def test_static_chain_equals_eager_chain(head, b, num_steps, num_draft_tokens, cap):
    """Two rounds per request (the second after a catch-up over new pairs); B = 3 runs padded."""
    g = torch.Generator().manual_seed(10 * b + num_steps)
    cfg = SpecConfig(method=head.spec.kind, num_steps=num_steps, topk=1, num_draft_tokens=num_draft_tokens)
    eager, static = _pair(head, cfg)
    reqs = [DraftRequest(f"r{i}", torch.randint(1, 4096, (3 + 11 * i,), generator=g).tolist(), SamplingParams(), 0,
                         False) for i in range(b)]
    new = [r.committed_len - 1 for r in reqs]
    for _ in range(2):
        feats = [torch.randn(n, head.spec.feature_size, generator=g) for n in new]
        for p in (eager, static):
            p.catch_up(reqs, new, feats)
        a, s = eager.propose(reqs, cap), static.propose(reqs, cap)
        assert torch.equal(a.token_ids, s.token_ids) and torch.equal(a.parents, s.parents)
        assert torch.equal(a.scores, s.scores) and a.node_probs is None and s.node_probs is None
        new = [1 + i % 3 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())


def test_chain_graphs_take_only_argmax_chains(head):
    chain = ChainGraphs(head, EagleProposer(head, SpecConfig(method=head.spec.kind), 1, 32).cache, graph=False)
    assert chain.supports(4, topk=1, sampled=False, num_steps=2)
    assert not chain.supports(4, topk=2, sampled=False, num_steps=4)
    assert not chain.supports(4, topk=1, sampled=True, num_steps=4)
    assert not chain.supports(4, topk=1, sampled=False, num_steps=1)
    assert not chain.supports(65, topk=1, sampled=False, num_steps=4)
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        EagleProposer(head, SpecConfig(method=head.spec.kind), 1, 32, cuda_graphs=True)


@pytest.mark.parametrize("lens", [[3, 1, 4, 2], [2, 2, 2], [5], [1, 1]])
def test_rows_into_pads_each_part_into_its_row(lens):
    """A graph's static input as `chain_inputs` pads it: zeros, part i at the head of row i; the
    parts of one length (one stacked copy) and of several (one scatter), over stale contents."""
    from drafter.graphs import _rows_into

    g = torch.Generator().manual_seed(len(lens))
    parts = [torch.randn(n, 3, generator=g) for n in lens]
    static = torch.full((len(lens) + 2, max(lens) + 1, 3), 9.0)
    _rows_into(static, parts)
    want = torch.zeros_like(static)
    for i, part in enumerate(parts):
        want[i, : part.shape[0]] = part
    assert torch.equal(static, want)
    rows = torch.randn(len(lens), 5, generator=g)   # one row per request (a start's logits)
    flat = torch.full((len(lens) + 1, 5), 9.0)
    _rows_into(flat, list(rows))
    assert torch.equal(flat[: len(lens)], rows) and not flat[len(lens):].any()
