"""DrafterEngine.draft's tree assembly (drafter/engine.py `_tree_of`): the rows of several drafted
trees, in any order and of different widths, give the DraftTree that the rows one by one
(`ready_rows`, `trees_from_ready`) give; and the draft-ahead record it leaves reads out as the
row's lists."""

import numpy as np
import torch

from drafter.engine import DraftedRow, HeldRequest, _in_flight, _tree_of
from drafter.tree import DraftNodes, host_lists, ready_rows
from spectandem.config import SamplingParams
from spectandem.messages import trees_from_ready


def _nodes(b: int, m: int, seed: int) -> DraftNodes:
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 1000, (b, m), generator=g)
    toks[torch.rand(b, m, generator=g) < 0.2] = -1          # invalid nodes
    parents = torch.randint(0, m, (b, m), generator=g)
    return DraftNodes(toks, parents, torch.randn(b, m, generator=g))


def _host(d: DraftNodes) -> tuple:
    return d.token_ids.numpy(), d.parents.numpy(), d.scores.float().numpy(), None


def test_rows_of_several_trees_match_the_rows_one_by_one():
    a, b, c = _nodes(5, 4, 0), _nodes(3, 2, 1), _nodes(4, 6, 2)
    drafts = {0: (b, 2), 1: (a, 4), 2: (c, 0), 3: (a, 0), 4: (b, 0), 5: (c, 3), 6: (a, 2)}
    roots = [11, 12, 13, 14, 15, 16, 17]
    ids = [f"r{i}" for i in range(7)]
    lens = [100 + i for i in range(7)]
    host = {id(d): _host(d) for d in (a, b, c)}
    got = _tree_of(ids, lens, roots, drafts, host)
    lists = {id(d): host_lists(d.token_ids, d.parents, d.scores) for d in (a, b, c)}
    want = trees_from_ready(ids, lens, [ready_rows(roots[i], lists[id(d)], row) for i, (d, row) in sorted(drafts.items())])
    for field in ("token_ids", "parents", "node_valid", "scores"):
        assert torch.equal(getattr(got, field), getattr(want, field)), field
    assert got.request_ids == ids and got.committed_lens == lens
    assert got.token_ids.shape == (7, 7)                     # the widest tree (6 nodes) and the root


def test_one_whole_tree_in_order():
    a = _nodes(6, 4, 3)
    drafts = {i: (a, i) for i in range(6)}
    got = _tree_of([f"r{i}" for i in range(6)], [5] * 6, list(range(6)), drafts, {id(a): _host(a)})
    assert torch.equal(got.token_ids[:, 1:], a.token_ids)
    assert torch.equal(got.token_ids[:, 0], torch.arange(6))
    assert torch.equal(got.scores[:, 0], torch.zeros(6))
    assert torch.equal(got.node_valid, got.token_ids >= 0)


def test_the_draft_ahead_record_reads_out_as_the_row_s_lists():
    a = _nodes(3, 4, 4)
    t, p, _, _ = _host(a)
    req = HeldRequest("r", [1, 2, 3], SamplingParams(), 0, False)
    req.flight = DraftedRow(3, 3, t, p, 1)
    lists = host_lists(a.token_ids, a.parents, a.scores)
    assert req.in_flight == _in_flight(3, ready_rows(3, lists, 1))
    assert req.in_flight is req.flight                      # read out once
    req.flight = None
    assert req.in_flight is None
    assert isinstance(t, np.ndarray)
