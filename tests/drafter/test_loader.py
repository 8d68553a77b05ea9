"""drafter.loader on synthetic checkpoints in every public EAGLE format
(../shared/reference/formats.md): each loads, runs, matches a hand-written forward, and every
malformed or unsafe directory is refused with a message naming it."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from drafter.heads import Eagle1Head, Eagle3Head
from drafter.loader import TargetTensors, aux_layers_from_config, load_head, save_head
from spectandem.checkpoint import CheckpointError, load_weights
from spectandem.kv_cache import KVCache
from spectandem.modeling.llama import load_llama

# Tiny target: 8 layers, so the default EAGLE-3 aux layers (2, L//2, L-3) = (2, 4, 5) are distinct.
V, HT, L = 96, 32, 8
# Draft head shapes (EAGLE heads copy the target's width; the MLP width is the head's own).
H, I, NH, NKV, HD = 32, 48, 4, 2, 8
VD = 40   # EAGLE-3 draft vocabulary


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=HT, intermediate_size=64, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("target")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(target_dir):
    return load_llama(target_dir)


# ---------------------------------------------------------------------------------------------
# Synthetic checkpoints, built from the key/shape tables of formats.md 1.2 and 2.2.

def _w(g: torch.Generator, *shape: int, scale: float = 0.2) -> torch.Tensor:
    return torch.randn(*shape, generator=g) * scale


def _norm(g: torch.Generator, n: int) -> torch.Tensor:
    return 1.0 + _w(g, n, scale=0.1)


def _layer(g, prefix: str, in_dim: int, *, hd: int = HD, qkv_bias: bool = False, input_norms: bool) -> dict:
    t = {
        f"{prefix}self_attn.q_proj.weight": _w(g, NH * hd, in_dim),
        f"{prefix}self_attn.k_proj.weight": _w(g, NKV * hd, in_dim),
        f"{prefix}self_attn.v_proj.weight": _w(g, NKV * hd, in_dim),
        f"{prefix}self_attn.o_proj.weight": _w(g, H, NH * hd),
        f"{prefix}mlp.gate_proj.weight": _w(g, I, H),
        f"{prefix}mlp.up_proj.weight": _w(g, I, H),
        f"{prefix}mlp.down_proj.weight": _w(g, H, I),
        f"{prefix}post_attention_layernorm.weight": _norm(g, H),
    }
    if qkv_bias:
        for p in ("q", "k", "v"):
            t[f"{prefix}self_attn.{p}_proj.bias"] = _w(g, t[f"{prefix}self_attn.{p}_proj.weight"].shape[0])
    if input_norms:
        t[f"{prefix}input_layernorm.weight"] = _norm(g, H)
        t[f"{prefix}hidden_norm.weight"] = _norm(g, H)
    return t


def eagle1_checkpoint(seed: int, *, fc_bias: bool, qkv_bias: bool = False, embed: bool = False) -> tuple[dict, dict]:
    """(config, tensors) of an official EAGLE-1 head: `layers.0.*` without input_layernorm,
    fc [H, 2H] (columns: [embedding, feature]), no lm_head, no final norm."""
    g = torch.Generator().manual_seed(seed)
    t = {"fc.weight": _w(g, H, 2 * H)}
    if fc_bias:
        t["fc.bias"] = _w(g, H)
    t.update(_layer(g, "layers.0.", H, qkv_bias=qkv_bias, input_norms=False))
    if embed:
        t["embed_tokens.weight"] = _w(g, V, H)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "num_hidden_layers": 1, "vocab_size": V, "rms_norm_eps": 1e-6, "bias": fc_bias,
           "max_position_embeddings": 64, "torch_dtype": "float16"}
    if qkv_bias:
        cfg["qkv_bias"] = True
    return cfg, t


def used_target_ids(seed: int, n: int = VD) -> torch.Tensor:
    """The Vd target ids a draft vocabulary keeps, sorted ascending (formats.md 2.5)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(V, generator=g)[:n].sort().values


