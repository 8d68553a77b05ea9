"""The rotary embedding and the paged K/V write of a verify step in one launch.

A verify step on the paged-tree path (spectandem/kv_cache.py PagedTreeBatch) rotates q and k,
then writes k and v into the layer's pools at the tokens' physical rows: two index_put kernels
per layer after the rotary one (on the H200 at batch 1: 2 x 32 launches of about 3 us, 0.19 ms a
step). `rotary_write` does the three in one: the rotary kernel of spectandem/kernels/fused.py
stores rotated k straight into its pool row and copies v beside it.

The values are those of the unfused code bit for bit: the same rotation arithmetic (fused.py's
docstring says how it replays torch's), and the pools receive what `pool[rows] = x.transpose(1,
2)` would store (tests/gpu/test_rotary_write.py, and the interpreter test on the CPU).

    rotary_write(q, k, v, cos, sin, k_pool, v_pool, rows) -> apply_rotary(q)
        k, v [B, nkv, T, hd] and pools [R, nkv, hd] of one dtype, rows [B, T] int64 in [0, R)
"""

from __future__ import annotations

import torch

from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.fused import _EXACT, _NUM_WARPS, _like_apply_rotary, _rotary_replays, rotary_ref

if HAVE_TRITON:
    import triton

    from spectandem.kernels.fused_triton import _rotary_kernel


def rotary_write(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 k_pool: torch.Tensor, v_pool: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """apply_rotary(q); writes apply_rotary(k) and v into the pools at `rows` (module docstring):
    one launch on CUDA with Triton where the layouts allow it, the torch code otherwise."""
    if HAVE_TRITON and q.is_cuda and _writes_in_place(q, k, v, cos, sin, k_pool, v_pool, rows):
        return rotary_write_triton(q, k, v, cos, sin, k_pool, v_pool, rows)
    return rotary_write_ref(q, k, v, cos, sin, k_pool, v_pool, rows)


def rotary_write_ref(q, k, v, cos, sin, k_pool, v_pool, rows) -> torch.Tensor:
    """The unfused code: rotary on q and k, then two index_puts."""
    q_out, k_out = rotary_ref(q, k, cos, sin)
    k_pool[rows] = k_out.transpose(1, 2).to(k_pool.dtype)
    v_pool[rows] = v.transpose(1, 2).to(v_pool.dtype)
    return q_out


def rotary_write_triton(q, k, v, cos, sin, k_pool, v_pool, rows) -> torch.Tensor:
    if not HAVE_TRITON:
        raise RuntimeError("rotary_write_triton needs the triton package")
    if not _writes_in_place(q, k, v, cos, sin, k_pool, v_pool, rows):
        raise ValueError(
            "rotary_write_triton needs q [B, nh, T, hd], k and v [B, nkv, T, hd] (hd even and contiguous), cos "
            "and sin [B, T, hd], contiguous pools [R, nkv, hd] and rows [B, T] int64, all of one dtype and "
            f"device; got q {_shape(q)}, k {_shape(k)}, v {_shape(v)}, cos {_shape(cos)}, k_pool {_shape(k_pool)}, "
            f"v_pool {_shape(v_pool)}, rows {_shape(rows)}")
    b, nh, t, hd = q.shape
    nkv = k.shape[1]
    q_out = _like_apply_rotary(q)
    if b * t == 0:
        return q_out
    half = hd // 2
    _rotary_kernel[(b * t,)](
        q, k, cos.contiguous(), sin.contiguous(), q_out, k_pool, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), 0, 0, 0,
        rows.contiguous(), v, v_pool, v.stride(0), v.stride(1), v.stride(2),
        NUM_Q=nh, NUM_K=nkv, BLOCK_Q=triton.next_power_of_2(nh), BLOCK_K=triton.next_power_of_2(nkv),
        HALF=half, BLOCK_HALF=triton.next_power_of_2(half), WRITE=True, num_warps=_NUM_WARPS, **_EXACT,
    )
    return q_out


def _writes_in_place(q, k, v, cos, sin, k_pool, v_pool, rows) -> bool:
    if not all(isinstance(x, torch.Tensor) for x in (q, k, v, cos, sin, k_pool, v_pool, rows)):
        return False
    if not _rotary_replays(q, k, cos, sin):
        return False
    b, nkv, t, hd = k.shape
    pool_shape = (k_pool.shape[0], nkv, hd)
    return (v.shape == k.shape and v.dtype == q.dtype and v.device == q.device and v.stride(3) == 1
            and tuple(k_pool.shape) == pool_shape and tuple(v_pool.shape) == pool_shape
            and k_pool.dtype == v_pool.dtype == q.dtype and k_pool.is_contiguous() and v_pool.is_contiguous()
            and k_pool.device == v_pool.device == q.device
            and tuple(rows.shape) == (b, t) and rows.dtype == torch.int64 and rows.device == q.device)


def _shape(x) -> str:
    return f"{tuple(x.shape)} {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
