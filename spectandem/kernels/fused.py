"""Fused kernels of the target's forward on the fast path: RMSNorm, the rotary embedding and the
gated MLP's SiLU product in one launch each, each meant to compute bit for bit what the torch code
of spectandem/modeling/layers.py computes on the same GPU. The fused ops (spectandem/modeling/ops.py
`FUSED_OPS`) run them.

Measured on the H200 (torch 2.11, tests/gpu/test_fused_kernels.py): rotary and silu_mul are bit
for bit in fp32 and bf16, and rmsnorm in bf16 (add_rmsnorm and silu_mul_packed:
tests/gpu/test_packed_model.py). In fp32, rmsnorm is within ~1e-6 of ATen's: its
mean there sums in an order the kernel below does not replay. Exactness does not rest on it: on
the fast path these kernels are the only implementation, for plain decoding and speculation alike.

    rmsnorm          RMSNorm.forward: 8 torch kernels in bf16 (cast, square, mean, + eps, rsqrt,
                     scale, cast, times the weight), 6 in fp32; x's rows may be strided (q and k
                     viewed from the packed q/k/v projection, for qk-norm)
    add_rmsnorm      ModelOps.add_norm: the residual add before a norm, and the norm: 9 in bf16
    rotary           apply_rotary on q and k: 5 torch kernels per tensor (two products, neg, cat, sum);
                     spectandem/kernels/rotary.py, under this module's rules, with the paged K/V write
    silu_mul         ModelOps.mlp's F.silu(gate) * up: 2 torch kernels
    silu_mul_packed  the same on the packed gate/up projection [..., 2I], read in place

Bit for bit, step by step. Each kernel computes in fp32 and rounds to the tensor's dtype exactly
where torch's kernels do (after every op in bf16: `x * cos` is rounded before the sum). Launches
pass `enable_fp_fusion=False`, so no mul + add becomes one FMA (torch's separate kernels round
between them), and `enable_reflect_ftz=False` (nvcc's default: libdevice keeps subnormals). The
transcendentals are the libdevice calls nvcc compiles torch's to: `__nv_expf` (silu's exp) and
`__nv_rsqrtf` (torch.rsqrt); the division rounds to nearest (`tl.div_rn`, nvcc's -prec-div=true).
Triton's unary minus is `0 - x` (+0 stays +0), so negations are written `x * -1.0`, as torch's.

RMSNorm's mean. `x32.pow(2).mean(-1)` is ATen's reduction (cuda/Reduce.cuh as of recent torch;
tests/gpu/test_fused_kernels.py pins it on the installed one) over contiguous rows of H fp32
squares. Its summation order depends on H and on the number of rows M:

    vectorized  H > 128: `lanes` threads share a row; thread w reads the 4-float vectors w,
                w + lanes, w + 2 lanes, ... into four accumulators, one per position in the vector
    otherwise   thread w reads the elements w, w + lanes, ...; its s-th goes to accumulator s % 4
    then        each thread adds ((a0 + a1) + a2) + a3; the threads are folded in halves (lane w
                += lane w + half) down to 32, then a warp shuffle tree pairs neighbours (0, 1),
                (2, 3), ... until one value is left; mean = sum * float(M) / float(M * H)

with `lanes` from setReduceConfig (`reduction_layout`). Example: H = 4096: M = 1 -> 512 lanes of
2 vectors each; M = 4 -> 128 lanes of 8; M >= 16 -> 32 lanes of 32. The kernel replays that order
(so its compiled variant depends on M, as ATen's order does). Layouts it does not replay (H > 128
not a multiple of 4; rows long enough that ATen splits them across warps, values per thread >=
min(16 * rows per block, 256): H > 7680) run the torch code, for every M alike.

add_rmsnorm's sum is torch's add (fp32, rounded to the dtype); its norm is rmsnorm's kernel on
that sum, which the program computes twice (for the mean, then for the output and the stored sum)
rather than reading back what other threads stored.

Every public function has the three forms of spectandem.kernels: `<name>_triton` (the kernel
behind a validating wrapper), `<name>_ref` (the torch code of layers.py, any device) and `<name>`
(the kernel for CUDA tensors it reproduces when Triton is installed, the reference otherwise).
Under Triton's interpreter (the CPU tests) exp and rsqrt are numpy's: bit-for-bit claims against
torch hold on the GPU only.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from spectandem.checks import describe_placed
from spectandem.kernels import HAVE_TRITON

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# ATen's reduce launch (cuda/Reduce.cuh) for a float32 mean.
_MAX_REDUCE_THREADS = 512  # mnt_wrapper<float>::MAX_NUM_THREADS
_WARP = 32
_VEC = 4                   # input_vec_size = vt0: floats per vector load, accumulators per thread
# Torch's rounding steps, not Triton's defaults (module docstring).
_EXACT = dict(enable_fp_fusion=False, enable_reflect_ftz=False)
_SILU_BLOCK = 1024
_NUM_WARPS = 4

if HAVE_TRITON:
    import triton

    from spectandem.kernels.fused_triton import _INTERPRETED, _rmsnorm_kernel, _silu_mul_kernel, _silu_mul_packed_kernel


# ----------------------------------------------------------------------------------------------
# RMSNorm


@functools.lru_cache(maxsize=1024)
def reduction_layout(rows: int, hidden: int) -> tuple[int, bool] | None:
    """ATen's split of a float32 mean over contiguous rows [rows, hidden] (setReduceConfig):
    (lanes per row, vectorized), or None where the kernel does not replay its order (module
    docstring). Examples: (1, 4096) -> (512, True); (16, 4096) -> (32, True); (64, 128) -> (32, False)."""
    vectorized = hidden > 128
    if vectorized and hidden % _VEC:
        return None  # ATen reduces an unaligned head or a tail of the row separately
    dim0 = hidden // _VEC if vectorized else hidden
    dim0_pow2 = _last_pow2(dim0) if dim0 < _MAX_REDUCE_THREADS else _MAX_REDUCE_THREADS
    dim1_pow2 = _last_pow2(rows) if rows < _MAX_REDUCE_THREADS else _MAX_REDUCE_THREADS
    lanes = min(dim0_pow2, _WARP)
    height = min(dim1_pow2, _MAX_REDUCE_THREADS // lanes)  # rows per thread block
    lanes = min(dim0_pow2, _MAX_REDUCE_THREADS // height)
    if -(-hidden // lanes) >= min(16 * height, 256):
        return None  # split across warps (and maybe thread blocks): another order
    return lanes, vectorized


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H] in promote(x, weight): RMSNorm.forward, one launch where
    the kernel reproduces it (CUDA, Triton, x's rows addressable (`_row_layout`), a replayed
    layout), the torch code otherwise."""
    if HAVE_TRITON and x.is_cuda and _rmsnorm_replays(x, weight):
        return rmsnorm_triton(x, weight, eps)
    return rmsnorm_ref(x, weight, eps)


def rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not HAVE_TRITON:
        raise RuntimeError("rmsnorm_triton needs the triton package")
    _check_rmsnorm(x, weight)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_rmsnorm(x, None, None, weight, eps, out, "rmsnorm_triton")
    return out


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward's torch code: fp32 statistics, the row rounded to x's dtype, times the weight."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rmsnorm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """x, delta [..., H] (the residual stream, a layer's output), weight [H] -> (x + delta,
    rmsnorm(x + delta)): one launch where the kernel reproduces both (CUDA, Triton, x and delta
    contiguous of one dtype, a layout rmsnorm replays), the torch code otherwise."""
    if HAVE_TRITON and x.is_cuda and _add_rmsnorm_replays(x, delta, weight):
        return add_rmsnorm_triton(x, delta, weight, eps)
    return add_rmsnorm_ref(x, delta, weight, eps)


def add_rmsnorm_triton(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    if not HAVE_TRITON:
        raise RuntimeError("add_rmsnorm_triton needs the triton package")
    _check_rmsnorm(x, weight)
    if not isinstance(delta, torch.Tensor) or delta.shape != x.shape or delta.dtype != x.dtype \
            or delta.device != x.device:
        raise ValueError(f"delta must be a tensor like x ({describe_placed(x)}), got {describe_placed(delta)}")
    if not (x.is_contiguous() and delta.is_contiguous()):
        raise ValueError(f"x and delta must be contiguous, got strides {x.stride()} and {delta.stride()}")
    total = torch.empty_like(x)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    _launch_rmsnorm(x, delta, total, weight, eps, out, "add_rmsnorm_triton")
    return total, out


def add_rmsnorm_ref(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                    eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """ModelOps.add_norm's torch code: the add, then RMSNorm.forward's."""
    total = x + delta
    return total, rmsnorm_ref(total, weight, eps)


def _launch_rmsnorm(x, delta, total, weight, eps, out, name: str) -> None:
    """One program per row of x (plus delta into `total`, where given) normalised into `out`."""
    h = x.shape[-1]
    rows = x.numel() // h if h else 0
    layout, addressing = reduction_layout(rows, h), _row_layout(x)
    if layout is None or addressing is None:
        raise ValueError(f"{name} replays torch's mean over rows whose layout it models; got {rows} rows of {h} "
                         f"(H > 128 must be a multiple of 4 and at most 16 * rows per block values per thread, "
                         f"see reduction_layout) at strides {x.stride()} (rows of H contiguous, see _row_layout)")
    if rows == 0:
        return
    lanes, vectorized = layout
    halvings = max(lanes // _WARP, 1).bit_length() - 1
    add = delta is not None
    _rmsnorm_kernel[(rows,)](
        x, delta if add else x, total if add else out, weight.contiguous(), out, float(eps), _mean_factor(rows, h),
        *addressing,
        H=h, LANES=lanes, LANE_STRIDE=_VEC if vectorized else 1, ACC_STRIDE=1 if vectorized else lanes,
        HALVINGS=halvings, PAIRINGS=(lanes >> halvings).bit_length() - 1,
        BLOCK_H=min(4096, triton.next_power_of_2(h)), ADD=add, INTERPRETED=_INTERPRETED,
        num_warps=rmsnorm_warps(lanes), **_EXACT,
    )


def rmsnorm_warps(lanes: int) -> int:
    """Warps of one rmsnorm program (one row): any number gives the same bits (the kernel's sums
    follow LANES, not the threads). benchmarks/rmsnorm_timing.py on the H200, H 4096 bf16, us per
    launch at 1 / 2 / 4 / 8 warps: 1 row (512 lanes) 2.8 / 3.0 / 3.2 / 2.4; 16 rows (32 lanes)
    3.1 / 4.5 / 6.1 / 6.2; 64 rows 4.8 / 8.5 / 12.8 / 13.3. One warp where a row has one warp's
    lanes (more would hold copies of them), eight for the widest rows."""
    if lanes <= _WARP:
        return 1
    return 8 if lanes >= 128 else _NUM_WARPS


def _row_layout(x: torch.Tensor) -> tuple[int, int, int] | None:
    """(inner, stride_outer, stride_inner): row r of x's rows of H (x [..., H] read as [M, H])
    starts at element (r // inner) * stride_outer + (r % inner) * stride_inner; None where x's
    rows do not lie so (H not contiguous, or leading dimensions that do not merge). Example: q
    [B, T, nh, hd] viewed from a packed projection [B, T, N] -> (nh, N, hd); contiguous x ->
    (1, H, 0)."""
    h = x.shape[-1]
    if x.is_contiguous():
        return 1, h, 0
    if x.dim() < 2 or (h > 1 and x.stride(-1) != 1):
        return None
    stride_outer, merged = 0, None  # the leading dimensions (all but the last two) as one
    for size, stride in zip(reversed(x.shape[:-2]), reversed(x.stride()[:-2])):
        if size == 1:
            continue
        if merged is None:
            stride_outer = stride
        elif stride != merged:
            return None
        merged = stride * size
    return x.shape[-2], stride_outer, x.stride(-2)


def _rmsnorm_replays(x: torch.Tensor, weight: torch.Tensor) -> bool:
    if x.dim() < 1 or x.dtype not in _FLOAT_DTYPES or weight.dtype not in _FLOAT_DTYPES or _row_layout(x) is None:
        return False
    h = x.shape[-1]
    # One row is the most restrictive count (H <= 7680 replays at every count, H > 8160 at none), so
    # requiring it decides by H alone: a token's norm takes one implementation, decoded or verified.
    return (tuple(weight.shape) == (h,) and weight.device == x.device and h > 0
            and reduction_layout(1, h) is not None and reduction_layout(x.numel() // h, h) is not None)


def _add_rmsnorm_replays(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor) -> bool:
    return (isinstance(delta, torch.Tensor) and delta.shape == x.shape and delta.dtype == x.dtype
            and delta.device == x.device and x.is_contiguous() and delta.is_contiguous()
            and _rmsnorm_replays(x, weight))


@functools.lru_cache(maxsize=256)
def _mean_factor(rows: int, hidden: int) -> float:
    """ATen's mean factor: float(rows) / float(rows * hidden), both rounded to fp32 first (exact in fp32)."""
    ratio = torch.tensor(float(rows), dtype=torch.float32) / torch.tensor(float(rows * hidden), dtype=torch.float32)
    return float(ratio)


def _last_pow2(n: int) -> int:
    return 1 << (max(n, 1).bit_length() - 1)


def _check_rmsnorm(x, weight) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor [..., H], got {describe_placed(x)}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[-1],) \
            or weight.dtype not in _FLOAT_DTYPES or weight.device != x.device:
        raise ValueError(f"weight must be a float tensor [{x.shape[-1]}] on {x.device}, got {describe_placed(weight)}")


