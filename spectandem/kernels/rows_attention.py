"""Masked attention over rows of the paged KV pool: the draft head's attention on the GPU.

    rows_attention(q, k_pool, v_pool, read_rows, mask, scale) -> [B, T, nh * hd]

q [B, nh, T, hd]; k_pool, v_pool [R, nkv, hd] (one layer of PagedKVCache); read_rows [B, span] the
physical row of each logical entry 0..span-1 of request b (PagedCacheBatch.read_rows); mask
[B, T, span] bool, True where query t may see entry j. The same numbers as gathering the rows and
calling masked_attention (spectandem/modeling/layers.py), which is what the reference does (the
head's path off the GPU): example, read_rows [[9, 2, 4]], mask [[[True, True, False]]] -> the query
attends to pool rows 9 and 2.

Why. The head's steps read a request's whole context every step. The torch code gathers K and V of
every entry (two copies of the context), repeats them for the query heads of each kv head (two
more, four times the size), then runs a matmul, the mask, the softmax and another matmul: about ten
launches and five passes over the context per step, a cost that grows with the context. The kernel
reads each entry's K and V once, in place, and keeps the softmax online (fp32, base 2), as the
verifier's paged tree attention does (spectandem/kernels/attention.py), whose combine it shares
(its chunk loop is written out here: sharing the Triton helpers too would change the verifier's
kernels, and that wants a GPU run to confirm their bits).

Launch. Split-KV always, as the verifier's split path deals chunks to lanes: one program per
(request, kv head, block of BLOCK_M query rows, lane), lane l taking the chunks of BLOCK_N entries
l, l + lanes, l + 2 * lanes, ... (`split_lanes(span, BLOCK_N)` lanes, at most 32), each leaving its
running max, sum and un-normalised accumulator in fp32; then the combine adds the lanes in order.
The GROUP query heads of a kv head are packed into the rows (row r is token r // GROUP of head
kv_head * GROUP + r % GROUP), so a chunk of K/V is loaded once per kv head. A row whose mask is
all False gets zeros (masked_attention gives finite garbage there; callers never read such rows).
Lengths and the grid come from shapes alone, so the launch can be captured in a CUDA graph.

Numerics: another summation order than the torch code's, so bf16 results differ in the last bits;
the drafts may change there, exactness does not depend on them. Rows do not interact.
"""

from __future__ import annotations

import math

import torch

from spectandem.checks import describe_placed, is_integer
from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.attention import (_BLOCK_M, _NUM_WARPS, _block_n, check_query_and_pools, combine_splits,
                                         pool_rows, split_lanes)
from spectandem.modeling.layers import masked_attention

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_rows", "span", "num_splits"])
    def _rows_attention_split_kernel(
        q_ptr, k_ptr, v_ptr,  # q [B, nh, T, hd]; k, v [R, nkv, hd]
        rows_ptr,  # [B, span] physical row of each logical entry
        mask_ptr,  # [B, T, span] uint8: the bool mask
        stats_ptr,  # [B * nkv, num_splits, 2, T * GROUP] fp32: m (base 2), then l, per (segment, row)
        acc_ptr,  # [B * nkv, num_splits, T * GROUP, hd] fp32
        qk_scale,  # scale * log2(e)
        num_rows,  # T * GROUP
        span,
        num_splits,  # lanes
        stride_qb, stride_qh, stride_qt,
        stride_kr, stride_kh,
        stride_rb,
        stride_mb, stride_mt,
        stride_sp, stride_ss,
        stride_ap, stride_as, stride_ar,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,  # a lane's segments are chunks: the combine's SPLIT
    ):
        pid = tl.program_id(0)
        split = tl.program_id(2)  # the lane: chunks split, split + num_splits, ...
        b = pid // NUM_KV_HEADS
        kv_head = pid % NUM_KV_HEADS
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = r < num_rows
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + tok[:, None] * stride_qt + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for start in range(split * BLOCK_N, span, num_splits * BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_ok = n < span
            phys = tl.load(rows_ptr + b * stride_rb + n, mask=n_ok, other=0).to(tl.int64)
            kv_offs = phys[:, None] * stride_kr + kv_head * stride_kh + d[None, :]
            kv_mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
            allowed = tl.load(mask_ptr + b * stride_mb + tok[:, None] * stride_mt + n[None, :],
                              mask=row_ok[:, None] & n_ok[None, :], other=0) != 0
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing: no NaN
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            m_i = m_new
        stats = stats_ptr + pid.to(tl.int64) * stride_sp + split * stride_ss + r
        tl.store(stats, m_i, mask=row_ok)
        tl.store(stats + num_rows, l_i, mask=row_ok)
        tl.store(acc_ptr + pid.to(tl.int64) * stride_ap + split * stride_as + r[:, None] * stride_ar + d[None, :],
                 acc, mask=row_ok[:, None] & d_ok[None, :])


def rows_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, read_rows: torch.Tensor,
                   mask: torch.Tensor, scale: float) -> torch.Tensor:
    """The kernel for CUDA tensors when Triton is installed, the torch reference otherwise."""
    if q.is_cuda and HAVE_TRITON:
        return rows_attention_triton(q, k_pool, v_pool, read_rows, mask, scale)
    return rows_attention_ref(q, k_pool, v_pool, read_rows, mask, scale)


