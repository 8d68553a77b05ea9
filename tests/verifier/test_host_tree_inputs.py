"""`host_tree_inputs` (verifier/tree_inputs.py): the packed inputs of a verify through the tree
attention, built on the host in numpy every round. Checked field by field against a reference
worked out here in plain Python: positions from each node's depth, the ancestor mask by walking
parents, write rows from the slot's block table, padding rows; the block tables as wide as the
longest row reaches, and copied into a graph's full-width buffer (`copy_tree_inputs`) over what an
earlier round left there."""

from __future__ import annotations

import random

import torch

from spectandem.kv_cache import PagedKVCache
from verifier.tree_inputs import copy_tree_inputs, host_tree_inputs, padding_tree_flat, tree_inputs_on


def _cache() -> PagedKVCache:
    cache = PagedKVCache(1, 6, 1, 512, 8, torch.float32, "cpu", num_blocks=96, block_size=16)
    for slot, held in enumerate([0, 15, 16, 100, 300, 480]):
        cache.reserve(slot, held + (1 if slot == 4 else 24))   # slot 4: blocks for 304 entries
    return cache


def _reference(cache, slots, lens, tok, par, valid, rows):
    b, n = tok.shape
    bs = cache.block_size
    width = -(-(max(lens) + n) // bs)   # the blocks the longest row's prefix and nodes reach
    out = {"token_ids": [], "positions": [], "write_rows": [], "block_tables": [], "prefix_lens": [], "tree_mask": []}
    for i in range(rows):
        if i >= b:   # padding: token 0 at position 0 into the trash row, no blocks, identity mask
            out["token_ids"].append([0] * n)
            out["positions"].append([0] * n)
            out["write_rows"].append([cache.trash_row] * n)
            out["block_tables"].append([-1] * width)
            out["prefix_lens"].append(0)
            out["tree_mask"].append([[r == c for c in range(n)] for r in range(n)])
            continue
        table = cache.host_tables[slots[i]].tolist()[:width]
        seen, depth = [], []
        for j in range(n):
            p = int(par[i, j])
            linked = bool(valid[i, j]) and p >= 0
            anc = set(seen[p]) if linked else set()
            seen.append(anc | {j})
            depth.append(depth[p] + 1 if linked else 0)
        out["token_ids"].append([max(int(t), 0) for t in tok[i]])
        out["positions"].append([lens[i] + d for d in depth])
        rows_i = []
        for j in range(n):
            e = lens[i] + j
            blk = table[e // bs]
            rows_i.append(blk * bs + e % bs if blk >= 0 else cache.trash_row)
        out["write_rows"].append(rows_i)
        out["block_tables"].append(table)
        out["prefix_lens"].append(lens[i])
        out["tree_mask"].append([[c in seen[r] for c in range(n)] for r in range(n)])
    return out


def test_packed_inputs_match_the_reference_for_trees_chains_and_padding():
    cache = _cache()
    rng = random.Random(0)
    held = [0, 15, 16, 100, 300, 480]
    kinds = {"chain": 0, "tree": 0, "padded": 0, "unreserved": 0}
    for trial in range(200):
        b, n = rng.randint(1, 4), rng.randint(1, 9)
        rows = b + rng.randint(0, 2)
        slots = [rng.randrange(6) for _ in range(b)]
        lens = [held[s] for s in slots]
        tok = torch.tensor([[rng.randint(-1, 99) for _ in range(n)] for _ in range(b)])
        chain = trial % 3 == 0
        par = torch.tensor([[j - 1 if chain else (rng.randint(-1, j - 1) if j else -1) for j in range(n)]
                            for _ in range(b)])
        valid = torch.tensor([[chain or j == 0 or rng.random() < 0.8 for j in range(n)] for _ in range(b)])
        flat = host_tree_inputs(cache, slots, lens, tok, par, valid, rows)
        got = tree_inputs_on(flat, rows, n)
        want = _reference(cache, slots, lens, tok, par, valid, rows)
        for name, value in want.items():
            assert getattr(got, name).tolist() == value, (trial, name)
        # Into a graph's buffer of the cache's full width, which holds another round's inputs.
        graph_flat = padding_tree_flat(cache, rows, n)
        graph_in = tree_inputs_on(graph_flat, rows, n)
        graph_in.block_tables.fill_(7)
        copy_tree_inputs(graph_flat, graph_in, flat)
        width = len(want["block_tables"][0])
        for name, value in want.items():
            field = graph_in.block_tables[:, :width] if name == "block_tables" else getattr(graph_in, name)
            assert field.tolist() == value, (trial, name)
        assert bool((graph_in.block_tables[:, width:] == 7).all()), trial
        kinds["chain" if chain else "tree"] += 1
        kinds["padded"] += rows > b
        # Slot 4 holds blocks for entries 0..303: its nodes from 304 on have none (trash row).
        kinds["unreserved"] += any(s == 4 for s in slots) and n > 4
    assert min(kinds.values()) > 10, kinds
