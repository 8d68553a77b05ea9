"""The packed projections and the fused residual add + RMSNorm on the GPU (FUSED_OPS;
run with `python -m pytest -m gpu tests/gpu/test_packed_model.py`).

- Kernel level, as bit patterns against the torch code, fp32 and bf16: add_rmsnorm's sum against
  `x + delta` (both dtypes) and its norm against the RMSNorm module on that sum (bf16; fp32 within a
  few ulps, as rmsnorm: tests/gpu/test_fused_kernels.py) at the 8B shapes, the demo's and the torch
  fallback's (H 8192); silu_mul_packed against F.silu(gate) * up on the halves of a packed
  [.., 2I] (both dtypes); rmsnorm over q and k viewed from a packed q/k/v output (qk-norm's strided
  rows) against the module; rotary on those views against apply_rotary, values and strides.
- Models: random small Llama / Qwen2 (q/k/v bias) / Qwen3 (qk-norm) targets packed and fused against
  the same weights unpacked through the torch code, eager and CUDA-graphed verify: close, the same
  greedy choice in fp32.
- End to end in fp32 with cuda_graphs and triton_attention (which pack and fuse): greedy EAGLE-3 chain
  speculation equals plain decoding on 8 prompts.

The `check_*` helpers and `random_llama` take a device; tests/spectandem/test_packed_model.py runs
them on the CPU (the kernels through Triton's interpreter)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.fused import (
    add_rmsnorm,
    add_rmsnorm_triton,
    reduction_layout,
    rmsnorm_triton,
    silu_mul_packed_triton,
)
from spectandem.kernels.rotary import rotary_triton
from router.local import LocalSpeculator
from spectandem.modeling.layers import RMSNorm, RopeSpec, Rotary, apply_rotary
from spectandem.modeling.llama import LlamaModel, LlamaSpec
from spectandem.modeling.ops import FUSED_OPS
from tests.e2e.conftest import PROMPT_TEXTS
from tests.gpu.test_fused_kernels import _randn, assert_same, rmsnorm_cuda_order
from tests.gpu.test_triton_attention import _rounds
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

EPS = 1e-5
DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# (architecture, config.json overrides): q/k/v and gate/up without biases, with (Llama's
# attention_bias and mlp_bias; Qwen2's q/k/v), and qk-norm over the packed views (Qwen3).
MODELS = {
    "llama": ("LlamaForCausalLM", {}),
    "llama-bias": ("LlamaForCausalLM", dict(attention_bias=True, mlp_bias=True)),
    "qwen2": ("Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3ForCausalLM", {}),
}
AUX = (0, 2, 3)  # the embeddings, after layer 1, after the last layer (random_llama has 3)


@pytest.fixture(scope="module", autouse=True)
def _cuda_and_triton():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    if not HAVE_TRITON:
        pytest.fail("tests/gpu/test_packed_model.py needs triton on the GPU machine")


def random_llama(architecture: str, dtype: torch.dtype, device, seed: int = 0, **config) -> LlamaModel:
    """A small random Llama-family model (3 layers, H 256, 4/2 heads of 32, I 384, vocab 4096):
    weights ~ 1/sqrt(fan-in), norms near 1, every bias nonzero."""
    cfg = dict(architectures=[architecture], vocab_size=4096, hidden_size=256, intermediate_size=384,
               num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=EPS,
               rope_theta=10000.0, max_position_embeddings=1024, tie_word_embeddings=False, **config)
    model = LlamaModel(LlamaSpec.from_config(cfg, "random_llama"))
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.1 * noise)
            else:
                p.copy_(noise / (p.shape[-1] ** 0.5 if p.dim() == 2 and "embed" not in name else 1.0))
    return model.to(device=device, dtype=dtype).eval()


def packed_pair(architecture: str, dtype: torch.dtype, device, **config) -> tuple[LlamaModel, LlamaModel]:
    """(packed and fused, the same weights through the torch code)."""
    plain = random_llama(architecture, dtype, device, **config)
    return copy.deepcopy(plain).with_ops(FUSED_OPS), plain


@torch.no_grad()
def check_add_rmsnorm(device, dtype, shape: tuple[int, ...], seed: int, against: str = "module",
                      exact: bool = True, exact_sum: bool = True) -> None:
    """add_rmsnorm_triton against `x + delta` (bit for bit unless `exact_sum` is off: the
    interpreter's bf16 truncates) and the RMSNorm module on its sum (`against="module"`) or
    rmsnorm_cuda_order (`"cuda_order"`: the interpreter), as check_rmsnorm holds rmsnorm."""
    gen = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = _randn(gen, *shape, dtype=dtype, device=device, scale=3.0)
    delta = _randn(gen, *shape, dtype=dtype, device=device)
    norm = RMSNorm(h, EPS).to(device=device, dtype=dtype)
    norm.weight.copy_(_randn(gen, h, dtype=dtype, device=device, scale=0.2) + 1)
    got_sum, got = add_rmsnorm_triton(x, delta, norm.weight, EPS)
    want_sum = x + delta
    what = f"add_rmsnorm {tuple(shape)} {dtype} (layout {reduction_layout(x.numel() // h, h)})"
    assert_same(got_sum, want_sum, f"{what}: the sum", exact_sum)
    # The norm of the kernel's own sum, so a truncated bf16 sum (the interpreter) counts once.
    want = norm(got_sum) if against == "module" else rmsnorm_cuda_order(got_sum, norm.weight, EPS)
    assert_same(got, want, f"{what}: the norm", exact)


@torch.no_grad()
def check_silu_mul_packed(device, dtype, rows: tuple[int, ...], inter: int, seed: int, exact: bool = True) -> None:
    """silu_mul_packed_triton on gate_up [*rows, 2I] against F.silu(gate) * up on its halves (the
    product of separately computed projections: the values are the same), with exp's overflow and
    underflow in the gate half."""
    gen = torch.Generator().manual_seed(seed)
    gate = _randn(gen, *rows, inter, dtype=dtype, device=device, scale=4.0)
    up = _randn(gen, *rows, inter, dtype=dtype, device=device)
    extremes = torch.tensor([-100.0, -88.5, -87.0, -20.0, -0.0, 0.0, 20.0, 87.0, 88.5, 100.0])
    n = min(gate.numel(), extremes.numel())
    gate.view(-1)[:n] = extremes[:n].to(device=device, dtype=dtype)
    got = silu_mul_packed_triton(torch.cat([gate, up], dim=-1))
    assert got.is_contiguous()
    assert_same(got, F.silu(gate) * up, f"silu_mul_packed {tuple(rows)} x 2*{inter} {dtype}", exact)


def _packed_qkv(gen, b: int, t: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """q [B, T, nh, hd], k, v [B, T, nkv, hd] viewed from one [B, T, (nh + 2 nkv) * hd] output, as
    Attention's fused path makes them."""
    sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    qkv = _randn(gen, b, t, sum(sizes), dtype=dtype, device=device)
    q, k, v = qkv.split(sizes, dim=-1)
    return (q.view(b, t, heads, head_dim), k.view(b, t, kv_heads, head_dim), v.view(b, t, kv_heads, head_dim))


@torch.no_grad()
def check_strided_rmsnorm(device, dtype, b: int, t: int, heads: int, kv_heads: int, head_dim: int, seed: int,
                          against: str = "module", exact: bool = True) -> None:
    """qk-norm on the packed path: rmsnorm_triton over q and k viewed from a packed projection
    (rows of head_dim at head and token strides) against the module on the same views."""
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = _packed_qkv(gen, b, t, heads, kv_heads, head_dim, dtype, device)
    norm = RMSNorm(head_dim, EPS).to(device=device, dtype=dtype)
    norm.weight.copy_(_randn(gen, head_dim, dtype=dtype, device=device, scale=0.2) + 1)
    for name, x in (("q", q), ("k", k)):
        got = rmsnorm_triton(x, norm.weight, EPS)
        want = norm(x) if against == "module" else rmsnorm_cuda_order(x, norm.weight, EPS)
        assert_same(got, want, f"strided rmsnorm {name} {tuple(x.shape)} strides {x.stride()} {dtype}", exact)
        assert got.stride() == want.stride(), f"rmsnorm {name}: strides {got.stride()}, torch's {want.stride()}"


@torch.no_grad()
def check_packed_rotary(device, dtype, b: int, t: int, heads: int, kv_heads: int, head_dim: int, seed: int,
                        exact: bool = True) -> None:
    """rotary_triton on q and k viewed from a packed projection (transposed to [B, heads, T, hd])
    against apply_rotary: values and strides (the attention and the matmuls read those)."""
    gen = torch.Generator().manual_seed(seed)
    q, k, _ = _packed_qkv(gen, b, t, heads, kv_heads, head_dim, dtype, device)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    positions = torch.randint(0, 8192, (b, t), generator=gen).to(device)
    cos, sin = Rotary(RopeSpec(head_dim=head_dim, theta=500000.0)).to(device).cos_sin(positions, dtype)
    got_q, got_k = rotary_triton(q, k, cos, sin)
    for name, got, x in (("q", got_q, q), ("k", got_k, k)):
        want = apply_rotary(x, cos, sin)
        assert_same(got, want, f"packed rotary {name} B={b} T={t} strides {x.stride()} {dtype}", exact)
        # Strides of size-1 dimensions (one kv head) address nothing and may differ.
        assert _strides(got) == _strides(want), f"rotary {name}: strides {got.stride()}, torch's {want.stride()}"


def _strides(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(stride for size, stride in zip(x.shape, x.stride()) if size > 1)


# ----------------------------------------------------------------------------------------------
# Kernels against the torch code

ADD_RMSNORM_SHAPES = [(b, t, 4096) for b in (1, 4) for t in (1, 5, 16)] + [(1, 1, 256), (3, 5, 256), (2, 3, 3072)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ADD_RMSNORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_add_rmsnorm_equals_add_then_module(dtype, shape):
    """The sum bit for bit; the norm as rmsnorm's (bit for bit in bf16, within ~1e-6 in fp32)."""
    check_add_rmsnorm("cuda", dtype, shape, seed=sum(shape), exact=dtype != torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_add_rmsnorm_falls_back_where_rmsnorm_does(dtype):
    """H = 8192 at 16 rows: ATen splits the rows across warps; add_rmsnorm is the torch code."""
    gen = torch.Generator().manual_seed(0)
    x, delta = (_randn(gen, 16, 8192, dtype=dtype, device="cuda") for _ in range(2))
    norm = RMSNorm(8192, EPS).to(device="cuda", dtype=dtype)
    with torch.no_grad():
        total, normed = add_rmsnorm(x, delta, norm.weight, EPS)
        assert_same(total, x + delta, "add_rmsnorm fallback: the sum")
        assert_same(normed, norm(x + delta), "add_rmsnorm fallback: the norm")
    with pytest.raises(ValueError, match="replays"):
        add_rmsnorm_triton(x, delta, norm.weight, EPS)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter", [((1, 1), 14336), ((4, 16), 14336), ((3, 5), 512), ((7,), 1000), ((), 13)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_silu_mul_packed_equals_gated_mlp(dtype, rows, inter):
    check_silu_mul_packed("cuda", dtype, rows, inter, seed=sum(rows) + inter)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t", [(1, 1), (4, 5), (2, 16)])
def test_strided_rmsnorm_close_to_module(dtype, b, t):
    """The kernel over qk-norm rows (32/8 heads of 128) viewed from the packed projection. Close,
    not bit for bit: on the H200 (bf16, B 4, T 5) 2 of 81920 elements were a bit apart, so the
    model keeps its qk-norm on the torch code (FusedOps.head_norm)."""
    check_strided_rmsnorm("cuda", dtype, b, t, 32, 8, 128, seed=b + t, exact=False)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t", [(1, 1), (4, 5), (2, 16)])
def test_packed_rotary_equals_apply_rotary(dtype, b, t):
    check_packed_rotary("cuda", dtype, b, t, 32, 8, 128, seed=b + t)


# ----------------------------------------------------------------------------------------------
# Packed and fused models against the torch code


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "graphs"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5)])
def test_packed_verify_close_to_torch_code(model, dtype, cuda_graphs, b, n):
    architecture, config = MODELS[model]
    fused_model, torch_model = packed_pair(architecture, dtype, "cuda", **config)
    runners = [NativeRunner(fused_model, AUX, max_slots=8, max_len=512, cuda_graphs=cuda_graphs, triton_attention=True),
               NativeRunner(torch_model, AUX, max_slots=8, max_len=512, cuda_graphs=cuda_graphs)]
    runners[1].triton_attention = True             # the paged-tree path under the torch ops,
    runners[1].set_cache(None, 16, cuda_graphs)    # its graphs captured on that path
    assert fused_model.model.layers[0].self_attn.packed_weight is not None, "triton_attention packs the projections"

    def check(outs, valid):
        (lf, ff), (lt, ft) = outs
        tol = dict(rtol=1e-4, atol=1e-4) if dtype == torch.float32 else dict(rtol=0.05, atol=0.25)
        torch.testing.assert_close(lf[valid], lt[valid], **tol, msg="verify logits")
        torch.testing.assert_close(ff[valid].float(), ft[valid].float(), **tol, msg="verify features")
        if dtype == torch.float32:
            assert torch.equal(lf[valid].argmax(-1), lt[valid].argmax(-1))

    _rounds(runners, b, n, check)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_packing_keeps_memory_and_names_on_cuda(dtype):
    model = random_llama("LlamaForCausalLM", dtype, "cuda", attention_bias=True, mlp_bias=True)
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    model.with_ops(FUSED_OPS)
    torch.cuda.synchronize()
    # At most as much: the allocator rounds each tensor up to 512 bytes, the small biases included.
    assert torch.cuda.memory_allocated() <= before, "the packed weights replace the separate ones"
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    attn = model.model.layers[0].self_attn
    assert attn.q_proj.weight.data_ptr() == attn.packed_weight.data_ptr()


# ----------------------------------------------------------------------------------------------
# End to end: greedy EAGLE-3 chain speculation on the packed fast path equals plain decoding (fp32)


def _speculator(method: str, **tree) -> LocalSpeculator:
    spec = LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=32, max_len=512,
                           device="cuda", cuda_graphs=True, triton_attention=True)
    layer = spec.verifier.runner.model.model.layers[0]
    assert spec.verifier.runner.model.ops is FUSED_OPS and layer.mlp.packed_weight is not None, \
        "triton_attention packs and fuses"
    return spec


def test_greedy_eagle3_chain_equals_plain_on_packed_path():
    prompts_text = PROMPT_TEXTS[:8]
    plain = _speculator("none")
    prompts = [plain.tokenizer.encode(t).ids for t in prompts_text]
    params = [SamplingParams(max_tokens=48)] * len(prompts)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    spec = _speculator("eagle3", num_steps=4, topk=1, num_draft_tokens=5)
    outs = spec.generate(prompts, params)
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected)) if o.token_ids != e]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    assert sum(o.stats.accepted_tokens for o in outs) > 0
    # With CUDA graphs the draft head takes the fast path too (EagleProposer: packed gate/up, fused
    # norms); its drafts may differ in the last bits, which the equality above shows does not matter.
    head_mlp = spec.drafter.proposer.head.layer.mlp
    assert head_mlp.packed_weight is not None and spec.drafter.proposer.head.ops is FUSED_OPS, \
        "the draft head's fast path is on"

