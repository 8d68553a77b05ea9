"""The rotary embedding on the fast path, alone (`rotary`) and with the paged K/V write of a
verify step in the same launch (`rotary_write`). Both follow spectandem/kernels/fused.py's rules
for computing bit for bit what the torch code computes, and have its three forms (`_triton`,
`_ref`, plain).

    rotary(q, k, cos, sin) -> (apply_rotary(q), apply_rotary(k))
        q [B, nh, T, hd], k [B, nkv, T, hd], cos/sin [B, T, hd]; 5 torch kernels per tensor

A verify step on the paged-tree path (spectandem/kv_cache.py PagedTreeBatch) rotates q and k,
then writes k and v into the layer's pools at the tokens' physical rows: two index_put kernels
per layer after the rotary one (on the H200 at batch 1: 2 x 32 launches of about 3 us, 0.19 ms a
step). `rotary_write` does the three in one: the rotary kernel stores rotated k straight into its
pool row and copies v beside it.

The values are those of the unfused code bit for bit: the same rotation arithmetic (fused.py's
docstring says how it replays torch's), and the pools receive what `pool[rows] = x.transpose(1,
2)` would store (tests/gpu/test_rotary_write.py, and the interpreter test on the CPU).

    rotary_write(q, k, v, cos, sin, k_pool, v_pool, rows) -> apply_rotary(q)
        k, v [B, nkv, T, hd] and pools [R, nkv, hd] of one dtype, rows [B, T] int64 in [0, R)
"""

from __future__ import annotations

import torch

from spectandem.checks import describe_placed
from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.fused import _EXACT, _FLOAT_DTYPES, _NUM_WARPS
from spectandem.modeling.layers import apply_rotary

if HAVE_TRITON:
    import triton

    from spectandem.kernels.fused_triton import _rotary_kernel


def rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [B, nh, T, hd], k [B, nkv, T, hd], cos/sin [B, T, hd] -> (apply_rotary(q), apply_rotary(k)),
    values and strides: one launch on CUDA with Triton where all four share a dtype, the torch code
    otherwise."""
    if HAVE_TRITON and q.is_cuda and _rotary_replays(q, k, cos, sin):
        return rotary_triton(q, k, cos, sin)
    return rotary_ref(q, k, cos, sin)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if not HAVE_TRITON:
        raise RuntimeError("rotary_triton needs the triton package")
    _check_rotary(q, k, cos, sin)
    q_out, k_out = _like_apply_rotary(q), _like_apply_rotary(k)
    if q.shape[0] * q.shape[2] == 0:
        return q_out, k_out
    _launch(q, k, cos, sin, q_out, k_out, k_out.stride()[:3])
    return q_out, k_out


def rotary_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """apply_rotary (layers.py) on q and k."""
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)


def _like_apply_rotary(x: torch.Tensor) -> torch.Tensor:
    """Uninitialised, with the strides torch gives apply_rotary(x): contiguous when x is (size-1
    dims aside; e.g. T = 1), x's own otherwise (TensorIterator keeps the dense layout of `x * cos`).
    Downstream matmuls pick kernels by strides, so the values alone are not enough."""
    return torch.empty(x.shape, dtype=x.dtype, device=x.device) if x.is_contiguous() else torch.empty_like(x)


def _rotary_replays(q, k, cos, sin) -> bool:
    if q.dim() != 4 or k.dim() != 4 or q.dtype not in _FLOAT_DTYPES or q.shape[3] % 2:
        return False
    b, _, t, hd = q.shape
    return ((k.shape[0], k.shape[2], k.shape[3]) == (b, t, hd) and cos.shape == sin.shape == (b, t, hd)
            and all(x.dtype == q.dtype and x.device == q.device for x in (k, cos, sin))
            and q.stride(3) == 1 and k.stride(3) == 1)


def _check_rotary(q, k, cos, sin) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _FLOAT_DTYPES or q.shape[3] % 2:
        raise ValueError(f"q must be a float16/bfloat16/float32 tensor [B, nh, T, hd] with hd even, got {describe_placed(q)}")
    b, _, t, hd = q.shape
    if not isinstance(k, torch.Tensor) or k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (b, t, hd):
        raise ValueError(f"k must be a tensor [{b}, nkv, {t}, {hd}], got {describe_placed(k)}")
    for name, table in (("cos", cos), ("sin", sin)):
        if not isinstance(table, torch.Tensor) or tuple(table.shape) != (b, t, hd):
            raise ValueError(f"{name} must be a tensor [{b}, {t}, {hd}], got {describe_placed(table)}")
    for name, x in (("k", k), ("cos", cos), ("sin", sin)):
        if x.dtype != q.dtype or x.device != q.device:
            raise ValueError(f"{name} must have q's dtype {q.dtype} and device {q.device} (apply_rotary "
                             f"would promote), got {describe_placed(x)}")
    if q.stride(3) != 1 or k.stride(3) != 1:
        raise ValueError(f"q and k must be contiguous in hd, got strides {q.stride()} and {k.stride()}")


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
            f"device; got q {describe_placed(q)}, k {describe_placed(k)}, v {describe_placed(v)}, cos {describe_placed(cos)}, k_pool {describe_placed(k_pool)}, "
            f"v_pool {describe_placed(v_pool)}, rows {describe_placed(rows)}")
    q_out = _like_apply_rotary(q)
    if q.shape[0] * q.shape[2] == 0:
        return q_out
    _launch(q, k, cos, sin, q_out, k_pool, (0, 0, 0), rows.contiguous(), v, v_pool)
    return q_out


def _launch(q, k, cos, sin, q_out, k_out, k_out_strides, rows=None, v=None, v_pool=None) -> None:
    """One program per token: q rotated into q_out; k rotated into k_out (strides b, h, t), or,
    given `rows`, into k_out as the K pool at each token's row, v copied to v_pool's."""
    b, nh, t, hd = q.shape
    write = rows is not None
    _rotary_kernel[(b * t,)](
        q, k, cos.contiguous(), sin.contiguous(), q_out, k_out, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        q_out.stride(0), q_out.stride(1), q_out.stride(2), *k_out_strides,
        *((rows, v, v_pool, v.stride(0), v.stride(1), v.stride(2)) if write else (q, q, q, 0, 0, 0)),
        NUM_Q=nh, NUM_K=k.shape[1], BLOCK_Q=triton.next_power_of_2(nh), BLOCK_K=triton.next_power_of_2(k.shape[1]),
        HALF=hd // 2, BLOCK_HALF=triton.next_power_of_2(hd // 2), WRITE=write, num_warps=_NUM_WARPS, **_EXACT,
    )


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
