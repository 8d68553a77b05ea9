"""The fast path's fused kernels on the GPU (spectandem/kernels/fused.py; run with
`python -m pytest -m gpu tests/gpu/test_fused_kernels.py`).

- Kernel level, bit for bit (as bit patterns) against the torch code of spectandem/modeling/layers.py,
  fp32 and bf16: rmsnorm against the RMSNorm module at the 8B shapes (H 4096 over B * T rows, B in
  {1, 4}, T in {1, 5, 16}), the demo's (256), qk-norm's (128 over B * T * heads rows) and
  non-powers of two (3072, 5120, 96); rotary against apply_rotary on q and k laid out as Attention
  makes them (32/8 heads of 128, the demo's 4/2 of 64), values and strides; silu_mul against
  GatedMLP's product (intermediate 14336, odd sizes, exp's overflow and underflow).
  `rmsnorm_cuda_order` replays in torch the summation order the kernel assumes ATen's mean takes;
  when the kernel differs from the module, the message says whether that replay matches the module
  (so whether the model of ATen's order or the kernel is off).
- The demo target's verify through NativeRunner(triton_attention=True), eager and CUDA-graphed,
  over prefill + three verify/commit rounds: logits and features with the fused kernels equal those
  without, bit for bit, fp32 and bf16.
- End to end in fp32 with cuda_graphs and triton_attention (which turn the kernels on): plain
  decoding with the fused kernels equals plain decoding without on the 24 prompts, and greedy
  EAGLE-3 chain and tree speculation equal plain decoding.

The `check_*` helpers take a device; tests/spectandem/test_fused_kernels_cpu.py runs them through
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.fused import (
    _mean_factor,
    reduction_layout,
    rmsnorm,
    rmsnorm_triton,
    silu_mul_triton,
)
from spectandem.kernels.rotary import rotary_triton
from router.local import LocalSpeculator
from spectandem.modeling.layers import RMSNorm, RopeSpec, Rotary, apply_rotary
from spectandem.modeling.llama import load_llama
from spectandem.modeling.ops import FUSED_OPS, TORCH_OPS
from tests.e2e.conftest import PROMPT_TEXTS
from tests.gpu.test_triton_attention import _rounds
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

AUX = (2, 4, 5)
MAX_LEN = 512
EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
_BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


@pytest.fixture(scope="module", autouse=True)
def _cuda_and_triton():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    if not HAVE_TRITON:
        pytest.fail("tests/gpu/test_fused_kernels.py needs triton on the GPU machine")


def assert_same(got: torch.Tensor, want: torch.Tensor, what: str, exact: bool = True) -> None:
    """Equal bit patterns (exact), or a few ulps of the dtype apart, relative to the largest
    magnitude (the interpreter: numpy's exp, bf16 rounded by truncation; see
    tests/spectandem/test_fused_kernels_cpu.py). A wrong index is off by far more."""
    assert got.shape == want.shape and got.dtype == want.dtype, \
        f"{what}: {got.shape} {got.dtype} vs {want.shape} {want.dtype}"
    if not exact:
        ulps = 4 * torch.finfo(want.dtype).eps
        torch.testing.assert_close(got, want, rtol=ulps, atol=ulps * float(want.float().abs().max()), msg=what)
        return
    same = got.view(_BITS[got.dtype]) == want.view(_BITS[want.dtype])
    if not bool(same.all()):
        diff = (got.float() - want.float()).abs()
        raise AssertionError(f"{what}: {int((~same).sum())} of {same.numel()} elements differ, max |diff| "
                             f"{float(diff.max()):.3g} (max |want| {float(want.float().abs().max()):.3g})")


def rmsnorm_cuda_order(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward with the mean summed, in torch, in the order spectandem/kernels/fused.py says
    ATen's CUDA reduction takes (its docstring): per lane, four accumulators over its steps, then
    ((a0 + a1) + a2) + a3, halves folded down to 32 lanes, neighbours paired; times the mean factor."""
    h = x.shape[-1]
    x32 = x.float()
    rows = x32.reshape(-1, h)
    m = rows.shape[0]
    lanes, vectorized = reduction_layout(m, h)
    steps = -(-h // (4 * lanes))
    sq = torch.zeros(m, steps * 4 * lanes, dtype=torch.float32, device=x.device)
    sq[:, :h] = rows * rows  # the padding adds +0.0: no-ops
    # [m, step, lane, accumulator]: element (s * lanes + w) * 4 + j vectorized, (4 s + j) * lanes + w otherwise
    sq = sq.view(m, steps, lanes, 4) if vectorized else sq.view(m, steps, 4, lanes).transpose(2, 3)
    acc = torch.zeros(m, lanes, 4, dtype=torch.float32, device=x.device)
    for s in range(steps):
        acc = acc + sq[:, s]
    total = ((acc[..., 0] + acc[..., 1]) + acc[..., 2]) + acc[..., 3]
    while total.shape[1] > 32:
        half = total.shape[1] // 2
        total = total[:, :half] + total[:, half:]
    while total.shape[1] > 1:
        total = total[:, 0::2] + total[:, 1::2]
    mean = (total * _mean_factor(m, h)).view(*x.shape[:-1], 1)
    return weight * (x32 * torch.rsqrt(mean + eps)).to(x.dtype)


def _randn(gen: torch.Generator, *shape, dtype, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(device=device, dtype=dtype)


@torch.no_grad()
def check_rmsnorm(device, dtype, shape: tuple[int, ...], seed: int, against: str = "module",
                  exact: bool = True) -> None:
    """rmsnorm_triton on x [*shape] against the RMSNorm module (`against="module"`) or
    rmsnorm_cuda_order (`"cuda_order"`: the interpreter, where the CPU module sums in another order)."""
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = _randn(gen, *shape, dtype=dtype, device=device, scale=3.0)
    norm = RMSNorm(h, EPS).to(device=device, dtype=dtype)
    norm.weight.copy_(_randn(gen, h, dtype=dtype, device=device, scale=0.2) + 1)
    got = rmsnorm_triton(x, norm.weight, EPS)
    want = norm(x) if against == "module" else rmsnorm_cuda_order(x, norm.weight, EPS)
    what = f"rmsnorm {tuple(shape)} {dtype} (layout {reduction_layout(x.numel() // h, h)})"
    try:
        assert_same(got, want, what, exact)
    except AssertionError as exc:
        if against != "module":
            raise
        replay = rmsnorm_cuda_order(x, norm.weight, EPS)
        same = torch.equal(replay.view(_BITS[dtype]), want.view(_BITS[dtype]))
        raise AssertionError(f"{exc}; torch's replay of the assumed order {'equals' if same else 'differs from'} "
                             f"the module, so {'the kernel' if same else 'the model of ATen order'} is off") from None


@torch.no_grad()
def check_rotary(device, dtype, b: int, t: int, heads: int, kv_heads: int, head_dim: int, seed: int,
                 exact: bool = True) -> None:
    """rotary_triton against apply_rotary on q [B, nh, T, hd] and k [B, nkv, T, hd] as Attention
    lays them out (projections viewed and transposed), with the model's cos/sin tables."""
    gen = torch.Generator().manual_seed(seed)
    q = _randn(gen, b, t, heads * head_dim, dtype=dtype, device=device).view(b, t, heads, head_dim)
    k = _randn(gen, b, t, kv_heads * head_dim, dtype=dtype, device=device).view(b, t, kv_heads, head_dim)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    positions = torch.randint(0, 8192, (b, t), generator=gen).to(device)
    cos, sin = Rotary(RopeSpec(head_dim=head_dim, theta=500000.0)).to(device).cos_sin(positions, dtype)
    got_q, got_k = rotary_triton(q, k, cos, sin)
    for name, got, x in (("q", got_q, q), ("k", got_k, k)):
        want = apply_rotary(x, cos, sin)
        assert_same(got, want, f"rotary {name} B={b} T={t} heads={x.shape[1]} hd={head_dim} {dtype}", exact)
        assert got.stride() == want.stride(), f"rotary {name}: strides {got.stride()}, torch's {want.stride()}"


@torch.no_grad()
def check_silu_mul(device, dtype, shape: tuple[int, ...], seed: int, exact: bool = True) -> None:
    """silu_mul_triton against GatedMLP's F.silu(gate) * up, with exp's overflow and underflow."""
    gen = torch.Generator().manual_seed(seed)
    gate = _randn(gen, *shape, dtype=dtype, device=device, scale=4.0)
    up = _randn(gen, *shape, dtype=dtype, device=device)
    extremes = torch.tensor([-100.0, -88.5, -87.0, -20.0, -0.0, 0.0, 20.0, 87.0, 88.5, 100.0])
    n = min(gate.numel(), extremes.numel())
    gate.view(-1)[:n] = extremes[:n].to(device=device, dtype=dtype)
    assert_same(silu_mul_triton(gate, up), F.silu(gate) * up, f"silu_mul {tuple(shape)} {dtype}", exact)


# ----------------------------------------------------------------------------------------------
# Kernels against the torch code

RMSNORM_SHAPES = [(b, t, 4096) for b in (1, 4) for t in (1, 5, 16)] + [
    (1, 1, 256), (3, 5, 256), (32, 16, 256),  # the demo target; 512 rows: the widest block of rows
    (4, 5, 32, 128),                          # qk-norm: 640 rows of head_dim 128, unvectorized
    (2, 3, 3072), (5, 5120), (7, 96),         # mean factors that are not powers of two
]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", RMSNORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_rmsnorm_equals_module(dtype, shape):
    """bf16: the same bits as the module. fp32: within a few ulps. Measured on the H200 with
    torch 2.11, ATen's fp32 mean sums in an order the kernel does not replay (up to ~1e-6 apart);
    the fast path therefore uses the fused kernel as its only RMSNorm, for plain decoding and
    speculation alike, so greedy exactness between them does not depend on it."""
    check_rmsnorm("cuda", dtype, shape, seed=sum(shape), exact=dtype != torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rmsnorm_falls_back_where_it_does_not_replay(dtype):
    """H = 8192 at 16 rows: ATen splits the rows across warps; `rmsnorm` runs the torch code."""
    assert reduction_layout(16, 8192) is None
    gen = torch.Generator().manual_seed(0)
    x = _randn(gen, 16, 8192, dtype=dtype, device="cuda")
    norm = RMSNorm(8192, EPS).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        assert_same(rmsnorm(x, norm.weight, EPS), norm(x), "rmsnorm fallback")
    with pytest.raises(ValueError, match="replays"):
        rmsnorm_triton(x, norm.weight, EPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b", [1, 4])
@pytest.mark.parametrize("t", [1, 5, 16])
def test_rotary_equals_apply_rotary_8b(dtype, b, t):
    check_rotary("cuda", dtype, b, t, 32, 8, 128, seed=10 * b + t)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t", [(1, 1), (3, 5), (2, 300)])
def test_rotary_equals_apply_rotary_demo(dtype, b, t):
    check_rotary("cuda", dtype, b, t, 4, 2, 64, seed=b + t)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 1, 14336), (4, 16, 14336), (3, 5, 512), (7, 1000), (13,)],
                         ids=lambda s: "x".join(map(str, s)))
def test_silu_mul_equals_gated_mlp(dtype, shape):
    check_silu_mul("cuda", dtype, shape, seed=sum(shape))


# ----------------------------------------------------------------------------------------------
# The demo target's verify with and without the kernels


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5), (4, 16)])
def test_verify_fused_equals_unfused(dtype, cuda_graphs, b, n):
    fused_model = load_llama(demo_paths("none")[0], dtype, "cuda")
    torch_model = load_llama(demo_paths("none")[0], dtype, "cuda")
    runners = [NativeRunner(fused_model, AUX, max_slots=32, max_len=MAX_LEN, cuda_graphs=cuda_graphs,
                            triton_attention=True),
               NativeRunner(torch_model, AUX, max_slots=32, max_len=MAX_LEN, cuda_graphs=cuda_graphs)]
    runners[1].triton_attention = True             # the paged-tree path under the torch ops,
    runners[1].set_cache(None, 16, cuda_graphs)    # its graphs captured on that path
    assert runners[0].model.ops is FUSED_OPS and runners[1].model.ops is TORCH_OPS

    def check(outs, valid):
        # Not bit for bit (the fp32 RMSNorm above differs from ATen's in the last bits): close,
        # and the same greedy choice on every node in fp32.
        (lf, ff), (lt, ft) = outs
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.25)
        torch.testing.assert_close(lf[valid], lt[valid], **tol, msg="verify logits")
        torch.testing.assert_close(ff[valid].float(), ft[valid].float(), **tol, msg="verify features")
        if dtype == torch.float32:
            assert torch.equal(lf[valid].argmax(-1), lt[valid].argmax(-1))

    _rounds(runners, b, n, check)