def eagle3_checkpoint(seed: int, *, prefix: str = "midlayer.", embed: bool = False,
                      head_dim: int | None = None) -> tuple[dict, dict]:
    """(config, tensors) of an EAGLE-3 head: fc [H, 3Ht], q/k/v [*, 2H], own norm + lm_head
    [Vd, H], d2t int64 offsets (d2t[i] = used[i] - i), t2d bool membership."""
    g = torch.Generator().manual_seed(seed)
    hd = head_dim or HD
    used = used_target_ids(seed)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[used] = True
    t = {"fc.weight": _w(g, H, 3 * HT)}
    t.update(_layer(g, prefix, 2 * H, hd=hd, input_norms=True))
    t.update({"norm.weight": _norm(g, H), "lm_head.weight": _w(g, VD, H),
              "d2t": used - torch.arange(VD), "t2d": t2d})
    if embed:
        t["embed_tokens.weight"] = _w(g, V, H)
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
           "intermediate_size": I, "num_attention_heads": NH, "num_key_value_heads": NKV,
           "num_hidden_layers": 1, "vocab_size": V, "draft_vocab_size": VD, "rms_norm_eps": 1e-5,
           "rope_theta": 5000.0, "max_position_embeddings": 64, "tie_word_embeddings": False}
    if head_dim is not None:
        cfg["head_dim"] = head_dim
    return cfg, t


def write(directory: Path, cfg: dict, tensors: dict, fmt: str = "safetensors") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(cfg))
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    else:
        torch.save(dict(tensors), directory / "pytorch_model.bin")
    return directory


def renamed(tensors: dict, old: str, new: str) -> dict:
    return {(new + k[len(old):] if k.startswith(old) else k): v for k, v in tensors.items()}


def with_model_prefix(tensors: dict) -> dict:
    """SGLang re-packagings: every tensor under `model.`."""
    return {"model." + k: v for k, v in tensors.items()}


# ---------------------------------------------------------------------------------------------
# Running a head the way EagleProposer.catch_up does: pairs (feature p, token p + 1) at position p.

def run_pairs(head, token_ids: torch.Tensor, features: torch.Tensor, chunks: tuple[int, ...]):
    """token_ids [T], features [T, F] -> (output hidden [T, H], logits [T, Vd]), fed in causal
    chunks over one KV cache slot (every row is a query row)."""
    s = head.spec
    cache = KVCache(1, 2, s.num_kv_heads, 64, s.head_dim, torch.float32)
    slot = torch.tensor([1])
    outs, base = [], 0
    with torch.no_grad():
        for n in chunks:
            pos = torch.arange(base, base + n)[None]                                  # [1, n]
            span = base + n
            mask = torch.arange(span)[None, None, :] <= pos[:, :, None]              # [1, n, span]
            rows = torch.arange(n)[None]
            out = head.run(token_ids[None, base:base + n], head.project(features[None, base:base + n]),
                           pos, cache.batch(slot, pos, span), mask, rows)
            outs.append(out[0])
            base += n
    out = torch.cat(outs)
    return out, head.logits(out)


def pairs(seed: int, feature_size: int, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (t,), generator=g), torch.randn(t, feature_size, generator=g)


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


# ---------------------------------------------------------------------------------------------
# Refusals: each names the file or directory and says what is wrong.


def _raises_naming(path: Path, *words: str, call):
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return err.value


def test_refuses_head_vocab_other_than_targets(tmp_path, target):
    cfg, t = eagle1_checkpoint(15, fc_bias=True)
    cfg["vocab_size"] = V + 4
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d / "config.json", "vocab_size", str(V + 4), str(V), call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


@pytest.mark.parametrize("field,value", [("hidden_size", 2 * H), ("target_hidden_size", 2 * HT)])
def test_refuses_head_width_other_than_targets(field, value, tmp_path, target):
    cfg, t = eagle3_checkpoint(16)
    cfg[field] = value
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d / "config.json", "hidden size", str(value), str(HT), call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


def test_refuses_missing_config(tmp_path, target):
    cfg, t = eagle3_checkpoint(17)
    d = write(tmp_path, cfg, t)
    (d / "config.json").unlink()
    e = _raises_naming(d / "config.json", "missing config.json", call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)
    _raises_naming(tmp_path / "absent", "not a directory", call=lambda: load_head(tmp_path / "absent", target))


def test_refuses_missing_weights(tmp_path, target):
    cfg, _ = eagle3_checkpoint(18)
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    e = _raises_naming(d, "no weights", call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


@pytest.mark.parametrize("key,shape", [("midlayer.self_attn.k_proj.weight", (NKV * HD + 1, 2 * H)),
                                       ("fc.weight", (H, 2 * HT)),
                                       ("lm_head.weight", (VD, H + 2))])
def test_refuses_tensor_of_wrong_shape(key, shape, tmp_path, target):
    cfg, t = eagle3_checkpoint(19)
    t[key] = torch.zeros(shape)
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d, "shape", str(tuple(shape)), key.split(".", 1)[1] if key.startswith("midlayer.") else key,
                       call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


def test_refuses_unknown_target_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                               "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": V}))
    _raises_naming(d, "GPT2LMHeadModel", "no native implementation", call=lambda: load_llama(d))


