"""spectandem.kv_cache: writes land at the given indices, reads stop at the span, the trash row
never leaks, and compaction is safe when sources and destinations overlap."""

import pytest
import torch

from spectandem.kv_cache import KVCache

LAYERS, SLOTS, NKV, MAX_LEN, HD = 3, 4, 2, 12, 4


def _cache(dtype=torch.float32) -> KVCache:
    return KVCache(LAYERS, SLOTS, NKV, MAX_LEN, HD, dtype)


def _fill(cache: KVCache, seed: int = 0) -> None:
    """Distinct values everywhere (trash rows included), so any misplaced copy shows."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(LAYERS):
        cache.k[layer].copy_(torch.randn(cache.k[layer].shape, generator=g))
        cache.v[layer].copy_(torch.randn(cache.v[layer].shape, generator=g))


def test_update_writes_at_indices_and_reads_span() -> None:
    cache = _cache()
    slots = torch.tensor([2, 0])                     # deliberately not in slot order
    write = torch.tensor([[0, 3, 5], [1, 2, 7]])     # [B, T], gaps between entries
    g = torch.Generator().manual_seed(1)
    k_new = torch.randn(2, NKV, 3, HD, generator=g)  # [B, nkv, T, hd]
    v_new = torch.randn(2, NKV, 3, HD, generator=g)
    span = 8
    k_all, v_all = cache.batch(slots, write, span).update(1, k_new, v_new)
    assert k_all.shape == v_all.shape == (2, NKV, span, HD)
    for b in range(2):
        expected_k = torch.zeros(NKV, span, HD)
        expected_v = torch.zeros(NKV, span, HD)
        for t in range(3):
            expected_k[:, write[b, t]] = k_new[b, :, t]
            expected_v[:, write[b, t]] = v_new[b, :, t]
        assert torch.equal(k_all[b], expected_k)
        assert torch.equal(v_all[b], expected_v)
        assert torch.equal(cache.k[1][slots[b], :, :span], expected_k)
    # other layers and untouched slots stay zero
    for layer in (0, 2):
        assert not cache.k[layer].any() and not cache.v[layer].any()
    assert not cache.k[1][1].any() and not cache.k[1][3].any()


def test_update_reads_earlier_entries_and_converts_dtype() -> None:
    cache = _cache(torch.bfloat16)
    slots = torch.tensor([1])
    first = torch.randn(1, NKV, 4, HD)
    cache.batch(slots, torch.arange(4)[None], 4).update(0, first, first)
    second = torch.randn(1, NKV, 2, HD)
    k_all, _ = cache.batch(slots, torch.tensor([[4, 5]]), 6).update(0, second, second)
    assert k_all.dtype == torch.bfloat16
    assert torch.equal(k_all[0, :, :4], first[0].to(torch.bfloat16))
    assert torch.equal(k_all[0, :, 4:6], second[0].to(torch.bfloat16))


def test_trash_rows_never_leak_into_span() -> None:
    cache = _cache()
    # Request 0 has 3 real rows, request 1 has 1 real row and 2 padding rows sent to trash.
    slots = torch.tensor([0, 1])
    write = torch.tensor([[0, 1, 2], [0, cache.trash_index, cache.trash_index]])
    k_new = torch.arange(2 * NKV * 3 * HD, dtype=torch.float32).view(2, NKV, 3, HD) + 1.0
    span = MAX_LEN  # the largest allowed span
    k_all, v_all = cache.batch(slots, write, span).update(0, k_new, -k_new)
    assert k_all.shape[2] == MAX_LEN == cache.trash_index   # the trash index is past every span
    assert torch.equal(k_all[1, :, 0], k_new[1, :, 0])
    assert not k_all[1, :, 1:].any() and not v_all[1, :, 1:].any()
    padding_values = k_new[1, :, 1:].contiguous()
    assert not torch.isin(k_all, padding_values).any(), "a padding row is visible"
    # the padding rows did land in the trash row (one of them; duplicates may race)
    trash = cache.k[0][1, :, cache.trash_index]
    assert any(torch.equal(trash, padding_values[:, t]) for t in range(2))
    with pytest.raises(ValueError, match="max_len"):
        cache.batch(slots, write, MAX_LEN + 1)


def _compact_reference(cache: KVCache, slots, src, dst) -> tuple[list, list]:
    """Per layer, per slot: read all sources first, then write, in plain Python."""
    ks = [k.clone() for k in cache.k]
    vs = [v.clone() for v in cache.v]
    for layer in range(LAYERS):
        for store, orig in ((ks[layer], cache.k[layer]), (vs[layer], cache.v[layer])):
            for b, slot in enumerate(slots.tolist()):
                moved = [orig[slot, :, s].clone() for s in src[b].tolist()]
                for value, d in zip(moved, dst[b].tolist()):
                    store[slot, :, d] = value
    return ks, vs


@pytest.mark.parametrize("src, dst", [
    # accepted tree nodes 3, 5, 6 move right after a committed prefix of 2: dst 3 == src 3
    ([[3, 5, 6], [4, 5, 6]], [[2, 3, 4], [4, 5, 6]]),
    # shifting a run left by one: every destination is the previous source
    ([[5, 6, 7], [2, 3, 4]], [[4, 5, 6], [1, 2, 3]]),
    # shifting right (a destination is a later source)
    ([[1, 2, 3], [6, 7, 8]], [[2, 3, 4], [7, 8, 9]]),
])
def test_compact_overlapping(src, dst) -> None:
    cache = _cache()
    _fill(cache)
    slots = torch.tensor([3, 1])
    src_t, dst_t = torch.tensor(src), torch.tensor(dst)
    ref_k, ref_v = _compact_reference(cache, slots, src_t, dst_t)
    orig_k = [k.clone() for k in cache.k]
    cache.compact(slots, src_t, dst_t)
    for layer in range(LAYERS):
        assert torch.equal(cache.k[layer], ref_k[layer]), layer
        assert torch.equal(cache.v[layer], ref_v[layer]), layer
        for b, slot in enumerate(slots.tolist()):
            for s, d in zip(src[b], dst[b]):
                assert torch.equal(cache.k[layer][slot, :, d], orig_k[layer][slot, :, s])
    # slots not named are untouched
    for slot in (0, 2):
        for layer in range(LAYERS):
            assert torch.equal(cache.k[layer][slot], orig_k[layer][slot])


def test_compact_ragged_with_trash_padding() -> None:
    cache = _cache()
    _fill(cache, seed=3)
    t = cache.trash_index
    slots = torch.tensor([0, 2])
    # request 0 accepted two nodes, request 1 one node (padded with trash -> trash)
    src = torch.tensor([[6, 8], [5, t]])
    dst = torch.tensor([[4, 5], [3, t]])
    before = [k.clone() for k in cache.k]
    cache.compact(slots, src, dst)
    for layer in range(LAYERS):
        assert torch.equal(cache.k[layer][0, :, 4], before[layer][0, :, 6])
        assert torch.equal(cache.k[layer][0, :, 5], before[layer][0, :, 8])
        assert torch.equal(cache.k[layer][2, :, 3], before[layer][2, :, 5])
        changed = (cache.k[layer] != before[layer]).any(-1).any(1)       # [slots, max_len + 1]
        changed[0, [4, 5]] = False
        changed[2, 3] = False
        assert not changed.any(), layer


def test_span_rows_equal_the_rows_of_every_entry_of_the_span() -> None:
    """`host_span_rows_np` (a block at a time) against `host_rows_np` of the indices 0..span-1 per
    slot, over slots with blocks mapped, trimmed and freed (unmapped pages give the trash row), for
    spans inside, at and past a block's end; padding rows all the trash row."""
    import numpy as np

    from spectandem.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 6, 1, 200, 4, torch.float32, "cpu", num_blocks=64, block_size=16)
    for slot, entries in enumerate([37, 0, 120, 16, 65]):
        if entries:
            cache.reserve(slot, entries)
    cache.trim(2, 40)      # blocks past the third go back to the pool
    cache.free(3)
    slots = [4, 2, 0, 1, 3]
    for span in (1, 15, 16, 17, 64, 130, 200):
        want = cache.host_rows_np(slots, np.tile(np.arange(span), (len(slots), 1)))
        got = cache.host_span_rows_np(slots, span)
        assert got.shape == (len(slots), span) and (got == want).all(), span
        padded = cache.host_span_rows_np(slots, span, rows=8)
        assert (padded[:5] == want).all() and (padded[5:] == cache.trash_row).all()
    assert (cache.host_span_rows_np([0], 40)[0, :37] != cache.trash_row).all()   # a control: mapped rows are real
    with pytest.raises(ValueError, match="span"):
        cache.host_span_rows_np(slots, 201)