# ----------------------------------------------------------------------------------------------
# End to end: greedy speculation with the kernels equals plain decoding (fp32)


def _speculator(method: str, fused: bool = True, **tree) -> LocalSpeculator:
    spec = LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=32, max_len=MAX_LEN,
                           device="cuda", cuda_graphs=True, triton_attention=True)
    runner = spec.verifier.runner
    assert runner.model.ops is FUSED_OPS, "triton_attention turns the fused kernels on"
    if not fused:
        runner.model = runner.model.with_ops(TORCH_OPS)
        if runner.graphs is not None:
            runner.graphs.model = runner.model
    return spec


@pytest.fixture(scope="module")
def plain():
    spec = _speculator("none")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    return prompts, [o.token_ids for o in outs]


def test_plain_decoding_fused_equals_torch_code(plain):
    prompts, expected = plain
    outs = _speculator("none", fused=False).generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected)) if o.token_ids != e]
    assert not mismatched, f"prompts {mismatched} differ between the fused kernels and the torch code"


CONFIGS = [
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
]


@pytest.mark.parametrize("method,tree", CONFIGS, ids=["eagle3-chain", "eagle3-tree"])
def test_greedy_with_fused_kernels_equals_plain(plain, method, tree):
    prompts, expected = plain
    spec = _speculator(method, **tree)
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected)) if o.token_ids != e]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    assert sum(o.stats.accepted_tokens for o in outs) > 0
