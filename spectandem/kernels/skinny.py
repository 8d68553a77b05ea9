"""A skinny GEMM for the target's projections when few rows go through them: y = x W^T (+ b) for
x [M, K] with M <= 16 (a decode step at batch 1: M = 1; a chain or tree verify at batch 1: M =
the nodes), W [N, K] as nn.Linear stores it.

Why. At M = 1 a projection reads its whole weight to produce N numbers: memory-bound, and the
time is the weight's bytes over the bandwidth the kernel reaches. cuBLAS's kernels for the 8B
shape reached about 75% of the H200's copy bandwidth on the q/k/v (50 MB) and o (34 MB)
projections, against about 100% on the MLP's (benchmarks/profile_decode.py). This kernel gives every
program a strip of BLOCK_N output columns over all of K, so the grid has N / BLOCK_N programs
(256 for N = 4096 at BLOCK_N = 16: every multiprocessor streams), with the x tile padded to 16
rows for the tensor-core dot. `SKINNY_SHAPES` is where benchmarks/gemv_timing.py measured it
faster than cuBLAS on the H200 (the Llama-3.1-8B shapes and those of its EAGLE-3 head), with the
tile it measured best; elsewhere `skinny_linear` calls F.linear.

Numerics: fp32 accumulation over K in BLOCK_K chunks, rounded once to the output dtype, as a
GEMM; another summation order than cuBLAS's, so results differ in the last bits (bf16 steps of
different M already take different cuBLAS kernels). The rows of x do not interact: a row's
result does not depend on M. CUDA only, bf16 and fp16 (CPU tensors too under Triton's
interpreter, which is how tests/spectandem/test_skinny_cpu.py checks it); `skinny_linear` takes
F.linear off CUDA, for fp32, and for M > 16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from spectandem.kernels import HAVE_TRITON, interpreted

MAX_ROWS = 16
# (N, K) of weights the kernel runs (measured faster than cuBLAS at M = 1 on the H200), with
# its tile: (BLOCK_N, BLOCK_K, num_warps, num_stages). Filled from gemv_timing.py's table.
# benchmarks/results/gemv-timing-h200.txt (M = 1, cuBLAS -> skinny; the best tile at M = 5 and 16
# was the same or within 2%): q/k/v 22.7 -> 22.5 us, o 19.0 -> 17.1, gate/up 69.3 -> 67.5, down
# 42.3 -> 40.2, LM head 257 -> 246 (do_bench with the L2 cleared; launch gaps included for both).
SKINNY_SHAPES: dict[tuple[int, int], tuple[int, int, int, int]] = {
    (6144, 4096): (64, 256, 4, 4),      # Llama-3.1-8B q/k/v packed
    (4096, 4096): (32, 512, 4, 3),      # o_proj
    (28672, 4096): (32, 128, 4, 3),     # gate/up packed
    (4096, 14336): (32, 512, 4, 4),     # down_proj
    (128256, 4096): (64, 128, 4, 4),    # LM head
    # The 8B-shaped EAGLE-3 head (benchmarks/results/gemv-timing-head-h200x2.txt, M = 1 / 5,
    # cuBLAS -> skinny): q/k/v packed over [embedding, hidden] 37.2 -> 36.9 us, fc 39.8 -> 37.3,
    # its LM head over the 32k draft vocabulary 78.2 -> 73.5 (its o, gate/up and down are the
    # target's shapes above).
    (6144, 8192): (64, 256, 4, 4),      # head q/k/v packed
    (4096, 12288): (32, 512, 4, 4),     # head fc (three target layers)
    (32000, 4096): (64, 128, 4, 3),     # head LM head (draft vocabulary)
}
DEFAULT_CONFIG = (16, 256, 4, 4)

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                       HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            x = tl.load(x_ptr + rm[:, None] * stride_xm + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K),
                        other=0.0)
            w = tl.load(w_ptr + rn[:, None] * stride_wn + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K),
                        other=0.0)
            acc += tl.dot(x, tl.trans(w))
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=(rm[:, None] < M) & (rn[None, :] < N))

    _INTERPRETED = interpreted(_skinny_kernel)


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """The kernel: x [..., K] with at most MAX_ROWS rows in all, weight [N, K] contiguous, both
    CUDA (or, under the interpreter, CPU) bf16/fp16 of one dtype -> [..., N]. config: (BLOCK_N,
    BLOCK_K, num_warps, num_stages)."""
    n, k = weight.shape
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if x.shape[-1] != k or not 1 <= m <= MAX_ROWS:
        raise ValueError(f"x must be [..., {k}] with 1 to {MAX_ROWS} rows, got {tuple(x.shape)}")
    on_device = (x.is_cuda and weight.is_cuda) or (_INTERPRETED and x.device == weight.device)
    if x.dtype != weight.dtype or x.dtype not in (torch.bfloat16, torch.float16) or not on_device:
        raise ValueError(f"x and weight must be CUDA bf16 or fp16 of one dtype, got {x.dtype} on {x.device}, "
                         f"{weight.dtype} on {weight.device}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    block_n, block_k, warps, stages = config or SKINNY_SHAPES.get((n, k), DEFAULT_CONFIG)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    _skinny_kernel[(triton.cdiv(n, block_n),)](
        x2, weight, bias if bias is not None else weight, y, m, n, k, x2.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=block_k,
        num_warps=warps, num_stages=stages)
    return y.view(*lead, n)


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the kernel where it was measured faster: CUDA with Triton, bf16/fp16,
    at most MAX_ROWS rows, a weight shape in SKINNY_SHAPES."""
    if (HAVE_TRITON and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dtype == weight.dtype
            and tuple(weight.shape) in SKINNY_SHAPES and x.numel() <= MAX_ROWS * x.shape[-1]
            and weight.is_contiguous()):
        return skinny_linear_triton(x, weight, bias)
    return F.linear(x, weight, bias)
