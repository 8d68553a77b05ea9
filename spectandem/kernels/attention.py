"""Tree-masked attention over the paged KV cache, batch-invariant.

Glossary (the verifier's words, see verifier/runner.py and spectandem/kv_cache.py):

    pool            `k_pool, v_pool [rows, nkv, hd]`: one layer of PagedKVCache. Logical entry i of
                    request b lives at row `block_tables[b, i // block_size] * block_size +
                    i % block_size`. Example (block_size 4, table [7, 2]): entry 5 -> row 2*4+1 = 9.
    prefix_lens     `[B]`: the committed entries (`cache_len`), visible to every query row.
    round entries   The T query tokens' own K/V, already written at entries prefix_len .. prefix_len+T-1
                    (query token t at prefix_len + t, as NativeRunner.verify writes a tree's nodes).
    tree_mask       `[B, T, T]` bool: query t may see round entry j (True on the diagonal and on t's
                    ancestors; `spectandem.tree.ancestor_mask`). None = causal over the round
                    entries (j <= t), i.e. plain decoding or a chain.

Query token t of request b attends to entries `[0, prefix_len)` and to the round entries its row of
tree_mask allows, nothing else: exactly the mask NativeRunner.verify builds. Example: prefix_len 3,
T = 3, parents [-1, 0, 0] -> token 2 sees entries 0, 1, 2 (prefix), 3 (root) and 5 (itself), not 4.

Batch invariance (what "batch-invariant verification" needs). The kernel reduces over the cache in a
fixed order: logical entries in chunks of BLOCK_N starting at entry 0, whatever T, B or the other
rows are, with one tile shape (BLOCK_M x BLOCK_N, a function of head_dim only) and an online softmax
in fp32. Entries a row may not see get probability exactly 0, and a chunk it cannot see at all
leaves its running max, sum and accumulator bit-for-bit unchanged (rescale factor exp2(0) = 1,
added terms 0). So a query row's output depends only on its own query and the entries it sees:
the token verified alone (T = 1, prefix_len + t committed entries) and the same token as node t of a
chain of 16 give bit-identical results, as do different batch sizes and different sibling rows.
The torch reference has no such guarantee (its matmul tiling follows the shapes), and the two differ
in the last bits: plain decoding and verification must both go through the kernel. tree_mask=None
is turned into a causal mask tensor so that both run the one compiled kernel.

Row blocks and programs. The T * GROUP query rows of a (request, kv head) are cut into row blocks of
BLOCK_M (a tile). Where the launch has row blocks enough to fill the GPU several times over, a
program computes two of them, 2p and 2p + 1 (`tiles_per_program`; a tree of 5 nodes with GROUP 4
has 20 rows, two blocks): its chunk loop loads each chunk of block table, K and V once and runs
both tiles over it, where one program per block loads the request's whole context once per block.
Each tile goes through the same operations in the same order (attention_kernels.py `_tile_step`),
so which program, and which of its tiles, holds a row leaves the row's arithmetic as it is.

Split-KV (`split_len`, "flash-decoding"). One program per (request, kv head, row blocks) walks the
whole span: at batch 1 and T = 1 that is nkv programs per layer, a few percent of the GPU.
With split_len set, the logical entries are cut into segments [s * split_len, (s + 1) * split_len)
from entry 0, and the segments are dealt to num_splits lanes: segment s to lane s % num_splits. A
first kernel runs one program per (request, kv head, row blocks, lane), grid (B * nkv, cdiv(row
blocks, tiles), num_splits): the same chunk loop over the lane's segments in increasing order, one
running state over all of them, leaving per (row, lane) the running max m, sum l and un-normalised
accumulator acc in fp32. A second kernel, grid (B * nkv, row blocks), combines a row's lanes l = 0,
1, ... in that order: M = max_l m_l, then l = sum_l exp2(m_l - M) * l_l and acc likewise, out =
acc / l. Example (split_len 64, 32 lanes, prefix_len 100, T = 3): span 103, lanes 0 (entries
0..63) and 1 (64..102) are computed and combined; lanes 2.. start past the span, their programs exit
at once and the combine does not read them. With prefix_len 2100 lane 0 also takes segment 32
(entries 2048..2111) after segment 0. num_splits = min(_MAX_SPLITS, cdiv(max_blocks * block_size,
split_len)) comes from the table's width on the host (the grid never depends on prefix_lens).
split_len is BLOCK_N (`split_len_for`), whatever the cache's capacity: a context of a few hundred
entries is spread over as many lanes as it has chunks, and a long one over _MAX_SPLITS lanes. The
partials are allocated per call: B * nh * T * num_splits * (hd + 2) * 4 bytes, e.g. 0.16 MiB at
B = 1, T = 1, 32 heads of 128 and 10 lanes; 520 MiB at B = 64, T = 16 and 32 lanes (the caching
allocator and a CUDA graph pool reuse it layer after layer).

Batch invariance holds for a fixed split_len by the same argument: split_len is a multiple of
BLOCK_N, so a segment's chunks are the one-pass kernel's chunks and start where they do; the lane of
a segment is a function of the segment and the row's span alone (a row of span S has each of its
cdiv(S, split_len) segments in a lane of its own wherever that count fits in num_splits, and a table
too narrow for _MAX_SPLITS lanes holds no span past num_splits segments, so past that count
num_splits is _MAX_SPLITS in every launch); within a lane the chunks run in increasing order through
the chunk loop above (same tile shapes, invisible chunks change nothing); and the combine visits
lanes in a fixed order, where a lane a row cannot see (m = -inf, l = 0, acc = 0: past its last
visible entry but inside the span of a longer T) adds exact zeros and leaves the max alone. So the
token verified alone and node t of a chain, or a row in batches of 1 and 64, or under a wider table,
still agree bit for bit, given the same split_len. Split and one-pass results differ in the last bits
(another summation order).

When the cache splits (`launch_split_len`). Splitting pays where the one-pass grid leaves the GPU
idle and costs where it does not: on the H200 (8B shapes, context 512, benchmarks/attention_timing.py)
split took 12.7 vs 28.0 µs at B = 1, T = 1, but 79 vs 62 µs at B = 16, T = 16 and 292 vs 241 µs at
B = 64, T = 16 (the partials' traffic). So a PagedTreeBatch splits (with the cache's fixed
split_len) when the one-pass grid has fewer programs than the device has multiprocessors, and runs
one pass otherwise. Within one launch shape the result is batch-invariant as argued above; across
the threshold (say plain decoding at batch 1 and a 16-node tree at batch 16) the same row can
differ in the last bits. Greedy output equal to plain decoding bit for bit on the GPU is what
`--batch-invariant` (spectandem/kernels/batch_invariant.py) guarantees, not this fast path.

Lengths are read on the device (prefix_lens is loaded by the kernel, never `.item()`ed), so the
launch needs no host sync and can be captured in a CUDA graph with fixed B and T.
"""