def rows_attention_ref(q, k_pool, v_pool, read_rows, mask, scale) -> torch.Tensor:
    """The torch code: gather the rows, masked_attention (PagedCacheBatch.update's read, then the
    head's attention)."""
    _check(q, k_pool, v_pool, read_rows, mask)
    return masked_attention(q, pool_rows(k_pool, read_rows).transpose(1, 2), pool_rows(v_pool, read_rows).transpose(1, 2),
                            mask, scale)


def rows_attention_triton(q, k_pool, v_pool, read_rows, mask, scale) -> torch.Tensor:
    """The lanes' segment, a compile-time constant of the kernel, is BLOCK_N whatever the span:
    one compile serves every span."""
    if not HAVE_TRITON:
        raise RuntimeError("rows_attention_triton needs the triton package")
    _check(q, k_pool, v_pool, read_rows, mask)
    for name, value in (("q", q), ("k_pool", k_pool), ("read_rows", read_rows)):
        if value.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {value.stride()}")
    if k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool must share strides, got {k_pool.stride()} and {v_pool.stride()}")
    batch_size, num_heads, num_tokens, head_dim = q.shape
    span = read_rows.shape[1]
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    num_rows = num_tokens * group
    out = torch.empty(batch_size, num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if batch_size == 0 or num_tokens == 0:
        return out
    if mask.stride(-1) != 1:
        mask = mask.contiguous()
    mask8 = mask.view(torch.uint8)  # same storage: the kernel loads bytes
    split_len = _block_n(head_dim)
    num_splits = split_lanes(span, split_len)
    stats = torch.empty(batch_size * num_kv_heads, num_splits, 2, num_rows, dtype=torch.float32, device=q.device)
    acc = torch.empty(batch_size * num_kv_heads, num_splits, num_rows, head_dim, dtype=torch.float32,
                      device=q.device)
    grid = (batch_size * num_kv_heads, triton.cdiv(num_rows, _BLOCK_M))
    shapes = dict(NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
                  BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_M=_BLOCK_M)
    _rows_attention_split_kernel[(*grid, num_splits)](
        q, k_pool, v_pool, read_rows, mask8, stats, acc,
        scale * math.log2(math.e), num_rows, span, num_splits,
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        read_rows.stride(0),
        mask8.stride(0), mask8.stride(1),
        stats.stride(0), stats.stride(1),
        acc.stride(0), acc.stride(1), acc.stride(2),
        BLOCK_N=split_len, **shapes,
        num_warps=_NUM_WARPS,
    )
    # The combine reads a request's span as prefix_lens[b] + T: every request here has `span`.
    prefix = torch.full((batch_size,), span - num_tokens, dtype=torch.int32, device=q.device)
    combine_splits(prefix, stats, acc, out, num_tokens, grid, dict(shapes, SPLIT=split_len))
    return out


def _check(q, k_pool, v_pool, read_rows, mask) -> None:
    check_query_and_pools(q, k_pool, v_pool)
    batch_size, _, num_tokens, _ = q.shape
    if not is_integer(read_rows) or read_rows.dim() != 2 or read_rows.shape[0] != batch_size \
            or read_rows.shape[1] < 1 or read_rows.device != q.device:
        raise ValueError(f"read_rows must be an integer tensor [B, span] with B = {batch_size} on {q.device}, "
                         f"got {describe_placed(read_rows)}")
    expected = (batch_size, num_tokens, read_rows.shape[1])
    if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool or tuple(mask.shape) != expected \
            or mask.device != q.device:
        raise ValueError(f"mask must be a bool tensor {list(expected)} on {q.device}, got {describe_placed(mask)}")
