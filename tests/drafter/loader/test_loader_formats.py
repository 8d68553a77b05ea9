"""drafter.loader on synthetic checkpoints in every public EAGLE format
(drafter/loader.py): each loads, runs and matches a hand-written forward; auxiliary
layers in both index conventions, the head kind, and the target tensors of native and
transformers models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter.heads import Eagle1Head, Eagle3Head
from drafter.loader import TargetTensors, load_head, save_head
from spectandem.feature_layers import aux_layers_from_config
from spectandem.checkpoint import CheckpointError
from tests.drafter.loader.eagle_checkpoints import (H, HD, HT, I, L, NH, NKV, V, VD, _norm, _w, eagle1_checkpoint,
                                                    eagle3_checkpoint, pairs, renamed, run_pairs, run_pairs_then_step,
                                                    speculators_checkpoint, used_target_ids, with_model_prefix, write)


# ---------------------------------------------------------------------------------------------
# Independent reference forward (formats.md 1.4 and 2.6) from the raw tensors, plain torch ops.

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x, theta):
    """x [T, heads, hd], position of row t is t."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    ang = torch.arange(x.shape[0]).float()[:, None] * inv                           # [T, hd/2]
    cos, sin = torch.cat([ang, ang], -1).cos()[:, None], torch.cat([ang, ang], -1).sin()[:, None]
    rot = torch.cat([-x[..., hd // 2:], x[..., : hd // 2]], -1)
    return x * cos + rot * sin


def _attention(t, p, x, hd, theta):
    """Causal GQA self-attention of the head layer over rows x [T, D]."""
    def proj(name):
        b = t.get(f"{p}self_attn.{name}.bias")
        return F.linear(x, t[f"{p}self_attn.{name}.weight"], b)

    n = x.shape[0]
    q = _rope(proj("q_proj").view(n, NH, hd), theta).transpose(0, 1)                 # [NH, T, hd]
    k = _rope(proj("k_proj").view(n, NKV, hd), theta).transpose(0, 1)
    v = proj("v_proj").view(n, NKV, hd).transpose(0, 1)
    k, v = k.repeat_interleave(NH // NKV, 0), v.repeat_interleave(NH // NKV, 0)
    scores = q @ k.transpose(1, 2) / hd ** 0.5
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    out = (scores.softmax(-1) @ v).transpose(0, 1).reshape(n, NH * hd)
    return out @ t[f"{p}self_attn.o_proj.weight"].T


def _silu(x):
    return x * torch.sigmoid(x)


def _gelu(x):
    return 0.5 * x * (1 + torch.erf(x / 2 ** 0.5))


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x ** 3)))


def _mlp(t, p, a, eps, act=_silu):
    x = _rms(a, t[f"{p}post_attention_layernorm.weight"], eps)
    gate, up = x @ t[f"{p}mlp.gate_proj.weight"].T, x @ t[f"{p}mlp.up_proj.weight"].T
    return (act(gate) * up) @ t[f"{p}mlp.down_proj.weight"].T


def reference_eagle1(t, embed, lm_head, tokens, feats, eps=1e-6, theta=10000.0, act=_silu):
    """z = fc([e, f]); a = z + attn(z) (no input norm); m = a + mlp(norm(a)); logits = lm_head(m)."""
    p = "layers.0."
    z = F.linear(torch.cat([embed[tokens], feats], -1), t["fc.weight"], t.get("fc.bias"))
    a = z + _attention(t, p, z, HD, theta)
    m = a + _mlp(t, p, a, eps, act)
    return m, m @ lm_head.T


def reference_eagle3(t, embed, tokens, feats, hd, eps=1e-5, theta=5000.0):
    """u = fc(g); qkv in = [input_layernorm(e), hidden_norm(u)]; a = u + attn; m = a + mlp(norm(a));
    logits = lm_head(norm(m))."""
    p = "midlayer."
    u = feats @ t["fc.weight"].T
    x = torch.cat([_rms(embed[tokens], t[f"{p}input_layernorm.weight"], eps),
                   _rms(u, t[f"{p}hidden_norm.weight"], eps)], -1)
    a = u + _attention(t, p, x, hd, theta)
    m = a + _mlp(t, p, a, eps)
    return m, _rms(m, t["norm.weight"], eps) @ t["lm_head.weight"].T


def _eagle3_layer(t, p, embed, tokens, u, *, act, norm_before_residual, eps=1e-5, theta=5000.0):
    """The EAGLE-3 layer's outputs m [T, H] over input rows u [T, H] (fc output or fed-back hidden)."""
    normed = _rms(u, t[f"{p}hidden_norm.weight"], eps)
    x = torch.cat([_rms(embed[tokens], t[f"{p}input_layernorm.weight"], eps), normed], -1)
    a = (normed if norm_before_residual else u) + _attention(t, p, x, HD, theta)
    return a + _mlp(t, p, a, eps, act)


def reference_eagle3_step(t, embed, tokens, feats, next_token, *, p="midlayer.", act=_silu,
                          norm_before_residual=False, final_norm=True, normed_feedback=False, eps=1e-5):
    """Pairs (feats[i], tokens[i]) at positions 0..T-1, then one draft step at position T reading
    the last row's fed-back hidden and `next_token`. Fed back: m, or norm(m) with normed feedback;
    logits: lm_head(norm(m)), or lm_head(m) without the final norm. Returns
    (fed-back hidden [T, H], logits [T, Vd], step hidden [H], step logits [Vd])."""
    def handed_on(m):
        normed = _rms(m, t["norm.weight"], eps)
        return (normed if normed_feedback else m), (normed if final_norm else m) @ t["lm_head.weight"].T

    layer = dict(act=act, norm_before_residual=norm_before_residual, eps=eps)
    u = feats @ t["fc.weight"].T
    fed, logits = handed_on(_eagle3_layer(t, p, embed, tokens, u, **layer))
    # A causal layer over the T + 1 rows: row T reads the cached rows 0..T-1 and itself.
    m2 = _eagle3_layer(t, p, embed, torch.cat([tokens, torch.tensor([next_token])]),
                       torch.cat([u, fed[-1:]]), **layer)[-1]
    step, step_logits = handed_on(m2)
    return fed, logits, step, step_logits


def _assert_matches(head_out, ref_out):
    for got, want in zip(head_out, ref_out, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert torch.equal(head_out[1].argmax(-1), ref_out[1].argmax(-1))
    assert torch.equal(head_out[3].argmax(-1), ref_out[3].argmax(-1))


def _argmaxes(ref):
    return torch.cat([ref[1].argmax(-1), ref[3].argmax(-1)[None]])


# ---------------------------------------------------------------------------------------------
# EAGLE-1
# ---------------------------------------------------------------------------------------------
# EAGLE-1


EAGLE1_VARIANTS = {
    # name: (fc_bias, qkv_bias, embed, file format, SGLang `model.` prefix)
    "llama2-bin-fc-bias": (True, False, False, "bin", False),
    "llama3-bin-no-fc-bias": (False, False, False, "bin", False),
    "llama3-safetensors-embed": (False, False, True, "safetensors", False),
    "qwen2-qkv-bias": (True, True, False, "safetensors", False),
    "sglang-model-prefix": (True, False, True, "safetensors", True),
}


@pytest.mark.parametrize("variant", EAGLE1_VARIANTS)
def test_eagle1_formats_load_and_run(variant, tmp_path, target):
    fc_bias, qkv_bias, embed, fmt, sglang = EAGLE1_VARIANTS[variant]
    cfg, t = eagle1_checkpoint(1, fc_bias=fc_bias, qkv_bias=qkv_bias, embed=embed)
    if sglang:
        cfg["architectures"] = ["LlamaForCausalLMEagle"]
    d = write(tmp_path / variant, cfg, with_model_prefix(t) if sglang else t, fmt)

    head = load_head(d, target)
    assert isinstance(head, Eagle1Head)
    s = head.spec
    assert (s.kind, s.fc_bias, s.qkv_bias, s.aux_layers, s.feature_size) == ("eagle", fc_bias, qkv_bias, (), H)
    # No lm_head in any EAGLE-1 file: always the target's; the embedding only when the file has none.
    assert torch.equal(head.lm_head.weight, target.lm_head.weight)
    expected_embed = t["embed_tokens.weight"] if embed else target.model.embed_tokens.weight
    assert torch.equal(head.embed_tokens.weight, expected_embed)
    assert not torch.equal(target.lm_head.weight, target.model.embed_tokens.weight)  # untied: the check means something

    tokens, feats = pairs(2, s.feature_size)
    out, logits = run_pairs(head, tokens, feats, chunks=(7,))
    assert out.shape == (7, H) and logits.shape == (7, V)
    assert torch.isfinite(logits).all()
    assert torch.equal(head.draft_to_target(torch.arange(V)), torch.arange(V))


@pytest.mark.parametrize("fc_bias,qkv_bias", [(True, True), (False, False)])
def test_eagle1_matches_hand_written_forward(fc_bias, qkv_bias, tmp_path, target):
    cfg, t = eagle1_checkpoint(3, fc_bias=fc_bias, qkv_bias=qkv_bias)
    head = load_head(write(tmp_path, cfg, t, "bin"), target)
    tokens, feats = pairs(4, H)
    # Fed in three chunks, so the KV cache carries the earlier pairs.
    out, logits = run_pairs(head, tokens, feats, chunks=(3, 1, 3))
    ref_out, ref_logits = reference_eagle1(t, target.model.embed_tokens.weight.detach(),
                                           target.lm_head.weight.detach(), tokens, feats)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# EAGLE-3


EAGLE3_VARIANTS = {
    # name: (layer prefix, embed, file format, `model.` prefix, speculators config)
    "specforge-midlayer": ("midlayer.", False, "safetensors", False, False),
    "official-bin": ("midlayer.", False, "bin", False, False),
    "flat-layers0-embed": ("layers.0.", True, "safetensors", False, False),
    "speculators": ("layers.0.", True, "safetensors", False, True),
    "sglang-model-prefix": ("midlayer.", False, "safetensors", True, False),
}


@pytest.mark.parametrize("variant", EAGLE3_VARIANTS)
def test_eagle3_formats_load_and_run(variant, tmp_path, target):
    prefix, embed, fmt, sglang, speculators = EAGLE3_VARIANTS[variant]
    cfg, t = eagle3_checkpoint(5, embed=embed)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    t = renamed(t, "midlayer.", prefix)
    if speculators:  # the same tensors, the config nested as speculators writes it
        cfg, t = speculators_checkpoint(5, norm_before_residual=False, aux_ids=[1, 3, 6])
    d = write(tmp_path / variant, cfg, with_model_prefix(t) if sglang else t, fmt)

    head = load_head(d, target)
    assert isinstance(head, Eagle3Head)
    s = head.spec
    assert (s.kind, s.draft_vocab_size, s.aux_layers, s.feature_size, s.fc_bias) == \
        ("eagle3", VD, (1, 3, 6), 3 * HT, False)
    expected_embed = t["embed_tokens.weight"] if embed else target.model.embed_tokens.weight
    assert torch.equal(head.embed_tokens.weight, expected_embed)
    assert torch.equal(head.lm_head.weight, t["lm_head.weight"])
    # Draft index i is target id i + d2t[i]: exactly the sorted ids the draft vocabulary kept.
    d2t = t["d2t"]
    assert torch.equal(head.draft_to_target(torch.arange(VD)), torch.arange(VD) + d2t)
    assert torch.equal(head.draft_to_target(torch.arange(VD)), used_target_ids(5))
    assert torch.equal(head.draft_to_target(torch.tensor([[3, 0], [VD - 1, 7]])),
                       torch.tensor([[3 + d2t[3], d2t[0]], [VD - 1 + d2t[VD - 1], 7 + d2t[7]]]))

    tokens, feats = pairs(6, s.feature_size)
    out, logits = run_pairs(head, tokens, feats, chunks=(4, 3))
    assert out.shape == (7, H) and logits.shape == (7, VD)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("head_dim", [None, 16])
def test_eagle3_matches_hand_written_forward(head_dim, tmp_path, target):
    cfg, t = eagle3_checkpoint(7, head_dim=head_dim)
    head = load_head(write(tmp_path, cfg, t), target)
    tokens, feats = pairs(8, 3 * HT)
    out, logits = run_pairs(head, tokens, feats, chunks=(2, 5))
    ref_out, ref_logits = reference_eagle3(t, target.model.embed_tokens.weight.detach(), tokens, feats,
                                           hd=head_dim or HD)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


def test_eagle3_bf16_file_loads_as_its_values(tmp_path, target):
    """Released heads are fp16/bf16: the loader upcasts, d2t stays int64."""
    cfg, t = eagle3_checkpoint(9)
    t16 = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in t.items()}
    head = load_head(write(tmp_path, cfg, t16, "bin"), target)
    assert head.d2t.dtype == torch.int64 and head.fc.weight.dtype == torch.float32
    tokens, feats = pairs(10, 3 * HT)
    _, logits = run_pairs(head, tokens, feats, chunks=(7,))
    _, ref = reference_eagle3({k: v.float() if v.is_floating_point() else v for k, v in t16.items()},
                              target.model.embed_tokens.weight.detach(), tokens, feats, hd=HD)
    torch.testing.assert_close(logits, ref, atol=1e-5, rtol=0)


def test_eagle3_own_width_with_its_own_embedding(tmp_path, target):
    """H != Ht (`target_hidden_size`): fc reads 3 Ht, the file must ship embed_tokens [V, H]."""
    cfg, t = _narrow_eagle3()
    head = load_head(write(tmp_path, cfg, t), target)
    assert (head.spec.hidden_size, head.spec.target_hidden_size, head.spec.feature_size) == (16, HT, 3 * HT)
    tokens, feats = pairs(11, 3 * HT)
    _, logits = run_pairs(head, tokens, feats, chunks=(7,))
    assert logits.shape == (7, VD) and torch.isfinite(logits).all()

    # save_head keeps the embedding such a head cannot take from the target.
    save_head(head, tmp_path / "saved")
    again = load_head(tmp_path / "saved", target)
    assert torch.equal(again.embed_tokens.weight, t["embed_tokens.weight"].bfloat16().float())

    del t["embed_tokens.weight"]
    d = write(tmp_path / "no-embed", cfg, t)
    with pytest.raises(CheckpointError, match="embed_tokens") as err:
        load_head(d, target)
    assert str(d) in str(err.value)


def _narrow_eagle3() -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(12)
    h, hd = 16, 4
    used = used_target_ids(12)
    t = {"fc.weight": _w(g, h, 3 * HT),
         "midlayer.self_attn.q_proj.weight": _w(g, NH * hd, 2 * h),
         "midlayer.self_attn.k_proj.weight": _w(g, NKV * hd, 2 * h),
         "midlayer.self_attn.v_proj.weight": _w(g, NKV * hd, 2 * h),
         "midlayer.self_attn.o_proj.weight": _w(g, h, NH * hd),
         "midlayer.mlp.gate_proj.weight": _w(g, I, h), "midlayer.mlp.up_proj.weight": _w(g, I, h),
         "midlayer.mlp.down_proj.weight": _w(g, h, I),
         "midlayer.post_attention_layernorm.weight": _norm(g, h),
         "midlayer.input_layernorm.weight": _norm(g, h), "midlayer.hidden_norm.weight": _norm(g, h),
         "norm.weight": _norm(g, h), "lm_head.weight": _w(g, VD, h), "d2t": used - torch.arange(VD),
         "embed_tokens.weight": _w(g, V, h)}
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "target_hidden_size": HT,
           "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-5}
    return cfg, t


# ---------------------------------------------------------------------------------------------
# Auxiliary layers: two index conventions, one internal meaning (HF hidden-state index).


def test_aux_layer_conventions_normalise_to_hf_indices(tmp_path, target):
    # Outputs of decoder layers 0, 2, 5 = HF hidden states 1, 3, 6.
    speculators = {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}
    specforge = {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 5], "use_aux_hidden_state": True}}
    assert aux_layers_from_config(speculators, L) == aux_layers_from_config(specforge, L) == (1, 3, 6)
    assert aux_layers_from_config({}, L) == (2, L // 2, L - 3) == (2, 4, 5)
    assert aux_layers_from_config({}, 32) == (2, 16, 29)   # Llama-3.1-8B (formats.md 2.4)
    assert aux_layers_from_config({"eagle_aux_hidden_state_layer_ids": [6, 1, 3]}, L) == (1, 3, 6)
    with pytest.raises(ValueError, match="9"):
        aux_layers_from_config({"eagle_aux_hidden_state_layer_ids": [1, 3, 9]}, L)

    loaded = {}
    for name, extra in {"speculators": speculators, "specforge": specforge, "default": {}}.items():
        cfg, t = eagle3_checkpoint(13)
        loaded[name] = load_head(write(tmp_path / name, {**cfg, **extra}, t), target).spec.aux_layers
    assert loaded == {"speculators": (1, 3, 6), "specforge": (1, 3, 6), "default": (2, 4, 5)}


def test_kind_is_detected_and_checked(tmp_path, target):
    cfg, t = eagle3_checkpoint(14)
    d = write(tmp_path, cfg, t)
    assert isinstance(load_head(d, target, kind="eagle3"), Eagle3Head)
    with pytest.raises(CheckpointError, match="eagle3") as err:
        load_head(d, target, kind="eagle")
    assert str(d) in str(err.value)



def test_target_tensors_of_native_and_transformers_models(target_dir, target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    a, b = TargetTensors.of(target), TargetTensors.of(hf)
    assert (a.vocab_size, a.hidden_size, a.num_layers) == (b.vocab_size, b.hidden_size, b.num_layers) == (V, HT, L)
    assert torch.equal(a.embed_tokens, b.embed_tokens) and torch.equal(a.lm_head, b.lm_head)


# ---------------------------------------------------------------------------------------------
# Fields that change the computation: hidden_act, norm_before_residual, norm_output (SpecForge's
# and speculators' meanings). Each loaded head matches the hand-written forward with the field
# honoured, over the catch-up pairs and one fed-back draft step; the controls show that the same
# forward with the field ignored picks other tokens on these inputs, so ignoring it would fail.

SEED, NEXT = 38, 5   # checkpoint seed and the token of the fed-back step
EMBED_SEED = SEED + 1

SPECULATORS_VARIANTS = {
    # name: (norm_before_residual, hidden_act, norm_output, reference options)
    "residual-pre-norm": (False, None, False, {}),
    "norm-before-residual": (True, "silu", False, dict(norm_before_residual=True)),
    "gelu": (False, "gelu", False, dict(act=_gelu)),
    "normed-feedback": (False, "silu", True, dict(normed_feedback=True)),
    "normed-feedback-norm-before-residual": (True, "silu", True, dict(norm_before_residual=True,
                                                                      normed_feedback=True)),
}


@pytest.mark.parametrize("variant", SPECULATORS_VARIANTS)
def test_speculators_format_matches_hand_written_forward(variant, tmp_path, target):
    before_residual, act, norm_output, ref_options = SPECULATORS_VARIANTS[variant]
    cfg, t = speculators_checkpoint(SEED, norm_before_residual=before_residual, hidden_act=act,
                                    norm_output=norm_output)
    head = load_head(write(tmp_path, cfg, t), target)
    s = head.spec
    assert isinstance(head, Eagle3Head)
    assert (s.hidden_size, s.num_heads, s.num_kv_heads, s.intermediate_size, s.rms_norm_eps, s.rope.theta) == \
        (H, NH, NKV, I, 1e-5, 5000.0)   # read from transformer_layer_config
    assert (s.vocab_size, s.draft_vocab_size, s.aux_layers) == (V, VD, (2, 4, 5))
    assert torch.equal(head.embed_tokens.weight, t["embed_tokens.weight"])
    tokens, feats = pairs(EMBED_SEED, 3 * HT)
    got = run_pairs_then_step(head, tokens, feats, NEXT)
    _assert_matches(got, reference_eagle3_step(t, t["embed_tokens.weight"], tokens, feats, NEXT,
                                               p="layers.0.", **ref_options))


def test_speculators_training_tensors_are_ignored(tmp_path, target):
    """speculators' training copies of the target's final norm and lm_head have no part in drafting."""
    cfg, t = speculators_checkpoint(SEED, norm_before_residual=False)
    plain = load_head(write(tmp_path / "plain", cfg, t), target)
    extra = {**t, "verifier_norm.weight": _norm(torch.Generator().manual_seed(1), H),
             "verifier_lm_head.weight": _w(torch.Generator().manual_seed(2), V, H)}
    with_training = load_head(write(tmp_path / "extra", cfg, extra), target)
    assert plain.state_dict().keys() == with_training.state_dict().keys()
    assert all(torch.equal(v, with_training.state_dict()[k]) for k, v in plain.state_dict().items())


FLAT_EAGLE3_VARIANTS = {
    # name: (config fields, reference options)
    "gelu": ({"hidden_act": "gelu"}, dict(act=_gelu)),
    "gelu-tanh": ({"hidden_act": "gelu_pytorch_tanh"}, dict(act=_gelu_tanh)),
    "gelu-new": ({"hidden_act": "gelu_new"}, dict(act=_gelu_tanh)),
    "silu-stated": ({"hidden_act": "silu"}, {}),
    "norm-before-residual": ({"norm_before_residual": True}, dict(norm_before_residual=True)),
    "specforge-no-final-norm": ({"norm_output": False}, dict(final_norm=False)),
    "specforge-final-norm": ({"norm_output": True}, {}),
}


@pytest.mark.parametrize("variant", FLAT_EAGLE3_VARIANTS)
def test_flat_eagle3_fields_match_hand_written_forward(variant, tmp_path, target):
    fields, ref_options = FLAT_EAGLE3_VARIANTS[variant]
    cfg, t = eagle3_checkpoint(SEED, embed=True)
    head = load_head(write(tmp_path, {**cfg, **fields}, t), target)
    tokens, feats = pairs(EMBED_SEED, 3 * HT)
    got = run_pairs_then_step(head, tokens, feats, NEXT)
    _assert_matches(got, reference_eagle3_step(t, t["embed_tokens.weight"], tokens, feats, NEXT, **ref_options))


@pytest.mark.parametrize("honoured,ignored", [
    (dict(act=_gelu), {}),
    (dict(act=_gelu_tanh), {}),
    (dict(norm_before_residual=True), {}),
    (dict(final_norm=False), {}),
    (dict(normed_feedback=True), {}),
])
def test_each_field_changes_the_argmax_here(honoured, ignored):
    """Controls of the two tests above: on their checkpoint and inputs, the forward that ignores
    the field (SiLU, residual u, final norm, pre-norm feedback) proposes other tokens."""
    _, t = eagle3_checkpoint(SEED, embed=True)
    tokens, feats = pairs(EMBED_SEED, 3 * HT)
    embed = t["embed_tokens.weight"]
    assert not torch.equal(_argmaxes(reference_eagle3_step(t, embed, tokens, feats, NEXT, **honoured)),
                           _argmaxes(reference_eagle3_step(t, embed, tokens, feats, NEXT, **ignored)))


def test_eagle1_hidden_act_is_honoured(tmp_path, target):
    cfg, t = eagle1_checkpoint(7, fc_bias=True)
    head = load_head(write(tmp_path, {**cfg, "hidden_act": "gelu", "norm_output": False}, t), target)
    assert head.spec.hidden_act == "gelu"
    tokens, feats = pairs(8, H)
    out, logits = run_pairs(head, tokens, feats, chunks=(3, 4))
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.lm_head.weight.detach()
    ref_out, ref_logits = reference_eagle1(t, embed, lm_head, tokens, feats, act=_gelu)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    _, silu_logits = reference_eagle1(t, embed, lm_head, tokens, feats)
    assert not torch.equal(logits.argmax(-1), silu_logits.argmax(-1))   # control: SiLU would differ


def test_fast_path_keeps_the_activation(tmp_path, target):
    """The fused ops pack gate/up into one GEMM; a GELU head keeps its GELU there (the fused
    SiLU kernel is SiLU's alone)."""
    from spectandem.modeling.ops import FUSED_OPS

    cfg, t = eagle3_checkpoint(SEED, embed=True)
    head = load_head(write(tmp_path, {**cfg, "hidden_act": "gelu"}, t), target).with_ops(FUSED_OPS)
    assert head.layer.mlp.packed_weight is not None
    tokens, feats = pairs(EMBED_SEED, 3 * HT)
    _assert_matches(run_pairs_then_step(head, tokens, feats, NEXT),
                    reference_eagle3_step(t, t["embed_tokens.weight"], tokens, feats, NEXT, act=_gelu))
