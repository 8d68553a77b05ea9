"""Packed projections and the fused residual add + RMSNorm (the fused ops, FUSED_OPS) on the CPU.

Always run: off CUDA the fused hooks are the torch code, so a fused model here computes its q/k/v
and gate/up projections as one GEMM each and everything else as before. Packing keeps the
parameters' names, shapes, values and memory (the projections become views of the packed weight);
load_state_dict (copying or assigning), dtype conversions and deepcopy keep the model packed; the packed model
verifies within fp32 ulps of the unpacked one with the same argmaxes (Llama, Llama with every bias,
Qwen2, Qwen3's qk-norm); the torch ops over packed weights are the torch code bit for bit;
`forward` (residual adds moved into the next norm) equals the layer-by-layer formula bit for bit,
aux hidden states included; the demo target packed decodes the same greedy tokens, alone and under
EAGLE-3 speculation, whose head stays unpacked.

Through Triton's interpreter (tests/interpreter.py: on a machine without a GPU where triton is
installed, as the README's test command and CI install it): the kernel checks of
tests/gpu/test_packed_model.py at small sizes. fp32: add_rmsnorm's sum and norm and rmsnorm over strided rows bit for bit against
`rmsnorm_cuda_order` (the torch replay of ATen's CUDA order), rotary over packed views bit for bit,
silu_mul_packed within a few ulps (numpy's exp); bf16 within a few ulps (the interpreter truncates).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kernels.fused import (
    _row_layout,
    add_rmsnorm_ref,
    add_rmsnorm_triton,
    silu_mul_packed_ref,
    silu_mul_packed_triton,
)
from spectandem.kv_cache import KVCache
from router.local import LocalSpeculator
from spectandem.modeling.layers import GatedMLP, RMSNorm
from spectandem.modeling.llama import Attention
from spectandem.modeling.ops import FUSED_OPS, HOST_OPS, TORCH_OPS
from tests.e2e.conftest import PROMPT_TEXTS
from tests.gpu.test_packed_model import (
    MODELS,
    check_add_rmsnorm,
    check_packed_rotary,
    check_silu_mul_packed,
    check_strided_rmsnorm,
    packed_pair,
    random_llama,
)
from tests.gpu.test_triton_attention import _rounds
from tests.interpreter import interpreter, needs_triton
from verifier.runner import NativeRunner


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
AUX = (0, 2, 3)  # the embeddings, after layer 1, after the last layer (random_llama has 3)


def _storage_bytes(model) -> int:
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


# ----------------------------------------------------------------------------------------------
# Packing (always run)


@torch.no_grad()
@pytest.mark.parametrize("model", MODELS)
def test_packing_keeps_names_shapes_values_and_memory(model):
    architecture, config = MODELS[model]
    m = random_llama(architecture, torch.float32, "cpu", **config)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    memory = _storage_bytes(m)
    m.with_ops(FUSED_OPS)
    after = m.state_dict()
    assert list(after) == list(before)
    assert all(after[k].shape == v.shape and torch.equal(after[k], v) for k, v in before.items())
    assert _storage_bytes(m) == memory, "the packed weights replace the separate ones"
    for layer in m.model.layers:
        for module in (layer.self_attn, layer.mlp):
            row = 0
            for name in module.packed_names:
                linear = getattr(module, name)
                assert linear.weight.data_ptr() == module.packed_weight[row].data_ptr(), name
                if linear.bias is not None:
                    assert linear.bias.data_ptr() == module.packed_bias[row:].data_ptr(), name
                row += linear.out_features
            assert row == module.packed_weight.shape[0] == sum(module.packed_sizes)
    spec = m.spec
    assert m.model.layers[0].self_attn.packed_weight.shape == (
        (spec.num_heads + 2 * spec.num_kv_heads) * spec.head_dim, spec.hidden_size)
    assert m.model.layers[0].mlp.packed_weight.shape == (2 * spec.intermediate_size, spec.hidden_size)
    packed = m.model.layers[0].self_attn.packed_weight
    m.pack_projections()
    assert m.model.layers[0].self_attn.packed_weight is packed, "packing is idempotent"


@torch.no_grad()
@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_load_state_dict_into_a_packed_model_updates_the_packed_weights(assign):
    target = random_llama("Qwen2ForCausalLM", torch.float32, "cpu", seed=0)
    target = target.with_ops(FUSED_OPS)
    source = random_llama("Qwen2ForCausalLM", torch.float32, "cpu", seed=1)
    state = {k: v.clone() for k, v in source.state_dict().items()}
    target.load_state_dict(state, assign=assign)
    for layer_t, layer_s in zip(target.model.layers, source.model.layers):
        attn_t, attn_s = layer_t.self_attn, layer_s.self_attn
        assert torch.equal(attn_t.packed_weight, torch.cat([attn_s.q_proj.weight, attn_s.k_proj.weight,
                                                            attn_s.v_proj.weight]))
        assert torch.equal(attn_t.packed_bias, torch.cat([attn_s.q_proj.bias, attn_s.k_proj.bias, attn_s.v_proj.bias]))
        assert torch.equal(layer_t.mlp.packed_weight, torch.cat([layer_s.mlp.gate_proj.weight,
                                                                 layer_s.mlp.up_proj.weight]))
        assert attn_t.q_proj.weight.data_ptr() == attn_t.packed_weight.data_ptr(), "still views of the packed weight"
        up_rows = layer_t.mlp.packed_weight[source.spec.intermediate_size:]
        assert layer_t.mlp.up_proj.weight.data_ptr() == up_rows.data_ptr()


@torch.no_grad()
def test_conversion_and_copy_repack():
    m = random_llama("LlamaForCausalLM", torch.float32, "cpu", mlp_bias=True).with_ops(FUSED_OPS)
    weights = {k: v.clone() for k, v in m.state_dict().items()}
    m.to(torch.bfloat16)
    copied = copy.deepcopy(m)
    for model in (m, copied):
        mlp = model.model.layers[1].mlp
        assert mlp.packed_weight.dtype == torch.bfloat16 and mlp.packed_bias.dtype == torch.bfloat16
        assert mlp.gate_proj.weight.data_ptr() == mlp.packed_weight.data_ptr()
        assert mlp.up_proj.bias.data_ptr() == mlp.packed_bias[m.spec.intermediate_size:].data_ptr()
        assert all(torch.equal(v, weights[k].to(torch.bfloat16)) for k, v in model.state_dict().items())
    assert copied.model.layers[1].mlp.packed_weight.data_ptr() != m.model.layers[1].mlp.packed_weight.data_ptr()


def test_fused_ops_pack_only_the_target():
    m = random_llama("LlamaForCausalLM", torch.float32, "cpu")
    packable = [mod for mod in m.modules() if isinstance(mod, (Attention, GatedMLP))]
    assert len(packable) == 2 * m.spec.num_layers and all(mod.packed_weight is None for mod in packable)
    fused = m.with_ops(FUSED_OPS)
    assert all(mod.packed_weight is not None for mod in packable)
    assert fused.with_ops(TORCH_OPS).ops is TORCH_OPS and m.ops is TORCH_OPS
    assert all(mod.packed_weight is not None for mod in packable), "views stay valid"
    assert GatedMLP(8, 16).packed_weight is None, "other models' modules (the draft heads) stay unpacked"


# ----------------------------------------------------------------------------------------------
# The packed model's numbers (always run)


def _check_close(outs, valid):
    (lp, fp), (lt, ft) = outs
    torch.testing.assert_close(lp[valid], lt[valid], atol=2e-5, rtol=1e-5, msg="verify logits")
    torch.testing.assert_close(fp[valid], ft[valid], atol=2e-5, rtol=1e-5, msg="verify features")
    assert torch.equal(lp[valid].argmax(-1), lt[valid].argmax(-1))


def _check_equal(outs, valid):
    (lp, fp), (lt, ft) = outs
    assert torch.equal(lp, lt) and torch.equal(fp, ft)


@torch.no_grad()
@pytest.mark.parametrize("model", MODELS)
def test_packed_model_verifies_close_to_unpacked(model):
    """On the CPU the fused path is the packed GEMM and the torch code: within fp32 ulps (the
    packed GEMM may sum in another order), the same argmaxes; aux hidden states included."""
    architecture, config = MODELS[model]
    fused_model, torch_model = packed_pair(architecture, torch.float32, "cpu", **config)
    runners = [NativeRunner(m, AUX, max_slots=4, max_len=512) for m in (fused_model, torch_model)]
    _rounds(runners, 3, 5, _check_close)


@torch.no_grad()
def test_fused_off_after_packing_is_the_torch_code():
    packed, plain = packed_pair("Qwen3ForCausalLM", torch.float32, "cpu")
    packed = packed.with_ops(TORCH_OPS)
    runners = [NativeRunner(m, AUX, max_slots=4, max_len=512) for m in (packed, plain)]
    _rounds(runners, 2, 4, _check_equal)


@torch.no_grad()
@pytest.mark.parametrize("fused", [False, True], ids=["torch", "packed"])
def test_forward_equals_the_layer_by_layer_formula(fused):
    """`forward` adds each layer's MLP output in the next norm; the hidden states it captures and
    returns equal x = x + attn(norm(x)); x = x + mlp(norm(x)) layer by layer, then the final norm."""
    m = random_llama("LlamaForCausalLM", torch.float32, "cpu", attention_bias=True)
    m = m.with_ops(FUSED_OPS if fused else TORCH_OPS)
    ops, s = m.ops, m.spec
    ids = torch.randint(0, s.vocab_size, (2, 6), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(6).expand(2, 6)
    mask = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 6, 6)
    caches = [KVCache(s.num_layers, 2, s.num_kv_heads, 16, s.head_dim, torch.float32) for _ in range(2)]
    views = [c.batch(torch.arange(2), positions, 6) for c in caches]
    capture = (3, 0, 1)
    hidden, aux = m(ids, positions, views[0], mask, capture)
    x = m.model.embed_tokens(ids)
    cos, sin = m.model.rotary_emb.cos_sin(positions, x.dtype)
    states = [x]
    for i, layer in enumerate(m.model.layers):
        x = x + layer.self_attn(ops.norm(layer.input_layernorm, x), cos, sin, views[1], i, mask, ops)
        x = x + ops.mlp(layer.mlp, ops.norm(layer.post_attention_layernorm, x))
        states.append(x)
    assert torch.equal(hidden, ops.norm(m.model.norm, x))
    assert torch.equal(aux, torch.cat([states[k] for k in capture], dim=-1))


@pytest.fixture(scope="module")
def plain_demo():
    spec = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=4, max_len=128)
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:4]]
    outs = spec.generate(prompts, [SamplingParams(max_tokens=16)] * len(prompts))
    return prompts, [o.token_ids for o in outs]


@torch.no_grad()
@pytest.mark.parametrize("method,tree", [("none", {}), ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5))],
                         ids=["plain", "eagle3-chain"])
def test_packed_demo_target_decodes_the_same_greedy_tokens(plain_demo, method, tree):
    prompts, expected = plain_demo
    spec = LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=4, max_len=128)
    runner = spec.verifier.runner
    runner.model = runner.model.with_ops(FUSED_OPS)  # what triton_attention does, off CUDA
    outs = spec.generate(prompts, [SamplingParams(max_tokens=16)] * len(prompts))
    assert [o.token_ids for o in outs] == expected
    if method != "none":
        assert sum(o.stats.accepted_tokens for o in outs) > 0
        # The target's ops do not reach the draft head: it keeps the CPU path its proposer chose.
        assert spec.drafter.proposer.head.ops is HOST_OPS, "the draft head keeps its own ops"


# ----------------------------------------------------------------------------------------------
# Kernel plumbing (always run, or with Triton installed)


def test_row_layout():
    """Where rmsnorm's kernel finds row r: (r // inner) * stride_outer + (r % inner) * stride_inner."""
    h = 32
    n = (4 + 2 * 2) * h
    qkv = torch.empty(2, 3, n)
    q = qkv.split([4 * h, 2 * h, 2 * h], dim=-1)[0].view(2, 3, 4, h)
    assert _row_layout(torch.empty(3, 5, h)) == (1, h, 0)
    assert _row_layout(q) == (4, n, h)                                  # [B, T, nh, hd] at (T N, N, hd, 1)
    assert _row_layout(q[:1, :1]) == (1, h, 0)                          # one token: contiguous
    assert _row_layout(qkv[:, :, :h]) == (3, 3 * n, n)                  # rows at stride N, B at 3 N
    assert _row_layout(torch.empty(4, h).t()) is None                   # H not contiguous
    assert _row_layout(torch.empty(4, 6, 5, h)[:, :3]) is None          # B and T do not merge