from __future__ import annotations

import math

import torch

from spectandem.checks import describe_placed, is_integer
from spectandem.kernels import HAVE_TRITON
from spectandem.modeling.layers import masked_attention

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_M = 16   # query rows per tile; fixed so a row's arithmetic never depends on T
_NUM_WARPS = 4
_PAIR_FILL = 4  # tiles_per_program: row blocks per multiprocessor from which a program computes two
_MAX_SPLITS = 32  # lanes per row at most (bounds the partials and the combine's loop)

if HAVE_TRITON:
    import triton

    from spectandem.kernels.attention_kernels import (_combine_splits_kernel, _paged_tree_attention_kernel,
                                                      _paged_tree_attention_split_kernel)


def pool_rows(pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`pool [R, ...]` at the physical `rows [B, S]` -> [B, S, ...]: pool[rows], as one
    index_select of the flattened rows (on a CPU a third of the time of advanced indexing:
    0.03 against 0.09 ms for 300 rows of a demo-sized pool)."""
    return pool.index_select(0, rows.reshape(-1)).view(*rows.shape, *pool.shape[1:])


def paged_tree_attention(
    q: torch.Tensor,  # [B, nh, T, hd]
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] integer, -1 where none
    prefix_lens: torch.Tensor,  # [B] integer
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, or None for causal
    scale: float,
    block_size: int,
    *,
    split_len: int | None = None,
) -> torch.Tensor:  # [B, T, nh * hd]
    """The kernel for CUDA tensors when Triton is installed, the torch reference otherwise."""
    if q.is_cuda and HAVE_TRITON:
        return paged_tree_attention_triton(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, scale,
                                           block_size, split_len=split_len)
    return paged_tree_attention_ref(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, scale, block_size,
                                    split_len=split_len)


def paged_tree_attention_triton(
    q: torch.Tensor,  # [B, nh, T, hd]
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] integer, -1 where none
    prefix_lens: torch.Tensor,  # [B] integer
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, or None for causal
    scale: float,
    block_size: int,
    *,
    split_len: int | None = None,
) -> torch.Tensor:  # [B, T, nh * hd]
    """Validates the inputs and launches the kernel (see the module docstring for the semantics):
    one pass per row when split_len is None, else the split-KV pair (`split_len_for`).

    Entries a row may see must be mapped in block_tables (PagedKVCache.reserve does that); unmapped
    entries read as zeros here and as the trash row in the reference, and no well-formed mask sees them.
    """
    if not HAVE_TRITON:
        raise RuntimeError("paged_tree_attention_triton needs the triton package")
    _check_inputs(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, block_size, split_len)
    last_dim_contiguous = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "block_tables": block_tables,
                           "tree_mask": tree_mask}
    for name, value in last_dim_contiguous.items():
        if value is not None and value.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {value.stride()}")
    if k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool must share strides, got {k_pool.stride()} and {v_pool.stride()}")
    batch_size, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(batch_size, num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if batch_size == 0 or num_tokens == 0:
        return out
    if tree_mask is None:
        # Causal is a tree mask too, and passing it as one keeps a single compiled kernel: on the
        # H200 a variant computing causality in registers differed from the masked one in the last
        # bit, and plain decoding must match verification bit for bit. [T, T], broadcast over B.
        tree_mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril_().expand(
            batch_size, num_tokens, num_tokens)
    mask = tree_mask.view(torch.uint8)  # same storage, no copy; both Triton backends load bytes
    grid = (batch_size * num_kv_heads, triton.cdiv(num_tokens * group, _BLOCK_M))
    if split_len is not None:
        _launch_split(q, k_pool, v_pool, block_tables, prefix_lens, mask, out, scale, block_size, split_len, grid)
        return out
    tiles = tiles_per_program(q, num_kv_heads)
    _paged_tree_attention_kernel[(grid[0], triton.cdiv(grid[1], tiles))](
        q, k_pool, v_pool, block_tables, prefix_lens, mask, out,
        scale * math.log2(math.e), num_tokens * group, num_tokens, block_tables.shape[1],
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        block_tables.stride(0),
        mask.stride(0), mask.stride(1),
        out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=block_size,
        BLOCK_M=_BLOCK_M, BLOCK_N=_block_n(head_dim), TILES=tiles,
        num_warps=_NUM_WARPS,
    )
    return out


def tiles_per_program(q: torch.Tensor, num_kv_heads: int) -> int:
    """Row blocks a program of the attention kernels computes for `q [B, nh, T, hd]` (module
    docstring): two where a (request, kv head) has more than one and the row blocks of the launch
    fill the GPU _PAIR_FILL times over, else one. Two halve the loads of K and V but make each
    program's work twice as long, which pays only where programs wait for the GPU anyway: on an H100
    (8B shapes, context 512, benchmarks/attention_timing.py), T = 5 took 113 against 129 µs at B = 64
    (1,024 row blocks) and 53 against 36 µs at B = 16 (256). Off CUDA (Triton's interpreter): two
    wherever there are two. A function of the shapes alone, so it is fixed within a CUDA graph."""
    batch_size, num_heads, num_tokens, _ = q.shape
    row_blocks = -(-num_tokens * (num_heads // num_kv_heads) // _BLOCK_M)
    if row_blocks < 2:
        return 1
    if not q.is_cuda:
        return 2
    return 2 if batch_size * num_kv_heads * row_blocks >= _PAIR_FILL * _multiprocessors(q.device) else 1


def _launch_split(q, k_pool, v_pool, block_tables, prefix_lens, mask, out, scale, block_size, split_len,
                  grid) -> None:
    """The split-KV pair on validated inputs: partials per (row, segment), then the combine into
    `out [B, T, nh * hd]`. `grid` is the one-pass kernel's (B * nkv, row blocks)."""
    batch_size, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    num_rows = num_tokens * group
    # From the table's width, never from prefix_lens: the launch stays capturable (module docstring).
    num_splits = split_lanes(block_tables.shape[1] * block_size, split_len)
    # fp32 partials, B * nh * T * num_splits * (hd + 2) * 4 bytes in all (module docstring). Slots
    # of lanes past a row's span stay unwritten and unread.
    stats = torch.empty(batch_size * num_kv_heads, num_splits, 2, num_rows, dtype=torch.float32,
                        device=q.device)  # [B * nkv, num_splits, (m, l), T * GROUP]
    acc = torch.empty(batch_size * num_kv_heads, num_splits, num_rows, head_dim, dtype=torch.float32,
                      device=q.device)  # [B * nkv, num_splits, T * GROUP, hd]
    shapes = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=_BLOCK_M, SPLIT=split_len)
    tiles = tiles_per_program(q, num_kv_heads)
    _paged_tree_attention_split_kernel[(grid[0], triton.cdiv(grid[1], tiles), num_splits)](
        q, k_pool, v_pool, block_tables, prefix_lens, mask, stats, acc,
        scale * math.log2(math.e), num_rows, num_tokens, block_tables.shape[1], num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        block_tables.stride(0),
        mask.stride(0), mask.stride(1),
        stats.stride(0), stats.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        PAGE=block_size, BLOCK_N=_block_n(head_dim), TILES=tiles, **shapes,
        num_warps=_NUM_WARPS,
    )
    combine_splits(prefix_lens, stats, acc, out, num_tokens, grid, shapes)


def combine_splits(prefix_lens, stats, acc, out, num_tokens, grid, shapes) -> None:
    """The combine of a split kernel's partials `stats [B * nkv, num_splits, 2, rows]` and `acc
    [B * nkv, num_splits, rows, hd]` into `out [B, T, nh * hd]`, request b's span being
    prefix_lens[b] + T. `grid`: (B * nkv, row blocks); `shapes`: the split kernel's constants."""
    _combine_splits_kernel[grid](
        prefix_lens, stats, acc, out,
        stats.shape[3], num_tokens, stats.shape[1],
        stats.stride(0), stats.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        out.stride(0), out.stride(1),
        **shapes,
        num_warps=_NUM_WARPS,
    )


def launch_split_len(q: torch.Tensor, num_kv_heads: int, split_len: int) -> int | None:
    """`split_len` when `q [B, nh, T, hd]` has fewer row blocks over its requests and kv heads
    than the device has multiprocessors (the split pays there), else None (one pass). A function of the
    launch's shapes alone, so it is fixed within a captured CUDA graph. Off CUDA: split_len."""
    if not q.is_cuda:
        return split_len
    batch_size, num_heads, num_tokens, _ = q.shape
    programs = batch_size * num_kv_heads * -(-num_tokens * (num_heads // num_kv_heads) // _BLOCK_M)
    return split_len if programs < _multiprocessors(q.device) else None


def _multiprocessors(device: torch.device) -> int:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


_SM_COUNT: dict[int, int] = {}


def split_len_for(head_dim: int) -> int:
    """The split_len of the split-KV path: BLOCK_N, one chunk a segment (module docstring). Not a
    function of the cache's capacity: the lanes (`split_lanes`) bound a long context's partials,
    so a short context gets one lane per chunk in a cache of any size (64 for head_dim <= 128)."""
    return _block_n(head_dim)


def split_lanes(entries: int, split_len: int) -> int:
    """The lanes of a split launch over tables of `entries` (width * block_size) entries per
    request: one per segment, at most _MAX_SPLITS."""
    return min(_MAX_SPLITS, -(-entries // split_len))


def paged_tree_attention_ref(
    q: torch.Tensor,  # [B, nh, T, hd]
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] integer, -1 where none
    prefix_lens: torch.Tensor,  # [B] integer
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, or None for causal
    scale: float,
    block_size: int,
    *,
    split_len: int | None = None,
) -> torch.Tensor:  # [B, T, nh * hd]
    """The same in torch, as the model computes it today: gather the rows of entries
    [0, max(prefix_lens) + T) (PagedKVCache.rows), build the dense [B, T, span] mask
    (NativeRunner.verify) and call masked_attention. split_len is checked and otherwise ignored: it
    changes the kernel's summation order, not what is computed."""
    _check_inputs(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, block_size, split_len)
    batch_size, _, num_tokens, _ = q.shape
    device = q.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    span = int(prefix.max()) + num_tokens if batch_size else num_tokens
    cols = torch.arange(span, device=device)  # [span] logical entries
    page = (cols // block_size).clamp(max=block_tables.shape[1] - 1)
    block = block_tables.to(device=device, dtype=torch.int64)[:, page]  # [B, span]
    mapped = (block >= 0) & (cols < block_tables.shape[1] * block_size)
    rows = torch.where(mapped, block * block_size + cols % block_size, k_pool.shape[0] - 1)  # [B, span]
    k = pool_rows(k_pool, rows).transpose(1, 2)  # [B, nkv, span, hd]
    v = pool_rows(v_pool, rows).transpose(1, 2)

    if tree_mask is None:
        tree_mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril().expand(
            batch_size, num_tokens, num_tokens)
    j = cols[None, :] - prefix[:, None]  # [B, span] round entry index
    in_round = (j >= 0) & (j < num_tokens)
    # allowed[b, t, c] = tree_mask[b, t, j[b, c]] where c is a round entry.
    allowed = tree_mask.to(device).gather(2, j.clamp(0, num_tokens - 1)[:, None, :].expand(-1, num_tokens, -1))
    mask = (cols[None, None, :] < prefix[:, None, None]) | (in_round[:, None, :] & allowed)  # [B, T, span]
    return masked_attention(q, k, v, mask, scale)


def check_query_and_pools(q, k_pool, v_pool) -> None:
    """The attention kernels' common checks: q [B, nh, T, hd] float16/bfloat16/float32; k_pool and
    v_pool [rows, nkv, hd] of one shape, q's dtype and device, nkv dividing nh."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be a float16/bfloat16/float32 tensor [B, nh, T, hd], got {describe_placed(q)}")
    nh, hd = q.shape[1], q.shape[3]
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 3 or pool.shape[2] != hd \
                or pool.dtype != q.dtype or pool.device != q.device:
            raise ValueError(f"{name} must be a tensor [rows, nkv, {hd}] of q's dtype {q.dtype} on {q.device}, "
                             f"got {describe_placed(pool)}")
    if k_pool.shape != v_pool.shape or nh % k_pool.shape[1]:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} must agree, with "
                         f"q's {nh} heads a multiple of their kv heads")


def _block_n(head_dim: int) -> int:
    """Key chunk length: a function of head_dim alone, never of T or B (batch invariance)."""
    return 64 if head_dim <= 128 else 32


def _check_inputs(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, block_size, split_len) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be a float16/bfloat16/float32 tensor [B, nh, T, hd], got {describe_placed(q)}")
    batch_size, num_heads, num_tokens, head_dim = q.shape
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 3 or pool.shape[2] != head_dim:
            raise ValueError(f"{name} must be a tensor [rows, nkv, hd] with hd = {head_dim}, got {describe_placed(pool)}")
        if pool.dtype != q.dtype or pool.device != q.device:
            raise ValueError(f"{name} must have q's dtype {q.dtype} and device {q.device}, got {describe_placed(pool)}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ in shape")
    if num_heads % k_pool.shape[1]:
        raise ValueError(f"q's {num_heads} heads are not a multiple of the pool's {k_pool.shape[1]} kv heads")
    if not is_integer(block_tables) or block_tables.dim() != 2 or block_tables.shape[0] != batch_size \
            or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be an integer tensor [B, max_blocks] with B = {batch_size}, "
                         f"got {describe_placed(block_tables)}")
    if not is_integer(prefix_lens) or tuple(prefix_lens.shape) != (batch_size,):
        raise ValueError(f"prefix_lens must be an integer tensor [B] with B = {batch_size}, "
                         f"got {describe_placed(prefix_lens)}")
    if tree_mask is not None and (not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool
                                  or tuple(tree_mask.shape) != (batch_size, num_tokens, num_tokens)):
        raise ValueError(f"tree_mask must be None or a bool tensor [B, T, T] = "
                         f"{[batch_size, num_tokens, num_tokens]}, got {describe_placed(tree_mask)}")
    for name, value in (("block_tables", block_tables), ("prefix_lens", prefix_lens), ("tree_mask", tree_mask)):
        if value is not None and value.device != q.device:
            raise ValueError(f"{name} is on {value.device}, q on {q.device}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    block_n = _block_n(head_dim)
    if split_len is not None and (not isinstance(split_len, int) or isinstance(split_len, bool) or split_len < 1
                                  or split_len % block_n):
        raise ValueError(f"split_len must be None or a positive multiple of the kernel's key chunk BLOCK_N = "
                         f"{block_n} (head_dim {head_dim}), got {split_len!r}")
