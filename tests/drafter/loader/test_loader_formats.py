"""drafter.loader on synthetic checkpoints in every public EAGLE format
(../shared/reference/formats.md): each loads, runs and matches a hand-written forward; auxiliary
layers in both index conventions, the head kind, and the target tensors of native and
transformers models."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from drafter.heads import Eagle1Head, Eagle3Head
from drafter.loader import TargetTensors, aux_layers_from_config, load_head, save_head
from spectandem.checkpoint import CheckpointError
from tests.drafter.loader.eagle_checkpoints import (H, HD, HT, I, L, NH, NKV, V, VD, _norm, _w, eagle1_checkpoint,
                                                    eagle3_checkpoint, pairs, renamed, run_pairs, used_target_ids,
                                                    with_model_prefix, write)


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


def _mlp(t, p, a, eps):
    x = _rms(a, t[f"{p}post_attention_layernorm.weight"], eps)
    gate, up = x @ t[f"{p}mlp.gate_proj.weight"].T, x @ t[f"{p}mlp.up_proj.weight"].T
    return (F.silu(gate) * up) @ t[f"{p}mlp.down_proj.weight"].T


def reference_eagle1(t, embed, lm_head, tokens, feats, eps=1e-6, theta=10000.0):
    """z = fc([e, f]); a = z + attn(z) (no input norm); m = a + mlp(norm(a)); logits = lm_head(m)."""
    p = "layers.0."
    z = F.linear(torch.cat([embed[tokens], feats], -1), t["fc.weight"], t.get("fc.bias"))
    a = z + _attention(t, p, z, HD, theta)
    m = a + _mlp(t, p, a, eps)
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
    # name: (layer prefix, embed, file format, `model.` prefix)
    "specforge-midlayer": ("midlayer.", False, "safetensors", False),
    "official-bin": ("midlayer.", False, "bin", False),
    "speculators-layers0-embed": ("layers.0.", True, "safetensors", False),
    "sglang-model-prefix": ("midlayer.", False, "safetensors", True),
}


@pytest.mark.parametrize("variant", EAGLE3_VARIANTS)
def test_eagle3_formats_load_and_run(variant, tmp_path, target):
    prefix, embed, fmt, sglang = EAGLE3_VARIANTS[variant]
    cfg, t = eagle3_checkpoint(5, embed=embed)
    cfg["eagle_aux_hidden_state_layer_ids"] = [1, 3, 6]
    t = renamed(t, "midlayer.", prefix)
    if prefix == "layers.0.":
        cfg["architectures"] = ["Eagle3Speculator"]
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
