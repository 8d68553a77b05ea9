"""The packed inputs of a verify through the Triton tree attention (verifier/graphs.py's tree
path): `TreeVerifyInputs` and how the host builds them in one buffer that crosses to the device
in one copy (`host_tree_inputs`), for a whole batch and for padding."""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from spectandem.block_manager import blocks_for
from spectandem.kv_cache import PagedKVCache, PagedTreeBatch
from spectandem.tree import tril_mask, tree_shape_np


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
        """`other`'s fields into these; its block tables may be narrower (`host_tree_inputs`):
        they go into the first columns, the rest keep what they held (no row reads past its own)."""
        for f in fields(self):
            src = getattr(other, f.name)
            getattr(self, f.name)[..., : src.shape[-1]].copy_(src)

    def forward_args(self, cache: PagedKVCache) -> tuple[PagedTreeBatch, None]:
        """(cache view, mask) for LlamaModel.forward: the view carries the mask."""
        return PagedTreeBatch(cache, self.write_rows, self.block_tables, self.prefix_lens, self.tree_mask), None



def _fixed_nbytes(rows: int, n: int) -> int:
    """Bytes of a packed TreeVerifyInputs before its block tables (`tree_inputs_on`)."""
    return 8 * rows * (3 * n + 1) + 8 * -(-rows * n * n // 8)


def tree_inputs_nbytes(rows: int, n: int, width: int) -> int:
    """Bytes of one packed TreeVerifyInputs whose block tables are `width` blocks wide."""
    return _fixed_nbytes(rows, n) + 8 * rows * width


def tree_inputs_on(flat: torch.Tensor, rows: int, n: int) -> TreeVerifyInputs:
    """TreeVerifyInputs whose fields are views of one buffer `flat` uint8, so a step's inputs
    cross to the device in one copy. Layout: the int64 fields token_ids, positions, write_rows
    [Bc, N] and prefix_lens [Bc], then tree_mask [Bc, N, N] bool (padded to a multiple of 8 bytes),
    then block_tables [Bc, width] int64, width = what the buffer's size leaves for them. The tables
    last: a round's inputs need the blocks its rows reach, a graph's buffer holds max_blocks, and
    `copy_tree_inputs` moves the one into the other."""
    fixed = _fixed_nbytes(rows, n)
    width, rest = divmod(flat.numel() - fixed, 8 * rows)
    assert flat.dtype == torch.uint8 and width >= 1 and rest == 0, (flat.shape, rows, n)
    ints = flat[: 8 * rows * (3 * n + 1)].view(torch.int64)
    rn = rows * n
    return TreeVerifyInputs(ints[:rn].view(rows, n), ints[rn: 2 * rn].view(rows, n), ints[2 * rn: 3 * rn].view(rows, n),
                            flat[fixed:].view(torch.int64).view(rows, width), ints[3 * rn:],
                            flat[8 * rows * (3 * n + 1): 8 * rows * (3 * n + 1) + rn * n].view(torch.bool)
                            .view(rows, n, n))


def copy_tree_inputs(flat: torch.Tensor, inputs: TreeVerifyInputs, src: torch.Tensor) -> None:
    """A round's packed inputs `src` (host, `host_tree_inputs`) into a graph's `flat` (whose fields
    are `inputs`, as wide as the cache's tables): everything before the tables in one copy, the
    tables into their first columns. Columns past them keep what earlier rounds left: the kernel
    reads a row's table only as far as its prefix and nodes reach."""
    rows, n = inputs.token_ids.shape
    fixed = _fixed_nbytes(rows, n)
    width = (src.numel() - fixed) // (8 * rows)
    flat[:fixed].copy_(src[:fixed], non_blocking=True)
    inputs.block_tables[:, :width].copy_(src[fixed:].view(torch.int64).view(rows, width), non_blocking=True)


def _tree_fields_np(flat: torch.Tensor, rows: int, n: int, width: int) -> tuple[np.ndarray, ...]:
    """`tree_inputs_on`'s fields as numpy views of a host `flat`: (token_ids, positions,
    write_rows, block_tables, prefix_lens, tree_mask)."""
    buf = flat.numpy()
    rn, ints_end = rows * n, 8 * rows * (3 * n + 1)
    ints = buf[:ints_end].view(np.int64)
    return (ints[:rn].reshape(rows, n), ints[rn: 2 * rn].reshape(rows, n), ints[2 * rn: 3 * rn].reshape(rows, n),
            buf[_fixed_nbytes(rows, n):].view(np.int64).reshape(rows, width), ints[3 * rn:],
            buf[ints_end: ints_end + rn * n].view(np.bool_).reshape(rows, n, n))


def host_tree_inputs(cache: PagedKVCache, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor,
                     parents: torch.Tensor, node_valid: torch.Tensor, rows: int, width: int | None = None,
                     ) -> torch.Tensor:
    """The packed inputs (`tree_inputs_on`) of a verify through the tree attention, built on the
    host from the cache's host block tables: token_ids, parents, node_valid [B, N] tensors,
    padded to `rows` >= B rows -> flat [nbytes] uint8 (in pinned memory when the cache is on CUDA,
    so the copy to the device does not stall the host). Node j of request b is written at logical
    cache_len + j, where the kernel looks for round entry j (prefix = cache_len). The slots must
    already hold cache_len + N entries (`cache.reserve`). Padding rows: token 0 at position 0
    written to the trash row, prefix 0, no blocks, each node seeing only itself (the kernel loads
    nothing for such a row). Built in numpy on views of the one buffer: this runs every round
    while the GPU waits (a chained verify's launch, too), and torch's per-call cost is several
    times numpy's. `width`: of the block tables, in blocks (default: as far as the longest row
    reaches, so the work and the copy grow with the context held, not with max_len)."""
    b, n = token_ids.shape
    assert rows >= b and (not cache_lens or max(cache_lens) + n <= cache.max_len), (rows, b, cache_lens, n)
    if width is None:   # as far as the longest row reaches (its prefix and nodes), not max_len's width
        width = blocks_for(max(cache_lens) + n, cache.block_size) if b else 1
    pinned = cache.k[0].device.type == "cuda"
    flat = torch.empty(tree_inputs_nbytes(rows, n, width), dtype=torch.uint8, pin_memory=pinned)
    tok, pos, write, tables, prefix, mask = _tree_fields_np(flat, rows, n, width)
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
        tables[:b] = cache.host_tables_np[slots, :width]
        write[:b] = cache.host_rows_np(slots, base[:, None] + np.arange(n))
        prefix[:b] = base
    return flat


def tree_verify_inputs(cache: PagedKVCache, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor,
                       parents: torch.Tensor, node_valid: torch.Tensor, rows: int) -> TreeVerifyInputs:
    """`host_tree_inputs` on the cache's device (one copy): `verify_inputs` for the tree attention."""
    b, n = token_ids.shape
    flat = host_tree_inputs(cache, slots, cache_lens, token_ids, parents, node_valid, rows)
    return tree_inputs_on(flat.to(cache.k[0].device, non_blocking=True), rows, n)


def padding_tree_flat(cache: PagedKVCache, rows: int, n: int) -> torch.Tensor:
    """Packed tree inputs with every row padding (what warm-up and capture run on), on the device."""
    empty = torch.zeros(0, n, dtype=torch.long)
    return host_tree_inputs(cache, [], [], empty, empty, empty.bool(), rows, cache.host_tables.shape[1]
                            ).to(cache.k[0].device)


def padding_tree_inputs(cache: PagedKVCache, rows: int, n: int) -> TreeVerifyInputs:
    return tree_inputs_on(padding_tree_flat(cache, rows, n), rows, n)
