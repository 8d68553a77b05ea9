"""The packed inputs of a verify through the Triton tree attention (verifier/graphs.py's tree
path): `TreeVerifyInputs` and how the host builds them in one buffer that crosses to the device
in one copy (`host_tree_inputs`), for a whole batch and for padding."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from spectandem.kv_cache import PagedKVCache, PagedTreeBatch
from spectandem.tree import tril_mask, tree_shape_np


def copy_fields(dst, src) -> None:
    """Copies every tensor field of a static-inputs dataclass from `src` into `dst`."""
    for f in fields(dst):
        getattr(dst, f.name).copy_(getattr(src, f.name))


@dataclass
class TreeVerifyInputs:
    """The same step for the Triton tree attention (PagedTreeBatch): Bc rows, N nodes, no columns."""

    token_ids: torch.Tensor     # [Bc, N] int64 (padding nodes and rows: 0)
    positions: torch.Tensor     # [Bc, N] int64 RoPE positions: cache_len + depth
    write_rows: torch.Tensor    # [Bc, N] int64 physical rows of logical entries cache_len + 0..N-1
    block_tables: torch.Tensor  # [Bc, max_blocks] int64 physical block ids, -1 where none (padding rows: all)
    prefix_lens: torch.Tensor   # [Bc] int64 cache_len (padding rows: 0)
    tree_mask: torch.Tensor     # [Bc, N, N] bool ancestor mask (padding rows: identity)

    def copy_(self, other: "TreeVerifyInputs") -> None:
        copy_fields(self, other)

    def forward_args(self, cache: PagedKVCache) -> tuple[PagedTreeBatch, None]:
        """(cache view, mask) for LlamaModel.forward: the view carries the mask."""
        return PagedTreeBatch(cache, self.write_rows, self.block_tables, self.prefix_lens, self.tree_mask), None



def tree_inputs_nbytes(rows: int, n: int, max_blocks: int) -> int:
    """Bytes of one packed TreeVerifyInputs (`tree_inputs_on`)."""
    return 8 * rows * (3 * n + max_blocks + 1) + rows * n * n


def tree_inputs_on(flat: torch.Tensor, rows: int, n: int, max_blocks: int) -> TreeVerifyInputs:
    """TreeVerifyInputs whose fields are views of one buffer `flat [tree_inputs_nbytes] uint8`, so
    a step's inputs cross to the device in one copy. Layout: the int64 fields in their order
    (token_ids, positions, write_rows [Bc, N], block_tables [Bc, max_blocks], prefix_lens [Bc]),
    then tree_mask [Bc, N, N] bool; every int64 field starts at a multiple of 8 bytes."""
    assert flat.dtype == torch.uint8 and flat.numel() == tree_inputs_nbytes(rows, n, max_blocks), flat.shape
    views, offset = [], 0
    for shape in ((rows, n), (rows, n), (rows, n), (rows, max_blocks), (rows,)):
        count = 8 * math.prod(shape)
        views.append(flat[offset: offset + count].view(torch.int64).view(shape))
        offset += count
    views.append(flat[offset:].view(torch.bool).view(rows, n, n))
    return TreeVerifyInputs(*views)


def _tree_fields_np(flat: torch.Tensor, rows: int, n: int, max_blocks: int) -> tuple[np.ndarray, ...]:
    """`tree_inputs_on`'s fields as numpy views of a host `flat`: (token_ids, positions,
    write_rows, block_tables, prefix_lens, tree_mask)."""
    buf = flat.numpy()
    ints = buf[: 8 * rows * (3 * n + max_blocks + 1)].view(np.int64)
    return (ints[: rows * n].reshape(rows, n), ints[rows * n: 2 * rows * n].reshape(rows, n),
            ints[2 * rows * n: 3 * rows * n].reshape(rows, n),
            ints[3 * rows * n: 3 * rows * n + rows * max_blocks].reshape(rows, max_blocks),
            ints[3 * rows * n + rows * max_blocks:], buf[8 * rows * (3 * n + max_blocks + 1):].view(np.bool_).reshape(rows, n, n))


def host_tree_inputs(cache: PagedKVCache, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor,
                     parents: torch.Tensor, node_valid: torch.Tensor, rows: int) -> torch.Tensor:
    """The packed inputs (`tree_inputs_on`) of a verify through the tree attention, built on the
    host from the cache's host block tables: token_ids, parents, node_valid [B, N] tensors,
    padded to `rows` >= B rows -> flat [nbytes] uint8 (in pinned memory when the cache is on CUDA,
    so the copy to the device does not stall the host). Node j of request b is written at logical
    cache_len + j, where the kernel looks for round entry j (prefix = cache_len). The slots must
    already hold cache_len + N entries (`cache.reserve`). Padding rows: token 0 at position 0
    written to the trash row, prefix 0, no blocks, each node seeing only itself (the kernel loads
    nothing for such a row). Built in numpy on views of the one buffer: this runs every round
    while the GPU waits (a chained verify's launch, too), and torch's per-call cost is several
    times numpy's."""
    b, n = token_ids.shape
    assert rows >= b and (not cache_lens or max(cache_lens) + n <= cache.max_len), (rows, b, cache_lens, n)
    max_blocks = cache.host_tables.shape[1]
    pinned = cache.k[0].device.type == "cuda"
    flat = torch.empty(tree_inputs_nbytes(rows, n, max_blocks), dtype=torch.uint8, pin_memory=pinned)
    tok, pos, write, tables, prefix, mask = _tree_fields_np(flat, rows, n, max_blocks)
    if b < rows:
        tok[b:], pos[b:], write[b:], tables[b:], prefix[b:] = 0, 0, cache.trash_row, -1, 0
        mask[b:] = np.eye(n, dtype=bool)
    if b:
        par, valid = parents.cpu().numpy(), node_valid.cpu().numpy()
        base = np.asarray(cache_lens, dtype=np.int64)                                  # [B]
        np.maximum(token_ids.cpu().numpy(), 0, out=tok[:b])
        if valid[:, 1:].all() and (par == np.arange(-1, n - 1)).all():   # chains: node i sees 0..i
            np.add(base[:, None], np.arange(n), out=pos[:b])
            mask[:b] = tril_mask(n)
        else:
            depth, tree = tree_shape_np(par, valid)
            np.add(base[:, None], depth, out=pos[:b])
            mask[:b] = tree
        tables[:b] = cache.host_tables_np[slots]
        write[:b] = cache.rows_in_tables_np(tables[:b], base[:, None] + np.arange(n))
        prefix[:b] = base
    return flat


def tree_verify_inputs(cache: PagedKVCache, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor,
                       parents: torch.Tensor, node_valid: torch.Tensor, rows: int) -> TreeVerifyInputs:
    """`host_tree_inputs` on the cache's device (one copy): `verify_inputs` for the tree attention."""
    b, n = token_ids.shape
    flat = host_tree_inputs(cache, slots, cache_lens, token_ids, parents, node_valid, rows)
    return tree_inputs_on(flat.to(cache.k[0].device, non_blocking=True), rows, n, cache.host_tables.shape[1])


def padding_tree_flat(cache: PagedKVCache, rows: int, n: int) -> torch.Tensor:
    """Packed tree inputs with every row padding (what warm-up and capture run on), on the device."""
    empty = torch.zeros(0, n, dtype=torch.long)
    return host_tree_inputs(cache, [], [], empty, empty, empty.bool(), rows).to(cache.k[0].device)


def padding_tree_inputs(cache: PagedKVCache, rows: int, n: int) -> TreeVerifyInputs:
    return tree_inputs_on(padding_tree_flat(cache, rows, n), rows, n, cache.host_tables.shape[1])
