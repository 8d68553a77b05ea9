"""The split-KV path of the paged tree attention (`split_len`, spectandem/kernels/attention.py) on the
CPU: `split_len_for`, `split_lanes` and the cache's choice, the checks on split_len (everywhere), and the kernels
themselves through Triton's interpreter (the checks of tests/gpu/test_split_attention.py at small
sizes; against the reference in fp32 only, as the interpreter casts fp32 to bf16 by truncation;
bit-for-bit batch invariance in bf16 too, through tests/conftest.py's mend of its bf16 tl.dot):

Without Triton or the interpreter (tests/interpreter.py) the kernel tests are skipped, saying why;
tests/gpu/test_split_attention.py covers the kernels on the GPU."""

from __future__ import annotations


import pytest
import torch

from spectandem.kernels import paged_tree_attention, paged_tree_attention_ref
from spectandem.kernels.attention import split_lanes, split_len_for
from spectandem.kv_cache import PagedKVCache
from tests.gpu.test_split_attention import (
    boundary_prefixes,
    check_bad_split_len,
    check_split_batch_invariance,
    check_split_matches_reference,
    check_split_lanes_wrap,
    check_split_padding_rows,
    paged_kv,
)
from tests.interpreter import interpreter

# Kernel vs reference in fp32 at these sizes (spans <= ~200, |out| <= ~3): summation order only.
TIGHT = dict(atol=1e-5, rtol=1e-5)


def test_split_len_for_and_lanes():
    assert split_len_for(128) == 64 and split_len_for(64) == 64 and split_len_for(256) == 32  # BLOCK_N
    assert split_lanes(300, 64) == 5 and split_lanes(2048, 64) == 32 and split_lanes(2049, 64) == 32
    assert split_lanes(131088, 64) == 32 and split_lanes(1, 64) == 1


def test_cache_picks_split_len_from_its_head_dim_alone():
    """Not from the capacity: a cache of 2,048 entries and one of the 8B target's 131,072 split a
    short context alike."""
    for max_len, block_size, head_dim in ((575, 16, 128), (131072, 16, 128), (100, 24, 32), (8191, 32, 256)):
        cache = PagedKVCache(1, 2, 1, max_len, head_dim, torch.float32, block_size=block_size, num_blocks=8)
        assert cache.attention_split_len == split_len_for(head_dim)


def test_bad_split_len_on_the_reference():
    """The reference checks split_len as the kernel does (and otherwise ignores it), so a bad value
    fails on the CPU too."""
    gen = torch.Generator().manual_seed(0)
    k_pool, v_pool, tables = paged_kv(gen, [10], 16, 1, 32, torch.float32, "cpu")
    q = torch.randn(1, 1, 1, 32, generator=gen)
    args = (q, k_pool, v_pool, tables, torch.tensor([9]), None, 1.0, 16)
    for bad in (0, -64, 32, 100, 64.0, True):
        with pytest.raises(ValueError, match="split_len must be .* BLOCK_N = 64"):
            paged_tree_attention(*args, split_len=bad)
    assert torch.equal(paged_tree_attention_ref(*args, split_len=128), paged_tree_attention_ref(*args))


# ----------------------------------------------------------------------------------------------
# The kernels through Triton's interpreter (tests/interpreter.py).


@interpreter
@pytest.mark.parametrize("num_tokens", [1, 5])
@pytest.mark.parametrize("split_len,block_size", [(64, 16), (128, 16), (64, 24), (192, 128)],
                         ids=["64-b16", "128-b16", "64-b24", "192-b128"])
def test_interpreted_split_matches_reference(num_tokens, split_len, block_size):
    """Spans ending on, one past, one short of a segment boundary and mid-segment; block sizes that
    divide split_len and that do not (b24: segment 1 starts inside block 2; b128: segments cut blocks)."""
    check_split_matches_reference("cpu", torch.float32, prefix=boundary_prefixes(split_len, num_tokens),
                                  num_tokens=num_tokens, heads=(4, 2, 32), split_len=split_len,
                                  block_size=block_size, tree=num_tokens > 1, seed=split_len + num_tokens,
                                  tolerance=TIGHT)