def _state(cache) -> tuple:
    """Everything a trim or a reserve changes: the pool, each slot's blocks, the host tables and
    which slots the device copy must take."""
    return (list(cache.blocks.free), {s: list(t) for s, t in cache.blocks.tables.items()},
            cache.host_tables.tolist(), list(cache._mapped), sorted(cache._stale))


def test_batched_trims_and_reserves_equal_the_calls_one_slot_at_a_time() -> None:
    """`trim_many` and `reserve_many` (a catch-up's trims then reserves) leave the pool, the slots' blocks and the tables
    exactly as `trim`/`reserve` slot by slot do, over rounds of random lengths that grow past
    blocks, shrink within and across blocks, and stay put (the no-change path); a request past
    max_len is refused alike."""
    import random

    from spectandem.kv_cache import PagedKVCache

    def cache():
        c = PagedKVCache(1, 8, 1, 120, 4, torch.float32, "cpu", num_blocks=80, block_size=16)
        c.reserve(5, 40)
        c.fork(5, 6, 33)   # a borrowed prefix: trims keep it
        return c

    one, many = cache(), cache()
    rng = random.Random(0)
    lens = {s: 0 for s in range(7)}
    for _ in range(60):
        slots = rng.sample(range(7), rng.randint(1, 7))
        keep = [max(0, lens[s] + rng.choice([-20, -3, 0, 0, 1, 5])) for s in slots]
        need = [min(119, k + rng.choice([0, 1, 6, 17, 40])) for k in keep]
        for s, k in zip(slots, keep):
            one.trim(s, k)
        for s, n in zip(slots, need):
            one.reserve(s, n)
            lens[s] = n
        many.trim_many(slots, keep)
        many.reserve_many(slots, need)
        assert _state(one) == _state(many)
        grow = [n + rng.choice([0, 2, 20]) for n in need]
        grow = [min(119, g) for g in grow]
        for s, g in zip(slots, grow):
            one.reserve(s, g)
        many.reserve_many(slots, grow)
        assert _state(one) == _state(many)
        cut = [max(0, g - rng.choice([0, 5, 30])) for g in grow]
        for s, c in zip(slots, cut):
            one.trim(s, c)
        many.trim_many(slots, cut)
        assert _state(one) == _state(many)
        lens.update(zip(slots, cut))
    assert any(cache_len > 16 for cache_len in lens.values())   # a control: blocks came and went
    with pytest.raises(ValueError, match="max_len"):
        many.reserve_many([0], [121])