def test_references_are_the_layers_code():
    gen = torch.Generator().manual_seed(2)
    x, delta = torch.randn(3, 5, 64, generator=gen), torch.randn(3, 5, 64, generator=gen)
    norm = RMSNorm(64, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=gen))
        total, normed = add_rmsnorm_ref(x, delta, norm.weight, 1e-5)
        assert torch.equal(total, x + delta) and torch.equal(normed, norm(x + delta))
        got = TORCH_OPS.add_norm(norm, x, delta)
        assert torch.equal(got[0], total) and torch.equal(got[1], normed)
    gate_up = torch.randn(4, 2 * 48, generator=gen)
    assert torch.equal(silu_mul_packed_ref(gate_up), F.silu(gate_up[:, :48]) * gate_up[:, 48:])


@needs_triton
def test_wrappers_validate():
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="delta"):
        add_rmsnorm_triton(x, torch.randn(3, 32), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="contiguous"):
        add_rmsnorm_triton(x, torch.randn(64, 3).t(), torch.ones(64), 1e-5)
    with pytest.raises(ValueError, match="weight"):
        add_rmsnorm_triton(x, x, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="2I"):
        silu_mul_packed_triton(torch.randn(3, 7))
    with pytest.raises(ValueError, match="2I"):
        silu_mul_packed_triton(torch.randn(8, 3).t())