# ----------------------------------------------------------------------------------------------
# SiLU-gated product


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [..., I] -> F.silu(gate) * up: one launch on CUDA with Triton for contiguous tensors
    of one dtype, the torch code otherwise."""
    if HAVE_TRITON and gate.is_cuda and _silu_mul_replays(gate, up):
        return silu_mul_triton(gate, up)
    return silu_mul_ref(gate, up)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    if not HAVE_TRITON:
        raise RuntimeError("silu_mul_triton needs the triton package")
    _check_silu_mul(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _silu_mul_kernel[(triton.cdiv(n, _SILU_BLOCK),)](gate, up, out, n, BLOCK=_SILU_BLOCK,
                                                          INTERPRETED=_INTERPRETED, num_warps=_NUM_WARPS, **_EXACT)
    return out


def silu_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """GatedMLP's torch code."""
    return F.silu(gate) * up


def silu_mul_packed(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] (GatedMLP's packed projection: gate, then up) -> F.silu(gate) * up
    [..., I], contiguous: one launch reading both halves in place on CUDA with Triton for a
    contiguous gate_up, the torch code otherwise."""
    if HAVE_TRITON and gate_up.is_cuda and _silu_mul_packed_replays(gate_up):
        return silu_mul_packed_triton(gate_up)
    return silu_mul_packed_ref(gate_up)


def silu_mul_packed_triton(gate_up: torch.Tensor) -> torch.Tensor:
    if not HAVE_TRITON:
        raise RuntimeError("silu_mul_packed_triton needs the triton package")
    if not _silu_mul_packed_replays(gate_up):
        raise ValueError(f"gate_up must be a contiguous float16/bfloat16/float32 tensor [..., 2I], got "
                         f"{describe_placed(gate_up)}" + (f" strides {gate_up.stride()}"
                                                    if isinstance(gate_up, torch.Tensor) else ""))
    inter = gate_up.shape[-1] // 2
    out = torch.empty(*gate_up.shape[:-1], inter, dtype=gate_up.dtype, device=gate_up.device)
    rows = gate_up.numel() // gate_up.shape[-1] if inter else 0
    if rows:
        _silu_mul_packed_kernel[(rows, triton.cdiv(inter, _SILU_BLOCK))](
            gate_up, out, inter, BLOCK=_SILU_BLOCK, INTERPRETED=_INTERPRETED, num_warps=_NUM_WARPS, **_EXACT)
    return out


def silu_mul_packed_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """GatedMLP's torch code on the two halves (views; the product is contiguous)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _silu_mul_replays(gate, up) -> bool:
    return (gate.shape == up.shape and gate.dtype == up.dtype and gate.dtype in _FLOAT_DTYPES
            and gate.is_contiguous() and up.is_contiguous())


def _silu_mul_packed_replays(gate_up) -> bool:
    return (isinstance(gate_up, torch.Tensor) and gate_up.dim() >= 1 and gate_up.shape[-1] % 2 == 0
            and gate_up.dtype in _FLOAT_DTYPES and gate_up.is_contiguous())


def _check_silu_mul(gate, up) -> None:
    if not isinstance(gate, torch.Tensor) or gate.dtype not in _FLOAT_DTYPES or not gate.is_contiguous():
        raise ValueError(f"gate must be a contiguous float16/bfloat16/float32 tensor, got {describe_placed(gate)}")
    if not isinstance(up, torch.Tensor) or up.shape != gate.shape or up.dtype != gate.dtype \
            or up.device != gate.device or not up.is_contiguous():
        raise ValueError(f"up must be a contiguous tensor like gate ({describe_placed(gate)}), got {describe_placed(up)}")
