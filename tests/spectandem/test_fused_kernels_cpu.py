"""The fast path's fused kernels (spectandem/kernels/fused.py) on the CPU.

Always run: off CUDA the hooks are the torch code. The demo target under the fused ops
(`with_ops(FUSED_OPS)`) prefills and verifies through NativeRunner bit for bit as without;
RMSNorm and GatedMLP under the fused ops equal the torch ops; the `_ref` forms are the layers.py
code; `with_ops` keeps the weights and leaves the model it came from as it was, and the torch ops
are the default; `reduction_layout` at the 8B shapes; the wrappers' validation (where Triton is
installed).

Through Triton's interpreter: the kernel checks of tests/gpu/test_fused_kernels.py at small sizes.
fp32: rmsnorm and rotary bit for bit (rmsnorm against `rmsnorm_cuda_order`, the torch replay of
ATen's CUDA summation order: the CPU module sums in another), silu_mul within a few ulps (numpy's
exp is not libdevice's). bf16 within a few ulps of the largest value: the interpreter casts fp32 to
bf16 by truncation, not round-to-nearest-even. They run where Triton is installed and the
interpreter is on (tests/interpreter.py; CI installs triton). The interpreter runs each program in
numpy, saying nothing about GPU numerics (the bit-for-bit claims against torch included) or speed:
the GPU machine covers those.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from spectandem.demo import demo_paths
from spectandem.kernels.fused import (
    reduction_layout,
    rmsnorm_ref,
    rmsnorm_triton,
    silu_mul_ref,
    silu_mul_triton,
)
from spectandem.kernels.rotary import rotary_ref, rotary_triton
from spectandem.modeling.layers import GatedMLP, RMSNorm, apply_rotary
from spectandem.modeling.llama import load_llama
from spectandem.modeling.ops import FUSED_OPS, TORCH_OPS
from tests.gpu.test_fused_kernels import check_rmsnorm, check_rotary, check_silu_mul
from tests.interpreter import interpreter, needs_triton
from verifier.runner import NativeRunner


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


# ----------------------------------------------------------------------------------------------
# Through the interpreter

# Every layout the kernel replays at interpreter-friendly sizes: 64 lanes (the demo), 512 (four
# halvings to a warp), 128, unvectorized 32 lanes (qk-norm) and 64 over 96 columns (partial steps).
RMSNORM_SHAPES = [(1, 1, 256), (3, 5, 256), (1, 2048), (5, 512), (2, 3, 4, 128), (7, 96), (2, 3072)]


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", RMSNORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_rmsnorm(dtype, shape):
    check_rmsnorm("cpu", dtype, shape, seed=sum(shape), against="cuda_order", exact=dtype == torch.float32)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t,heads,kv_heads,head_dim", [(1, 1, 4, 2, 64), (3, 5, 4, 2, 64), (2, 3, 8, 1, 128),
                                                         (1, 4, 1, 1, 32), (2, 1, 6, 3, 16)])
def test_interpreted_rotary(dtype, b, t, heads, kv_heads, head_dim):
    check_rotary("cpu", dtype, b, t, heads, kv_heads, head_dim, seed=b + t, exact=dtype == torch.float32)


@interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100): inf, as on the GPU
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(3, 5, 512), (7, 1000), (13,)], ids=lambda s: "x".join(map(str, s)))
def test_interpreted_silu_mul(dtype, shape):
    check_silu_mul("cpu", dtype, shape, seed=sum(shape), exact=False)


# ----------------------------------------------------------------------------------------------
# Off CUDA the hooks are the torch code (always run)

AUX = (2, 4, 5)


@torch.no_grad()
def test_fused_demo_target_on_cpu_is_the_torch_code():
    fused_model = load_llama(demo_paths("none")[0], torch.float32, "cpu")
    torch_model = load_llama(demo_paths("none")[0], torch.float32, "cpu")
    fused_model = fused_model.with_ops(FUSED_OPS)
    fused, plain = (NativeRunner(m, AUX, max_slots=4, max_len=128) for m in (fused_model, torch_model))
    prompts = [[5, 9, 200, 31, 7], [11, 3]]
    for r in (fused, plain):
        r.prefill([1, 0], prompts)
    tokens = torch.tensor([[4, 8, 15], [16, 23, -1]])
    parents = torch.tensor([[-1, 0, 0], [-1, 0, -1]])
    valid = tokens >= 0
    (lf, ff), (lp, fp) = (r.verify([1, 0], [5, 2], tokens, parents, valid) for r in (fused, plain))
    assert torch.equal(lf, lp) and torch.equal(ff, fp)


@torch.no_grad()
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_fused_modules_on_cpu_equal_unfused(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 64, generator=gen).to(dtype)
    norm = RMSNorm(64, 1e-6).to(dtype)
    norm.weight.copy_(torch.randn(64, generator=gen))
    mlp = GatedMLP(64, 96).to(dtype)
    expected = TORCH_OPS.norm(norm, x), TORCH_OPS.mlp(mlp, x)
    mlp.pack()
    assert torch.equal(FUSED_OPS.norm(norm, x), expected[0]) and torch.equal(FUSED_OPS.mlp(mlp, x), expected[1])


def test_references_are_the_layers_code():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 7, 96, generator=gen) * 3
    norm = RMSNorm(96, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=gen))
        assert torch.equal(rmsnorm_ref(x, norm.weight, 1e-5), norm(x))
    q = torch.randn(2, 3, 4 * 16, generator=gen).view(2, 3, 4, 16).transpose(1, 2)
    k = torch.randn(2, 3, 2 * 16, generator=gen).view(2, 3, 2, 16).transpose(1, 2)
    cos, sin = torch.randn(2, 3, 16, generator=gen), torch.randn(2, 3, 16, generator=gen)
    rq, rk = rotary_ref(q, k, cos, sin)
    assert torch.equal(rq, apply_rotary(q, cos, sin)) and torch.equal(rk, apply_rotary(k, cos, sin))
    gate, up = torch.randn(5, 32, generator=gen), torch.randn(5, 32, generator=gen)
    assert torch.equal(silu_mul_ref(gate, up), F.silu(gate) * up)


def test_with_ops_gives_the_same_weights_under_other_kernels():
    model = load_llama(demo_paths("none")[0], torch.float32, "cpu")
    assert model.ops is TORCH_OPS, "the fused kernels are opt-in"
    fused = model.with_ops(FUSED_OPS)
    assert fused.ops is FUSED_OPS and model.ops is TORCH_OPS, "the model it came from is unchanged"
    assert all(a is b for a, b in zip(fused.parameters(), model.parameters())), "the same weights, not copies"
    assert list(fused.state_dict()) == list(model.state_dict())
    assert fused.with_ops(TORCH_OPS).ops is TORCH_OPS
    assert NativeRunner(model, None, max_slots=1, max_len=64).model.ops is TORCH_OPS


def test_reduction_layout_at_8b_shapes():
    """ATen's lanes per row for H = 4096 as the rows grow; None where it splits rows across warps."""
    assert [reduction_layout(m, 4096) for m in (1, 2, 4, 5, 8, 16, 64, 4096)] == [
        (512, True), (256, True), (128, True), (128, True), (64, True), (32, True), (32, True), (32, True)]
    assert reduction_layout(1, 256) == (64, True)        # the demo target
    assert reduction_layout(640, 128) == (32, False)     # qk-norm over 128-wide heads: unvectorized
    assert reduction_layout(1, 8192) is None and reduction_layout(16, 8192) is None
    assert reduction_layout(3, 4098) is None             # a vector tail


@needs_triton
def test_wrappers_validate():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm_triton(x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="replays"):
        rmsnorm_triton(x.t(), torch.ones(3), 1e-5)
    q, k = torch.randn(1, 4, 2, 16), torch.randn(1, 2, 2, 16)
    cos = torch.randn(1, 2, 16)
    with pytest.raises(ValueError, match="dtype"):
        rotary_triton(q, k, cos.double(), cos)
    with pytest.raises(ValueError, match="cos"):
        rotary_triton(q, k, cos[:, :1], cos)
    with pytest.raises(ValueError, match="contiguous"):
        silu_mul_triton(x.t(), x.t())
