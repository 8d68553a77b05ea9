"""The skinny GEMM's kernel (spectandem/kernels/skinny.py) through Triton's interpreter
(tests/interpreter.py), at small shapes with small tiles: close to the fp32 product as F.linear
in the same dtype is; K and N that the tiles do not divide (the masked edges); a row's result
independent of the other rows, bit for bit; bias and leading dimensions; bad inputs refused.
tests/gpu/test_skinny.py covers the 8B shapes and their tiles on the GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.interpreter import interpreter

DTYPES = [torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp16", "bf16"]
TILE = (16, 32, 4, 1)   # BLOCK_N, BLOCK_K, warps, stages
# The interpreter casts fp32 to bf16 by truncation (up to one ulp off, where rounding is half an
# ulp off at most): twice the GPU test's allowance there.
SLACK = {torch.float16: 1.5, torch.bfloat16: 3.0}


def _inputs(n: int, k: int, rows: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 0.1).to(dtype)
    x = torch.randn(rows, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x, w, b


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,k", [(48, 96), (40, 100), (7, 33)], ids=["tiled", "edges", "small"])
def test_interpreted_close_to_fp32_as_linear_is(dtype, n, k):
    from spectandem.kernels.skinny import MAX_ROWS, skinny_linear_triton

    x, w, _ = _inputs(n, k, MAX_ROWS, dtype, seed=n + k)
    ref = x.float() @ w.float().t()
    full = skinny_linear_triton(x, w, None, TILE)
    for m in (1, 3, MAX_ROWS):
        got = skinny_linear_triton(x[:m], w, None, TILE)
        assert got.shape == (m, n) and got.dtype == dtype
        err = (got.float() - ref[:m]).abs().max().item()
        err_linear = (F.linear(x[:m], w).float() - ref[:m]).abs().max().item()
        assert err <= SLACK[dtype] * err_linear + 1e-3, (m, err, err_linear)
        assert torch.equal(got, full[:m]), "a row's result depends on the other rows"


@interpreter
def test_interpreted_bias_and_leading_dims():
    from spectandem.kernels.skinny import skinny_linear_triton

    x, w, b = _inputs(40, 100, 6, torch.float16, seed=1)
    got = skinny_linear_triton(x.view(2, 3, 100), w, b, TILE)
    assert got.shape == (2, 3, 40)
    ref = x.float() @ w.float().t() + b.float()
    err_linear = (F.linear(x, w, b).float() - ref).abs().max().item()
    assert (got.view(6, 40).float() - ref).abs().max().item() <= 1.5 * err_linear + 1e-3
    # Control: without the bias the same check fails.
    assert (skinny_linear_triton(x, w, None, TILE).float() - ref).abs().max().item() > 10 * err_linear + 1e-2


@interpreter
def test_interpreted_bad_inputs_are_refused():
    from spectandem.kernels.skinny import skinny_linear_triton

    w = torch.zeros(40, 100, dtype=torch.float16)
    with pytest.raises(ValueError, match="1 to 16 rows, got \\(17, 100\\)"):
        skinny_linear_triton(torch.zeros(17, 100, dtype=torch.float16), w)
    with pytest.raises(ValueError, match="bf16 or fp16 of one dtype"):
        skinny_linear_triton(torch.zeros(1, 100), w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        skinny_linear_triton(torch.zeros(1, 40, dtype=torch.float16), w.t())


def test_off_cuda_skinny_linear_is_linear():
    """Always (no triton needed): on CPU tensors `skinny_linear` is F.linear, bit for bit."""
    from spectandem.kernels.skinny import skinny_linear

    x, w, b = _inputs(4096, 4096, 1, torch.bfloat16, seed=2)
    assert torch.equal(skinny_linear(x, w, b), F.linear(x, w, b))
