"""An explicit KV cache: one contiguous region per request slot.

Layout: `k[layer] [num_slots, num_kv_heads, max_len + 1, head_dim]` (same for v). Index
`max_len` of every slot is a trash row: padding tokens of a ragged batch write there and no
mask ever lets a real token read it.

For committed entries the cache index equals the token's position. A round's tree nodes
are written after the committed entries (several nodes may share a position), and when the
round commits, the accepted nodes are compacted onto the positions right after the
committed prefix (`compact`); everything beyond is scratch and is overwritten later.

The engines own the slot bookkeeping (which request lives in which slot and how many of its
entries are committed); this module only moves tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


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
        rows = self.slots[:, None]
        self.cache.k[layer][rows, :, self.write_index] = k_new.transpose(1, 2).to(self.cache.k[layer].dtype)
        self.cache.v[layer][rows, :, self.write_index] = v_new.transpose(1, 2).to(self.cache.v[layer].dtype)
        return (self.cache.k[layer][self.slots, :, : self.span],
                self.cache.v[layer][self.slots, :, : self.span])