# ----------------------------------------------------------------------------------------------
# Through the interpreter

ADD_RMSNORM_SHAPES = [(1, 1, 256), (3, 5, 256), (1, 2048), (5, 512), (2, 3, 4, 128), (7, 96)]


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ADD_RMSNORM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_interpreted_add_rmsnorm(dtype, shape):
    fp32 = dtype == torch.float32
    check_add_rmsnorm("cpu", dtype, shape, seed=sum(shape), against="cuda_order", exact=fp32, exact_sum=fp32)


@interpreter
@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # exp(100): inf, as on the GPU
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,inter", [((3, 5), 512), ((7,), 1000), ((), 13)],
                         ids=lambda v: "x".join(map(str, v)) if isinstance(v, tuple) else str(v))
def test_interpreted_silu_mul_packed(dtype, rows, inter):
    check_silu_mul_packed("cpu", dtype, rows, inter, seed=sum(rows) + inter, exact=False)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t,heads,kv_heads,head_dim", [(1, 1, 4, 2, 32), (2, 3, 4, 2, 32), (3, 2, 8, 1, 128)])
def test_interpreted_strided_rmsnorm(dtype, b, t, heads, kv_heads, head_dim):
    check_strided_rmsnorm("cpu", dtype, b, t, heads, kv_heads, head_dim, seed=b + t, against="cuda_order",
                          exact=dtype == torch.float32)