@interpreter
def test_interpreted_split_tables_full_and_mha():
    """The longest span ends exactly at the table's end (num_splits = table width * block_size /
    split_len, its last segment full); one head per kv head."""
    check_split_matches_reference("cpu", torch.float32, prefix=[128 - 5, 37, 0], num_tokens=5, heads=(2, 2, 16),
                                  split_len=64, block_size=16, tree=True, seed=7, tolerance=TIGHT,
                                  spare_columns=0)


@interpreter
def test_interpreted_split_padding_rows():
    check_split_padding_rows("cpu", torch.float32, split_len=64)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_split_batch_invariance(dtype):
    """Bit for bit at split_len 64 with 24-entry blocks (segments start mid-block); chain rows
    around the segment boundaries checked alone."""
    check_split_batch_invariance("cpu", dtype, (4, 2, 32), split_len=64, block_size=24, seed=1, chain=8,
                                 nodes=(0, 2, 3, 4, 7))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_split_lanes_wrap(dtype):
    """Spans of 34 and 33 segments (lanes 0 and 1 take two, lane 0 two) beside one of 1: against
    the reference in fp32; bit for bit alone, as chain rows and under wider and narrower tables."""
    check_split_lanes_wrap("cpu", dtype, (2, 1, 16), split_len=64, block_size=16, seed=4,
                           tolerance=TIGHT if dtype == torch.float32 else None)


@interpreter
def test_interpreted_bad_split_len():
    check_bad_split_len("cpu")


@interpreter
def test_interpreted_split_through_the_cache(monkeypatch):
    """PagedTreeBatch passes its cache's split_len: the kernel (patched in for the CPU reference)
    over a real PagedKVCache equals the reference."""
    import spectandem.kv_cache
    from spectandem.kernels import paged_tree_attention_triton
    from spectandem.kv_cache import PagedTreeBatch
    from spectandem.tree import ancestor_mask

    calls = []

    def kernel(*args, **kwargs):
        calls.append(kwargs["split_len"])
        return paged_tree_attention_triton(*args, **kwargs)

    monkeypatch.setattr(spectandem.kv_cache, "paged_tree_attention", kernel)
    gen = torch.Generator().manual_seed(2)
    num_heads, num_kv_heads, head_dim, n = 4, 2, 32, 5
    cache = PagedKVCache(1, 3, num_kv_heads, 3000, head_dim, torch.float32, block_size=16)
    assert cache.attention_split_len == 64
    for t in (cache.k[0], cache.v[0]):
        t.copy_(torch.randn(t.shape, generator=gen))
    slots, cache_lens = torch.tensor([2, 0]), torch.tensor([130, 9])
    for slot, c in zip(slots.tolist(), cache_lens.tolist()):
        cache.reserve(slot, c + n)
    parents = torch.tensor([[-1, 0, 0, 1, 2], [-1, 0, 1, 2, 3]])
    mask = ancestor_mask(parents, torch.ones(2, n, dtype=torch.bool))
    write = cache.rows(slots, cache_lens[:, None] + torch.arange(n))
    view = PagedTreeBatch(cache, write, cache.block_tables(slots), cache_lens, mask)
    q = torch.randn(2, num_heads, n, head_dim, generator=gen)
    k_new, v_new = (torch.randn(2, num_kv_heads, n, head_dim, generator=gen) for _ in range(2))
    out = view.attend(0, q, k_new, v_new, None, head_dim ** -0.5)
    assert calls == [64]
    expected = paged_tree_attention_ref(q, cache.k[0], cache.v[0], cache.block_tables(slots), cache_lens, mask,
                                        head_dim ** -0.5, 16)
    torch.testing.assert_close(out, expected, **TIGHT)
