"""An explicit KV cache: one contiguous region per request slot.

Layout: `k[layer] [num_slots, num_kv_heads, max_len + 1, head_dim]` (same for v). Index
`max_len` of every slot is a trash row: padding tokens of a ragged batch write there and no
mask ever lets a real token read it.

For committed entries the cache index equals the token's position. A round's tree nodes
are written after the committed entries (several nodes may share a position), and when the
round commits, the accepted nodes are compacted onto the positions right after the
committed prefix (`compact`); everything beyond is scratch and is overwritten later.

The engines own the slot bookkeeping (which request lives in which slot and how many of its
entries are committed); this module moves tensors. A forward sees the cache through one view
per step, whose `attend(layer, q, k_new, v_new, mask, scale)` writes the step's K/V and attends:
`CacheBatch` / `PagedCacheBatch` gather the span and apply the caller's dense mask;
`PagedTreeBatch` (NativeRunner's triton_attention) reads the pool in place through the block
tables with the tree mask it carries; `PackedPrefillBatch` takes several prompts' tokens back to
back in one row, writes their K/V into the pool and attends each prompt over its own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spectandem.devices import to_device
from spectandem.kernels.attention import launch_split_len, paged_tree_attention, pool_rows, split_len_for
from spectandem.kernels.prefill_attention import packed_causal_attention
from spectandem.modeling.layers import masked_attention


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        if num_slots < 1 or max_len < 1:
            raise ValueError(f"KV cache needs num_slots >= 1 and max_len >= 1, got {num_slots}, {max_len}")
        shape = (num_slots, num_kv_heads, max_len + 1, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots = num_slots
        self.max_len = max_len
        self.trash_index = max_len

    def batch(self, slots: torch.Tensor, write_index: torch.Tensor, span: int) -> "CacheBatch":
        """A view for one forward: rows `slots [B]`, new tokens written at `write_index [B, T]`
        (use `trash_index` for padding), attention over cache indices [0, span)."""
        if span > self.max_len:
            raise ValueError(f"sequence needs {span} cache entries, more than max_len {self.max_len}")
        return CacheBatch(self, slots, write_index, span)

    def compact(self, slots: torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
        """Copies entries `src_index [B, A]` to `dst_index [B, A]` within each slot `slots [B]`
        (all layers). Sources are read before anything is written, so overlaps are safe."""
        rows = slots[:, None]
        for layer in range(len(self.k)):
            for cache in (self.k[layer], self.v[layer]):
                moved = cache[rows, :, src_index]            # [B, A, nkv, hd]
                cache[rows, :, dst_index] = moved

    def clear_slot(self, slot: int) -> None:
        for layer in range(len(self.k)):
            self.k[layer][slot].zero_()
            self.v[layer][slot].zero_()


@dataclass
class CacheBatch:
    cache: KVCache
    slots: torch.Tensor        # [B] int64
    write_index: torch.Tensor  # [B, T] int64
    span: int

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes `k_new, v_new [B, nkv, T, hd]`, returns this batch's `k, v [B, nkv, span, hd]`."""
        self._write(layer, k_new, v_new)
        return self._read(layer)

    def _write(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> None:
        rows = self.slots[:, None]
        self.cache.k[layer][rows, :, self.write_index] = k_new.transpose(1, 2).to(self.cache.k[layer].dtype)
        self.cache.v[layer][rows, :, self.write_index] = v_new.transpose(1, 2).to(self.cache.v[layer].dtype)

    def _read(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (self.cache.k[layer][self.slots, :, : self.span],
                self.cache.v[layer][self.slots, :, : self.span])

    def write_rotary(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The draft head's fast path, as PagedCacheBatch has it: writes apply_rotary(k_new) and
        `v_new [B, nkv, T, hd]`, returns apply_rotary(q) (the rotary kernel on CUDA)."""
        from spectandem.kernels.rotary import rotary

        q, k = rotary(q, k_new, cos, sin)
        self._write(layer, k, v_new)
        return q

    def attend_rows(self, layer: int, q: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """`q [B, nh, Tq, hd]` over the span under `mask [B, Tq, span]` -> [B, Tq, nh * hd]."""
        return masked_attention(q, *self._read(layer), mask, scale)

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Writes `k_new, v_new [B, nkv, T, hd]`, then attends `q [B, nh, T, hd]` over the span
        under `mask [B, T, span]` -> [B, T, nh * hd]."""
        k, v = self.update(layer, k_new, v_new)
        return masked_attention(q, k, v, mask, scale)

    def attend_rotary(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend` of q and k_new rotated by the rotary kernel (`cos, sin [B, T, hd]`)."""
        return _rotated_attend(self, layer, q, k_new, v_new, cos, sin, mask, scale)


class PagedKVCache:
    """The same interface as KVCache over a pool of fixed-size blocks.

    Storage per layer: `k[layer] [num_blocks * block_size + 1, nkv, hd]`; the last row is the
    trash row. A slot's logical index i lives at row `table[i // block_size] * block_size +
    i % block_size`. Example (block_size 4, table [7, 2]): logical 5 -> row 2 * 4 + 1 = 9.
    `reserve(slot, n)` grows the slot's table to hold n entries (KVCacheFull when the pool is
    out); `free(slot)` returns its blocks. Logical indices past the reservation map to the trash
    row (the masks never read them).
    """

    def __init__(self, num_layers: int, num_slots: int, num_kv_heads: int, max_len: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", num_blocks: int | None = None,
                 block_size: int = 16):
        from spectandem.block_manager import BlockManager, blocks_for

        if num_blocks is None:  # as much as the contiguous cache: every slot at full length
            num_blocks = num_slots * blocks_for(max_len + 1, block_size)
        self.blocks = BlockManager(num_blocks, block_size)
        rows = num_blocks * block_size + 1
        self.k = [torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(rows, num_kv_heads, head_dim, dtype=dtype, device=device) for _ in range(num_layers)]
        self.num_slots, self.max_len, self.block_size = num_slots, max_len, block_size
        self.trash_index = max_len
        self._trash_row = rows - 1
        self.device = device
        # [num_slots, max_blocks] physical block ids, -1 where none (kept in step with `blocks`),
        # on the host, and a copy on the device (`_tables`). A verify step's inputs are built from
        # the host table and cross in one copy (verifier/graphs.py), so reserve/trim/free change
        # the host table only and mark the slot; the device copy takes every marked slot's row in
        # one copy when next read. A round thus costs no device call per request.
        self.host_tables = torch.full((num_slots, blocks_for(max_len + 1, block_size)), -1, dtype=torch.long)
        self.host_tables_np = self.host_tables.numpy()     # the same memory, without a call per read
        self._device_tables = torch.full(tuple(self.host_tables.shape), -1, dtype=torch.long, device=device)
        self._stale: set[int] = set()     # slots whose device row lags the host row
        self._mapped = [0] * num_slots    # blocks of each slot's table in host_tables (-1 past them)
        self._device_width = [0] * num_slots   # the same for the device copy
        # The tree attention's segment length (kernels/attention.py, split-KV), a constant of the
        # cache, so every split launch segments a row's entries alike (PagedTreeBatch splits only
        # where the one-pass grid would leave the GPU idle).
        self.attention_split_len = split_len_for(head_dim)

    @property
    def _tables(self) -> torch.Tensor:
        """The block tables on the device, up to date (`sync_device_tables`). Always the same
        tensor: a CUDA graph that reads it must be replayed after a sync (drafter/graphs.py)."""
        self.sync_device_tables()
        return self._device_tables

    def sync_device_tables(self) -> None:
        """Brings the device tables up to date with the host's: one copy for every slot changed
        since the last sync (nothing when none)."""
        if self._stale:
            stale = sorted(self._stale)
            self._stale.clear()
            # Only the columns mapped on either side: past them both rows hold -1 already.
            width = max(1, max(max(self._mapped[s], self._device_width[s]) for s in stale))
            for s in stale:
                self._device_width[s] = self._mapped[s]
            idx = torch.tensor(stale, dtype=torch.long)
            dev = self._device_tables.device
            self._device_tables[:, :width][to_device(idx, dev)] = to_device(self.host_tables[idx, :width], dev)

    def reserve(self, slot: int, num_entries: int) -> None:
        if num_entries > self.max_len:
            raise ValueError(f"sequence needs {num_entries} cache entries, more than max_len {self.max_len}")
        table = self.blocks.allocate(slot, num_entries)
        start = self._mapped[slot]
        if len(table) > start:
            self.host_tables_np[slot, start: len(table)] = table[start:]
            self._stale.add(slot)
            self._mapped[slot] = len(table)

    def reserve_many(self, slots: list[int], num_entries: list[int]) -> None:
        """`reserve` of each slot to its entries, one call for a round's requests (a slot whose
        blocks hold them already costs a length check)."""
        bs, tables, max_len = self.block_size, self.blocks.tables, self.max_len
        for slot, n in zip(slots, num_entries):
            table = tables.get(slot)
            if table is None or len(table) * bs < n or n > max_len or self._mapped[slot] != len(table):
                self.reserve(slot, n)

    def trim_many(self, slots: list[int], num_entries: list[int]) -> None:
        """`trim` of each slot to its entries, one call for a round's requests (a slot within its
        blocks costs a length check)."""
        bs, tables = self.block_size, self.blocks.tables
        for slot, k in zip(slots, num_entries):
            table = tables.get(slot)
            if table and len(table) > -(-k // bs):
                self.trim(slot, k)

    def free(self, slot: int) -> None:
        self.blocks.deallocate(slot)
        self._unmap(slot, 0)

    def _unmap(self, slot: int, keep: int) -> None:
        """Marks the slot's table past `keep` blocks as unmapped (-1)."""
        if self._mapped[slot] > keep:
            self.host_tables_np[slot, keep: self._mapped[slot]] = -1
            self._stale.add(slot)
        self._mapped[slot] = min(self._mapped[slot], keep)

    def trim(self, slot: int, num_entries: int) -> None:
        """Returns the slot's blocks past `num_entries` entries (a round's scratch) to the pool."""
        from spectandem.block_manager import blocks_for

        table = self.blocks.tables.get(slot)
        keep = max(blocks_for(num_entries, self.block_size), self.blocks.borrowed.get(slot, 0))
        if table and len(table) > keep:
            self.blocks.free.extend(reversed(table[keep:]))
            del table[keep:]
            self._unmap(slot, keep)

    def fork(self, src: int, dst: int, num_entries: int) -> None:
        """Gives slot `dst` (empty) the first `num_entries` entries of slot `src`: the full blocks
        are shared (read-only for `dst`; `src` must leave them alone until `dst` is freed), the
        partial last block is copied. `dst` then writes only past `num_entries`."""
        from spectandem.block_manager import blocks_for

        bs = self.block_size
        table = self.blocks.tables.get(src, [])
        if len(table) < blocks_for(num_entries, bs):
            raise ValueError(f"slot {src} holds fewer than {num_entries} entries")
        full = num_entries // bs
        self.blocks.share(dst, table[:full])
        self.host_tables[dst, :full] = self.host_tables[src, :full]
        self._stale.add(dst)
        self._mapped[dst] = full
        if num_entries % bs:
            try:
                self.reserve(dst, num_entries)
            except Exception:
                self.free(dst)
                raise
            s0, d0 = table[full] * bs, self.blocks.tables[dst][full] * bs
            for layer in range(len(self.k)):
                for cache in (self.k[layer], self.v[layer]):
                    cache[d0: d0 + bs] = cache[s0: s0 + bs]

    def stats(self) -> dict:
        return {"num_blocks": self.blocks.num_blocks, "block_size": self.block_size,
                "used_blocks": self.blocks.num_used}

    @property
    def host_indexed(self) -> bool:
        """Whether `rows` works on the host tables (a cache on the CPU)."""
        return not self._device_tables.is_cuda

    def rows(self, slots: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """Physical rows of logical `index [B, T]` (not negative) in `slots [B]`. On the CPU,
        `host_rows` (numpy over the host tables: a few torch calls a step cost more there)."""
        if self.host_indexed:
            return self.host_rows(slots.tolist(), index)
        bs = self.block_size
        block = self._tables[slots[:, None], (index // bs).clamp(max=self._tables.shape[1] - 1)]  # [B, T]
        ok = (block >= 0) & (index < self.max_len)
        return torch.where(ok, block * bs + index % bs, self._trash_row)

    @property
    def trash_row(self) -> int:
        """The physical row logical indices past a reservation (and `trash_index`) map to."""
        return self._trash_row

    def host_rows(self, slots: list[int], index: torch.Tensor) -> torch.Tensor:
        """`rows` on the host: physical rows of logical `index [B, T]` (a CPU tensor) in `slots`."""
        return torch.from_numpy(self.host_rows_np(slots, index.numpy()))

    def host_rows_np(self, slots: list[int], index: np.ndarray) -> np.ndarray:
        """`host_rows` in numpy (index [B, T] int64): a verify step's inputs are built on the host
        every round, where numpy's per-call cost is a fraction of torch's. Reads only the table
        entries `index` falls in: a table is as wide as max_len, a round's entries a few."""
        bs = self.block_size
        page = np.clip(index // bs, 0, self.host_tables_np.shape[1] - 1)
        block = self.host_tables_np[np.asarray(slots, dtype=np.int64).reshape(-1, 1), page]
        ok = (block >= 0) & (index >= 0) & (index < self.max_len)
        return np.where(ok, block * bs + index % bs, self._trash_row)

    def host_span_rows_np(self, slots: list[int], span: int, rows: int | None = None) -> np.ndarray:
        """`host_rows_np` of every entry 0..span-1 of each of `slots` -> [rows, span] int64 (rows:
        len(slots) by default; the rows past len(slots), padding, all the trash row), worked out a
        block at a time: a pass reads every column of its span, and this costs one table read per
        block rather than one per entry."""
        bs, b = self.block_size, len(slots)
        rows = b if rows is None else rows
        if not 1 <= span <= self.max_len:
            raise ValueError(f"span must be in [1, {self.max_len}] (the cache's max_len), got {span}")
        nb = -(-span // bs)
        out = np.full((rows, nb, bs), self._trash_row, dtype=np.int64)
        block = self.host_tables_np[np.asarray(slots, dtype=np.int64), :nb]                  # [b, nb]
        np.copyto(out[:b], block[:, :, None] * bs + np.arange(bs), where=(block >= 0)[:, :, None])
        return out.reshape(rows, nb * bs)[:, :span]

    def block_tables(self, slots: torch.Tensor) -> torch.Tensor:
        """[B, max_blocks] physical block ids of `slots [B]`, -1 where none (a copy)."""
        return self._tables[slots]

    def batch(self, slots: torch.Tensor, write_index: torch.Tensor, span: int) -> "PagedCacheBatch":
        if span > self.max_len:
            raise ValueError(f"sequence needs {span} cache entries, more than max_len {self.max_len}")
        read = torch.arange(span, device=slots.device).expand(slots.shape[0], span)
        return PagedCacheBatch(self, self.rows(slots, write_index), self.rows(slots, read))

    def compact(self, slots: list[int] | torch.Tensor, src_index: torch.Tensor, dst_index: torch.Tensor) -> None:
        """Copies logical entries `src_index [B, A]` to `dst_index [B, A]` within each slot. The
        physical rows are worked out on the host (the host tables) and cross in one copy; one
        Triton launch for every layer's K and V on the GPU (spectandem/kernels/compact.py), the
        same copies in torch otherwise."""
        from spectandem.kernels.compact import compact_rows

        slots = slots.tolist() if isinstance(slots, torch.Tensor) else list(slots)
        src, dst = self.host_rows(slots, src_index.cpu()), self.host_rows(slots, dst_index.cpu())
        rows = to_device(torch.stack([src, dst]), self.k[0].device)                      # [2, B, A]
        compact_rows(self.k + self.v, rows[0], rows[1])

    def clear_slot(self, slot: int) -> None:
        self.free(slot)


def write_rows_kv(cache: "PagedKVCache", layer: int, rows: torch.Tensor, k_new: torch.Tensor,
                  v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Writes a step's `k_new, v_new [B, nkv, T, hd]` at the physical `rows [B, T]` of `layer`'s
    pools -> the pools (k, v)."""
    k, v = cache.k[layer], cache.v[layer]
    k[rows] = k_new.transpose(1, 2).to(k.dtype)
    v[rows] = v_new.transpose(1, 2).to(v.dtype)
    return k, v


@dataclass
class PagedCacheBatch:
    cache: PagedKVCache
    write_rows: torch.Tensor   # [B, T] physical rows
    read_rows: torch.Tensor    # [B, span] physical rows

    def update(self, layer: int, k_new: torch.Tensor, v_new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes `k_new, v_new [B, nkv, T, hd]`, returns `k, v [B, nkv, span, hd]`."""
        k, v = write_rows_kv(self.cache, layer, self.write_rows, k_new, v_new)
        return pool_rows(k, self.read_rows).transpose(1, 2), pool_rows(v, self.read_rows).transpose(1, 2)

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, mask: torch.Tensor,
               scale: float) -> torch.Tensor:
        """Writes `k_new, v_new [B, nkv, T, hd]`, then attends `q [B, nh, T, hd]` over the read
        rows under `mask [B, T, span]` -> [B, T, nh * hd]."""
        k, v = self.update(layer, k_new, v_new)
        return masked_attention(q, k, v, mask, scale)

    def attend_rotary(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """`attend` of q and k_new rotated by the rotary kernel (`cos, sin [B, T, hd]`)."""
        return _rotated_attend(self, layer, q, k_new, v_new, cos, sin, mask, scale)

    def write_rotary(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                     cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The draft head's fast path, part 1: writes apply_rotary(k_new) and `v_new [B, nkv, T, hd]`
        at the write rows and returns apply_rotary(q) (`cos, sin [B, T, hd]`), in one launch on
        CUDA (spectandem/kernels/rotary.py), the torch code otherwise."""
        from spectandem.kernels.rotary import rotary_write

        return rotary_write(q, k_new, v_new, cos, sin, self.cache.k[layer], self.cache.v[layer], self.write_rows)

    def attend_rows(self, layer: int, q: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        """Part 2: `q [B, nh, Tq, hd]` over the read rows under `mask [B, Tq, span]` -> [B, Tq, nh * hd],
        reading the pool in place (spectandem/kernels/rows_attention.py) where `update` gathers."""
        from spectandem.kernels.rows_attention import rows_attention

        return rows_attention(q, self.cache.k[layer], self.cache.v[layer], self.read_rows, mask, scale)


@dataclass
class PackedPrefillBatch:
    """A prefill of several prompts whose tokens lie back to back in one row of the forward
    (`[1, T]`, T their tokens in all, no padding), so its GEMMs take no padded rows: each token's
    K/V is written at its own slot's entry, and each prompt attends causally over its own tokens,
    whose K/V are the forward's own (every prompt starts at entry 0): spectandem/kernels/
    prefill_attention.py, the Triton kernel on CUDA, its torch reference otherwise.

    Example: prompts of 2 and 3 tokens -> T = 5, `starts` [0, 2, 5], `longest` 3."""

    cache: PagedKVCache
    write_rows: torch.Tensor     # [1, T] physical rows of every token's entry
    starts: torch.Tensor         # [P + 1] int32: prompt p's tokens are [starts[p], starts[p + 1])
    longest: int                 # the longest prompt's tokens

    @classmethod
    def of(cls, cache: PagedKVCache, slots: list[int], lens: list[int]) -> "PackedPrefillBatch":
        """The view of prompts of `lens` tokens in `slots`, each prefilled from entry 0 (the
        slots reserve their entries first)."""
        slot_of = np.repeat(np.asarray(slots, dtype=np.int64), lens)
        entry = np.concatenate([np.arange(m) for m in lens])
        rows = cache.host_rows_np(slot_of, entry[:, None])[:, 0]
        starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        dev = cache.k[0].device
        return cls(cache, to_device(torch.from_numpy(rows)[None], dev), to_device(torch.from_numpy(starts), dev),
                   max(lens))

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, mask: None,
               scale: float) -> torch.Tensor:
        """Writes `k_new, v_new [1, nkv, T, hd]`, then attends `q [1, nh, T, hd]` of each prompt over
        its own tokens -> [1, T, nh * hd]. `mask` must be None: the view masks each prompt itself."""
        assert mask is None, "a PackedPrefillBatch masks each prompt itself; the forward's mask must be None"
        write_rows_kv(self.cache, layer, self.write_rows, k_new, v_new)
        return packed_causal_attention(q[0], k_new[0], v_new[0], self.starts, self.longest, scale)[None]

    def attend_rotary(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, mask: None, scale: float) -> torch.Tensor:
        """`attend` of q and k_new rotated by the rotary kernel (`cos, sin [1, T, hd]`)."""
        return _rotated_attend(self, layer, q, k_new, v_new, cos, sin, mask, scale)


def _rotated_attend(view, layer, q, k_new, v_new, cos, sin, mask, scale) -> torch.Tensor:
    """The fused ops' attention on a view whose write is no kernel of its own: the rotary kernel
    (spectandem/kernels/rotary.py; the torch code off CUDA) on q and k_new, then `view.attend`."""
    from spectandem.kernels.rotary import rotary

    q, k = rotary(q, k_new, cos, sin)
    return view.attend(layer, q, k, v_new, mask, scale)


@dataclass
class PagedTreeBatch:
    """A verify step without a dense mask or a gather: K/V are written in place and the attention
    reads the pool through the block tables (spectandem/kernels/attention.py; the Triton kernel on
    CUDA, its torch reference otherwise).

    The kernel's convention, which NativeRunner.verify's layout already is: request b's committed
    entries are logical [0, prefix_lens[b]) and its T round tokens are written at logical
    prefix_lens[b] + t (`write_rows` holds their physical rows); token t sees every committed entry
    and the round entries its row of `tree_mask` allows. Example: prefix_lens [3], parents
    [-1, 0, 0] -> token 2 is written at entry 5 and sees entries 0, 1, 2, 3 and 5.
    Padding rows (a CUDA graph's bucket): prefix 0, a table of -1 and an identity mask; the kernel
    then loads no K/V for them and returns zeros (the reference reads the trash row)."""

    cache: PagedKVCache
    write_rows: torch.Tensor    # [B, T] physical rows of logical entries prefix_lens + 0..T-1
    block_tables: torch.Tensor  # [B, max_blocks] physical block ids, -1 where none
    prefix_lens: torch.Tensor   # [B] committed entries, visible to every round token
    tree_mask: torch.Tensor     # [B, T, T] bool: token t may see round entry j (itself and its ancestors)

    def attend(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, mask: None,
               scale: float) -> torch.Tensor:
        """Writes `k_new, v_new [B, nkv, T, hd]`, then attends `q [B, nh, T, hd]` -> [B, T, nh * hd].
        `mask` must be None: this batch carries its own (prefix_lens and tree_mask)."""
        assert mask is None, "a PagedTreeBatch masks through prefix_lens and tree_mask; the forward's mask must be None"
        write_rows_kv(self.cache, layer, self.write_rows, k_new, v_new)
        return self.attend_pool(layer, q, scale)

    def attend_rotary(self, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, mask: None, scale: float) -> torch.Tensor:
        """`attend` of the rotated q and k_new (cos, sin [B, T, hd]): the rotation and the K/V
        write in one launch on CUDA (spectandem/kernels/rotary.py), the same values."""
        from spectandem.kernels.rotary import rotary_write

        assert mask is None, "a PagedTreeBatch masks through prefix_lens and tree_mask; the forward's mask must be None"
        q = rotary_write(q, k_new, v_new, cos, sin, self.cache.k[layer], self.cache.v[layer], self.write_rows)
        return self.attend_pool(layer, q, scale)

    def attend_pool(self, layer: int, q: torch.Tensor, scale: float) -> torch.Tensor:
        """`q [B, nh, T, hd]` over the pool as it is (the round's K/V already written) -> [B, T, nh * hd]."""
        k, v = self.cache.k[layer], self.cache.v[layer]
        split_len = launch_split_len(q, k.shape[1], self.cache.attention_split_len)
        return paged_tree_attention(q, k, v, self.block_tables, self.prefix_lens, self.tree_mask, scale,
                                    self.cache.block_size, split_len=split_len)
