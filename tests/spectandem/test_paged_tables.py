"""PagedKVCache's block tables on the device and their host mirror (what a verify step's inputs
are built from, verifier/graphs.py): after any sequence of reserve, trim, fork and free, both
equal the block manager's lists (-1 past them), and `host_rows` equals `rows`."""

import random

import torch

from spectandem.kv_cache import PagedKVCache

SLOTS, MAX_LEN, BS = 6, 64, 4


def _expected(cache: PagedKVCache) -> torch.Tensor:
    table = torch.full(tuple(cache.host_tables.shape), -1, dtype=torch.long)
    for slot, blocks in cache.blocks.tables.items():
        table[slot, : len(blocks)] = torch.tensor(blocks, dtype=torch.long)
    return table


def test_tables_follow_the_block_manager_through_random_operations() -> None:
    rng = random.Random(0)
    cache = PagedKVCache(1, SLOTS, 1, MAX_LEN, 2, torch.float32, num_blocks=60, block_size=BS)
    lens = [0] * SLOTS
    for step in range(400):
        slot, op = rng.randrange(SLOTS), rng.random()
        if op < 0.5:
            lens[slot] = min(MAX_LEN, max(lens[slot], rng.randrange(1, MAX_LEN + 1)))
            if cache.blocks.can_allocate(slot, lens[slot]):
                cache.reserve(slot, lens[slot])
            else:
                lens[slot] = len(cache.blocks.tables.get(slot, [])) * BS
        elif op < 0.7 and lens[slot]:
            lens[slot] = rng.randrange(0, lens[slot] + 1)
            cache.trim(slot, lens[slot])
        elif op < 0.85:
            cache.free(slot)
            lens[slot] = 0
        else:
            src = rng.randrange(SLOTS)
            if src != slot and lens[src] and not cache.blocks.tables.get(slot) and cache.blocks.num_free >= 1:
                n = rng.randrange(1, lens[src] + 1)
                cache.fork(src, slot, n)
                lens[slot] = n
        expected = _expected(cache)
        assert torch.equal(cache.host_tables, expected), step
        if step % 3 == 2:   # the device copy syncs after several operations
            assert torch.equal(cache._tables, expected), step
        slots = list(range(SLOTS))
        index = torch.randint(0, MAX_LEN + 1, (SLOTS, 7), generator=torch.Generator().manual_seed(step))
        index[:, 0] = cache.trash_index
        assert torch.equal(cache.host_rows(slots, index), cache.rows(torch.tensor(slots), index)), step
        want = [[expected[s, e // BS].item() * BS + e % BS if e < MAX_LEN and expected[s, e // BS] >= 0
                 else cache.trash_row for e in row.tolist()] for s, row in zip(slots, index)]
        assert cache.host_rows(slots, index).tolist() == want, step
