"""KV compaction of the accepted path: copy physical rows `src -> dst` in every pool, one launch.

When a round commits, accepted node j (written at entry cache_len + j) moves to entry
cache_len + its rank on the path (NativeRunner.commit); PagedKVCache.rows turns both into physical
rows. Example: cache_len 10, path [0, 2, 5] -> entries [10, 12, 15] move to [10, 11, 12], so
entry 12 is both a source (of rank 1) and a destination (of rank 2): overlaps are the normal case.

Overlap safety. A copy is correct only if every source is read before any destination is written
(PagedKVCache.compact gathers all sources into a temporary first). The kernel's program (pool p,
columns c0..c1) owns every (src, dst) pair for its slice of columns of its pool, and no other program
touches that slice: it loads all source rows of the slice into registers, waits at a CTA barrier
(`tl.debug_barrier`, a __syncthreads: loads issued before it are ordered before stores issued after
it by any thread of the CTA), then stores all destination rows. So the registers are the temporary,
whatever the order of the pairs, and overlaps across requests are safe as well. The price is that all
pairs must fit one program's registers: at most _MAX_PAIRS of them (a round commits B * (D + 1)).

Destination rows must be distinct, except where the pair is a padding pair whose source equals its
destination (NativeRunner.commit sends padding to the trash row as trash -> trash).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from spectandem.checks import describe_placed
from spectandem.kernels import HAVE_TRITON

_MAX_PAIRS = 8192
_TILE_ELEMENTS = 4096  # pairs x columns held by one program (when pairs allow)
_NUM_WARPS = 4

if HAVE_TRITON:
    import triton
    import triton.language as tl

    _TL_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}

    @triton.jit(do_not_specialize=["num_pairs"])
    def _compact_rows_kernel(
        pool_ptrs,  # [P] int64 data pointers, one per pool
        src_ptr, dst_ptr,  # [M] physical rows
        num_pairs,  # M
        row_stride,  # elements between rows of a pool
        ROW: tl.constexpr,  # elements per row (nkv * hd)
        DTYPE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_C: tl.constexpr,
    ):
        pool = tl.load(pool_ptrs + tl.program_id(0)).to(tl.pointer_type(DTYPE))
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        pairs = tl.arange(0, BLOCK_M)
        pair_ok = pairs < num_pairs
        src = tl.load(src_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
        dst = tl.load(dst_ptr + pairs, mask=pair_ok, other=0).to(tl.int64)
        ok = pair_ok[:, None] & (cols < ROW)[None, :]
        moved = tl.load(pool + src[:, None] * row_stride + cols[None, :], mask=ok)
        # Every source of this slice is read before any destination of it is written (docstring).
        tl.debug_barrier()
        tl.store(pool + dst[:, None] * row_stride + cols[None, :], moved, mask=ok)


def compact_rows(
    pools: Sequence[torch.Tensor],  # P tensors [rows, nkv, hd]: k and v of every layer
    src_rows: torch.Tensor,  # [...] integer physical rows
    dst_rows: torch.Tensor,  # [...] integer, src_rows' shape
) -> None:
    """The kernel for CUDA pools when Triton is installed, the torch reference otherwise."""
    if pools and pools[0].is_cuda and HAVE_TRITON:
        compact_rows_triton(pools, src_rows, dst_rows)
    else:
        compact_rows_ref(pools, src_rows, dst_rows)


def compact_rows_triton(
    pools: Sequence[torch.Tensor],  # P tensors [rows, nkv, hd]
    src_rows: torch.Tensor,  # [...] integer physical rows
    dst_rows: torch.Tensor,  # [...] integer, src_rows' shape
) -> None:
    """Validates the pools and rows and copies in one launch. Rows are not bounds-checked on the
    host (that needs a sync): they must lie in [0, rows), as PagedKVCache.rows guarantees."""
    if not HAVE_TRITON:
        raise RuntimeError("compact_rows_triton needs the triton package")
    _check_inputs(pools, src_rows, dst_rows)
    first = pools[0]
    for i, pool in enumerate(pools):
        if not pool.is_contiguous():
            raise ValueError(f"pools[{i}] must be contiguous, got strides {pool.stride()}")
        if pool.dtype not in _TL_DTYPES:
            raise ValueError(f"pools[{i}] has dtype {pool.dtype}; supported: {sorted(map(str, _TL_DTYPES))}")
    src = src_rows.reshape(-1).contiguous()  # [M]
    dst = dst_rows.reshape(-1).contiguous()  # [M]
    num_pairs = src.numel()
    if num_pairs > _MAX_PAIRS:
        raise ValueError(f"compact_rows_triton moves at most {_MAX_PAIRS} rows per call (one program holds them "
                         f"all for overlap safety), got {num_pairs}")
    if num_pairs == 0 or not pools:
        return
    row = first[0].numel()
    pointers = _pointer_table(tuple(p.data_ptr() for p in pools), first.device)  # [P]
    block_m = triton.next_power_of_2(num_pairs)
    block_c = min(triton.next_power_of_2(row), max(1, _TILE_ELEMENTS // block_m))
    _compact_rows_kernel[(len(pools), triton.cdiv(row, block_c))](
        pointers, src, dst, num_pairs, first.stride(0),
        ROW=row, DTYPE=_TL_DTYPES[first.dtype], BLOCK_M=block_m, BLOCK_C=block_c, num_warps=_NUM_WARPS,
    )


def compact_rows_ref(
    pools: Sequence[torch.Tensor],  # P tensors [rows, nkv, hd]
    src_rows: torch.Tensor,  # [...] integer physical rows
    dst_rows: torch.Tensor,  # [...] integer, src_rows' shape
) -> None:
    """PagedKVCache.compact's torch code: per pool, gather every source, then scatter."""
    _check_inputs(pools, src_rows, dst_rows)
    for pool in pools:
        moved = pool[src_rows]
        pool[dst_rows] = moved


@functools.lru_cache(maxsize=16)
def _pointer_table(addresses: tuple[int, ...], device: torch.device) -> torch.Tensor:  # [P] int64
    """The pools' addresses on their device. Cached so that a call on the same pools uploads nothing
    (no host-to-device copy, so it can be captured in a CUDA graph after one warm-up call); a table
    holds nothing but the addresses of its key, so an entry can never be stale."""
    return torch.tensor(addresses, dtype=torch.int64, device=device)


def _check_inputs(pools, src_rows, dst_rows) -> None:
    for name, value in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if not isinstance(value, torch.Tensor) or value.dtype.is_floating_point or value.dtype.is_complex \
                or value.dtype == torch.bool:
            raise ValueError(f"{name} must be an integer tensor, got {describe_placed(value)}")
    if src_rows.shape != dst_rows.shape:
        raise ValueError(f"src_rows {tuple(src_rows.shape)} and dst_rows {tuple(dst_rows.shape)} differ in shape")
    if not pools:
        return
    first = pools[0]
    for i, pool in enumerate(pools):
        if not isinstance(pool, torch.Tensor) or pool.shape != first.shape or pool.dtype != first.dtype \
                or pool.device != first.device or pool.dim() < 1:
            raise ValueError(f"pools[{i}] must match pools[0] ({describe_placed(first)}), got {describe_placed(pool)}")
    for name, value in (("src_rows", src_rows), ("dst_rows", dst_rows)):
        if value.device != first.device:
            raise ValueError(f"{name} is on {value.device}, the pools on {first.device}")