@interpreter
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t,heads,kv_heads,head_dim", [(1, 1, 4, 2, 64), (3, 5, 4, 2, 64), (2, 3, 8, 1, 128)])
def test_interpreted_packed_rotary(dtype, b, t, heads, kv_heads, head_dim):
    check_packed_rotary("cpu", dtype, b, t, heads, kv_heads, head_dim, seed=b + t, exact=dtype == torch.float32)


@torch.no_grad()
@interpreter
def test_interpreted_packed_model_runs_the_kernels(monkeypatch):
    """The kernels' wrappers accept what the packed model hands them (views of the packed outputs,
    qk-norm's strided rows): the fused hooks forced to their `_triton` forms, against the torch code."""
    import spectandem.kernels.fused as fused_kernels
    import spectandem.kernels.rotary as rotary_kernels

    for name in ("rmsnorm", "add_rmsnorm", "silu_mul_packed"):
        monkeypatch.setattr(fused_kernels, name, getattr(fused_kernels, f"{name}_triton"))
    monkeypatch.setattr(rotary_kernels, "rotary", rotary_kernels.rotary_triton)
    fused_model, torch_model = packed_pair("Qwen3ForCausalLM", torch.float32, "cpu")
    runners = [NativeRunner(m, AUX, max_slots=4, max_len=512) for m in (fused_model, torch_model)]
    _rounds(runners, 2, 3, _check_close, num_rounds=1)
