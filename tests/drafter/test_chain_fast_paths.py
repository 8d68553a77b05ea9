"""The shortcuts an argmax chain takes on the host give what the general tree code gives, bit for
bit: the chain's nodes (expand_topk without the global rerank of `_select`), each step's mask
(ScratchTree.batch without the visibility gather) and the paged cache's physical rows on the CPU
(numpy over the host tables)."""

import torch

from drafter.proposers import ScratchTree
from drafter.tree import _select, expand_topk
from spectandem.kv_cache import PagedKVCache


def test_a_chain_is_what_select_picks_of_its_candidates():
    gen = torch.Generator().manual_seed(0)
    b, vd, steps = 3, 11, 5
    logits = [torch.randn(b, vd, generator=gen)] + [torch.randn(b, 1, vd, generator=gen) for _ in range(steps - 1)]
    to_target = lambda t: t + 100   # noqa: E731
    for budget in (2, steps + 1, steps + 3):
        nodes = expand_topk(logits[0], lambda i, tok, rows, vis: logits[i], to_target, steps, 1, budget, argmax=True)
        tok = torch.cat([logits[0].argmax(-1, keepdim=True)] + [l.argmax(-1) for l in logits[1:]], 1)
        parent = torch.cat([torch.full((b, 1), -1), torch.arange(steps - 1).expand(b, steps - 1)], 1)
        ref = _select(tok, torch.zeros(b, steps), parent, budget - 1, to_target)
        for field in ("token_ids", "parents", "scores"):
            got, want = getattr(nodes, field), getattr(ref, field)
            assert got.dtype == want.dtype and torch.equal(got, want), (field, budget, got, want)


def _general_mask(base: torch.Tensor, step: int, k: int, visible: torch.Tensor) -> torch.Tensor:
    b = base.shape[0]
    span = int(base.max()) + step * k
    cols = torch.arange(span)
    mask = (cols[None, None, :] < base[:, None, None]).expand(b, k, span).clone()
    rel = cols[None, :] - base[:, None]
    in_scratch = (rel >= 0) & (rel < step * k)
    mask |= visible.gather(2, rel.clamp(0, step * k - 1)[:, None, :].expand(b, k, span)) & in_scratch[:, None, :]
    return mask


def _cache() -> tuple[PagedKVCache, torch.Tensor]:
    cache = PagedKVCache(1, 4, 1, 96, 8, torch.float32, block_size=8)
    for slot, n in ((0, 30), (1, 9), (2, 70), (3, 1)):
        cache.reserve(slot, n)
    cache.trim(2, 40)                                     # unmapped blocks past a trim
    return cache, torch.tensor([2, 0, 1])


def test_a_chain_steps_mask_is_the_general_one():
    cache, slots = _cache()
    base = torch.tensor([33, 20, 5])
    scratch = ScratchTree(cache, slots, base, 1, pos_offset=0)
    for step in range(1, 5):
        visible = torch.ones(3, 1, step, dtype=torch.bool)
        batch, positions, mask = scratch.batch(step, visible)
        want = _general_mask(base, step, 1, visible)
        assert mask.shape == want.shape and torch.equal(mask.expand_as(want), want)
    partly = torch.tensor([[[True, False, True]]]).expand(3, 1, 3)   # not a chain: the general code
    assert torch.equal(scratch.batch(3, partly)[2], _general_mask(base, 3, 1, partly))


def test_cpu_rows_are_the_torch_formulas():
    cache, slots = _cache()
    index = torch.tensor([[0, 7, 8, 29, 30, 39, 41, 95, 96, 120],
                          [3, 9, 16, 25, 31, 0, 1, 2, 95, 97],
                          [0, 8, 9, 10, 15, 16, 60, 96, 5, 200]])
    bs, tables = cache.block_size, cache.host_tables
    block = tables[slots[:, None], (index // bs).clamp(max=tables.shape[1] - 1)]
    want = torch.where((block >= 0) & (index < cache.max_len), block * bs + index % bs, cache.trash_row)
    got = cache.rows(slots, index)
    assert got.dtype == want.dtype and torch.equal(got, want)