class _Exploit:
    """Pickles as a call to os.system: loading it with plain pickle would run the command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_refuses_bin_that_holds_code(tmp_path, target):
    marker = tmp_path / "pwned.txt"
    cfg, t = eagle1_checkpoint(20, fc_bias=True)
    d = write(tmp_path / "evil", cfg, {}, "bin")
    torch.save({**t, "fc.weight": _Exploit(marker)}, d / "pytorch_model.bin")
    with zipfile.ZipFile(d / "pytorch_model.bin") as z:  # the pickle really calls os.system
        assert b"system" in z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert not marker.exists()

    e = _raises_naming(d / "pytorch_model.bin", "refused", call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)
    _raises_naming(d / "pytorch_model.bin", "refused", call=lambda: load_weights(d))
    assert not marker.exists()


def test_refuses_weights_without_an_eagle_layer(tmp_path, target):
    cfg, t = eagle3_checkpoint(25)
    d = write(tmp_path, cfg, {k: v for k, v in t.items() if "q_proj" not in k})
    _raises_naming(d, "q_proj", "not an EAGLE head", call=lambda: load_head(d, target))


def test_refuses_aux_layers_outside_the_target(tmp_path, target):
    cfg, t = eagle3_checkpoint(26)
    d = write(tmp_path, {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, L]}}, t)
    _raises_naming(d / "config.json", f"auxiliary layer {L + 1}", call=lambda: load_head(d, target))


def test_refuses_bin_that_is_not_a_dict_of_tensors(tmp_path, target):
    cfg, t = eagle1_checkpoint(21, fc_bias=True)
    d = write(tmp_path, cfg, {**t, "step": 3}, "bin")
    _raises_naming(d / "pytorch_model.bin", "dict of tensors", call=lambda: load_head(d, target))


def test_refuses_corrupt_safetensors(tmp_path, target):
    cfg, _ = eagle3_checkpoint(22)
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _raises_naming(d / "model.safetensors", "safetensors", call=lambda: load_head(d, target))


# ---------------------------------------------------------------------------------------------
# save_head writes the public format (bf16); what it writes loads back to the same head.


def _bf16_exact(t: dict) -> dict:
    return {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in t.items()}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_save_head_round_trip(kind, tmp_path, target):
    if kind == "eagle":
        cfg, t = eagle1_checkpoint(23, fc_bias=True, qkv_bias=True)
    else:
        cfg, t = eagle3_checkpoint(23, head_dim=16)
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}
    head = load_head(write(tmp_path / "src", cfg, _bf16_exact(t)), target)
    save_head(head, tmp_path / "saved")
    again = load_head(tmp_path / "saved", target)

    assert again.spec == head.spec
    saved = load_weights(tmp_path / "saved")
    assert "embed_tokens.weight" not in saved
    if kind == "eagle3":
        assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
        assert torch.equal(saved["t2d"], t["t2d"]) and torch.equal(saved["d2t"], t["d2t"])
        assert all(k.startswith(("midlayer.", "fc.", "norm.", "lm_head.", "d2t", "t2d")) for k in saved)
    else:
        assert "lm_head.weight" not in saved and all(k.startswith(("layers.0.", "fc.")) for k in saved)
    tokens, feats = pairs(24, head.spec.feature_size)
    out, logits = run_pairs(head, tokens, feats, chunks=(3, 4))
    out2, logits2 = run_pairs(again, tokens, feats, chunks=(3, 4))
    assert torch.equal(out, out2) and torch.equal(logits, logits2)


def test_target_tensors_of_native_and_transformers_models(target_dir, target):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32)
    a, b = TargetTensors.of(target), TargetTensors.of(hf)
    assert (a.vocab_size, a.hidden_size, a.num_layers) == (b.vocab_size, b.hidden_size, b.num_layers) == (V, HT, L)
    assert torch.equal(a.embed_tokens, b.embed_tokens) and torch.equal(a.lm_head, b.lm_head)
