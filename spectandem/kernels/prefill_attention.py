"""Causal attention of prompts packed back to back, each over its own tokens: the attention of a
packed prefill (spectandem/kv_cache.py `PackedPrefillBatch`), where every prompt starts at cache
length 0, so its keys and values are the forward's own `k, v` and need no pool, block table or
mask.

    q [nh, T, hd], k, v [nkv, T, hd]: the T tokens of all prompts in one row, prompt p holding
    tokens [starts[p], starts[p + 1]); token t of prompt p attends to tokens starts[p] .. t.
    -> [T, nh * hd]
    Example: starts [0, 2, 5] -> tokens 0, 1 form prompt 0, tokens 2, 3, 4 prompt 1; token 3 sees
    tokens 2 and 3, token 1 sees 0 and 1.

The kernel is a flash-attention forward over variable lengths: one program per (query block of a
prompt, query head) keeps the block's online softmax (base 2, fp32) over the key blocks of its
prompt up to the block's last query, the last one masked causally. Nothing is padded: a prompt of
L tokens takes cdiv(L, BLOCK_M) programs per head and reads about L * L / 2 key entries per head.
The grouped query heads of one kv head read the same keys, which stay in the L2 cache.

Its arithmetic is not the paged tree attention's (another tiling and summation order): a prompt
prefilled here and through a prefill graph (the tree kernel over a chain) agree within the dtype's
tolerance, not bit for bit, as any two prefill paths whose GEMMs take different shapes do. The
verify and decode steps after it read the K/V it wrote, which no attention changes.

Forms (spectandem/kernels/__init__.py): `packed_causal_attention_triton`,
`packed_causal_attention_ref` (masked_attention per prompt) and `packed_causal_attention`.
"""

from __future__ import annotations

import math

import torch

from spectandem.kernels import HAVE_TRITON
from spectandem.modeling.layers import masked_attention

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _packed_causal_kernel(
        q_ptr, k_ptr, v_ptr,  # q [nh, T, hd]; k, v [nkv, T, hd]
        out_ptr,  # [T, nh * hd]
        starts_ptr,  # [P + 1] int32: prompt p holds tokens [starts[p], starts[p + 1])
        qk_scale,  # scale * log2(e): the softmax runs in base 2
        stride_qh, stride_qt,
        stride_kh, stride_kt,
        stride_vh, stride_vt,
        stride_ot,
        GROUP: tl.constexpr,  # query heads per kv head
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        block = tl.program_id(0)
        prompt = tl.program_id(1)
        head = tl.program_id(2)
        start = tl.load(starts_ptr + prompt)
        length = tl.load(starts_ptr + prompt + 1) - start
        # The grid covers the longest prompt; a shorter one's surplus blocks have nothing to do.
        if block * BLOCK_M < length:
            kv_head = head // GROUP
            m = block * BLOCK_M + tl.arange(0, BLOCK_M)  # query tokens, within the prompt
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            m_ok = m < length
            q = tl.load(q_ptr + head * stride_qh + (start + m)[:, None].to(tl.int64) * stride_qt + d[None, :],
                        mask=m_ok[:, None] & d_ok[None, :], other=0.0)
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
            acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
            # Keys up to the block's last query: the causal part of the prompt this block sees.
            hi = tl.minimum(length, (block + 1) * BLOCK_M)
            for n0 in range(0, hi, BLOCK_N):
                n = n0 + tl.arange(0, BLOCK_N)
                n_ok = n < hi
                rows = (start + n)[:, None].to(tl.int64)
                kv_mask = n_ok[:, None] & d_ok[None, :]
                k = tl.load(k_ptr + kv_head * stride_kh + rows * stride_kt + d[None, :], mask=kv_mask, other=0.0)
                v = tl.load(v_ptr + kv_head * stride_vh + rows * stride_vt + d[None, :], mask=kv_mask, other=0.0)
                s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
                s = tl.where(n_ok[None, :] & (n[None, :] <= m[:, None]), s, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, 1))
                # Rows past the prompt see nothing: subtract 0 there instead of -inf (no NaN).
                m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_safe)
                p = tl.exp2(s - m_safe[:, None])
                l_i = l_i * alpha + tl.sum(p, 1)
                acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
                m_i = m_new
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(out_ptr + (start + m)[:, None].to(tl.int64) * stride_ot + head * HEAD_DIM + d[None, :],
                     out.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def _blocks(dtype: torch.dtype) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): 64 x 64 for 16-bit inputs; 32 x 32 for fp32, whose tiles take twice the
    registers."""
    return (32, 32) if dtype == torch.float32 else (64, 64)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor) -> None:
    if q.dim() != 3 or k.dim() != 3 or v.shape != k.shape:
        raise ValueError(f"q must be [nh, T, hd] and k, v [nkv, T, hd] of one shape; got q {list(q.shape)}, "
                         f"k {list(k.shape)}, v {list(v.shape)}")
    if q.shape[1:] != k.shape[1:] or q.shape[0] % k.shape[0]:
        raise ValueError(f"q {list(q.shape)} and k {list(k.shape)} must share T and hd, and nkv must divide nh")
    if q.dtype != k.dtype or k.dtype != v.dtype or q.device != k.device or k.device != v.device:
        raise ValueError(f"q, k and v must share a dtype and a device; got {q.dtype}/{k.dtype}/{v.dtype} on "
                         f"{q.device}/{k.device}/{v.device}")
    if starts.dim() != 1 or starts.numel() < 2 or starts.device != q.device:
        raise ValueError(f"starts must be [P + 1] (P >= 1 prompts) on {q.device}; got {list(starts.shape)} on "
                         f"{starts.device}")


def packed_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                            max_len: int, scale: float) -> torch.Tensor:
    """The kernel for CUDA tensors when Triton is installed, the torch reference otherwise.
    `starts [P + 1]` int32 on q's device, `max_len` the longest prompt's tokens."""
    if q.is_cuda and HAVE_TRITON:
        return packed_causal_attention_triton(q, k, v, starts, max_len, scale)
    return packed_causal_attention_ref(q, k, v, starts, max_len, scale)


def packed_causal_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                                   max_len: int, scale: float) -> torch.Tensor:
    """Validates the inputs and launches the kernel (module docstring)."""
    if not HAVE_TRITON:
        raise RuntimeError("packed_causal_attention_triton needs the triton package")
    _check(q, k, v, starts)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {t.stride()}")
    num_heads, num_tokens, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0 or max_len == 0:
        return out
    block_m, block_n = _blocks(q.dtype)
    grid = (triton.cdiv(max_len, block_m), starts.numel() - 1, num_heads)
    _packed_causal_kernel[grid](
        q, k, v, out, starts.to(torch.int32), scale * math.log2(math.e),
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0),
        GROUP=num_heads // k.shape[0], HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=4,
    )
    return out


def packed_causal_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: torch.Tensor,
                                max_len: int, scale: float) -> torch.Tensor:
    """The same in torch: masked_attention of each prompt with a causal mask, as an eager prefill
    of that prompt alone computes it."""
    _check(q, k, v, starts)
    num_heads, num_tokens, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    bounds = starts.tolist()
    for s, e in zip(bounds[:-1], bounds[1:]):
        if e > s:
            causal = torch.ones(e - s, e - s, dtype=torch.bool, device=q.device).tril()[None]
            out[s:e] = masked_attention(q[None, :, s:e], k[None, :, s:e], v[None, :, s:e], causal, scale)[0]
    return out
