"""Synthetic checkpoints of the drafter.loader tests, built from the key/shape tables of
the public EAGLE-1/2 and EAGLE-3 checkpoints (drafter/loader.py) for a tiny target, and a head run
over them the way EagleProposer.catch_up runs it."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from spectandem.kv_cache import KVCache

# Tiny target: 8 layers, so the default EAGLE-3 aux layers (2, L//2, L-3) = (2, 4, 5) are distinct.
V, HT, L = 96, 32, 8
# Draft head shapes (EAGLE heads copy the target's width; the MLP width is the head's own).
H, I, NH, NKV, HD = 32, 48, 4, 2, 8
VD = 40   # EAGLE-3 draft vocabulary


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


def speculators_checkpoint(seed: int, *, norm_before_residual: bool, hidden_act: str | None = None,
                           norm_output: bool = False, aux_ids: list[int] | None = None) -> tuple[dict, dict]:
    """(config, tensors) of an EAGLE-3 head in vLLM's speculators format, laid out as
    Eagle3SpeculatorConfig serialises it: the decoder's fields under `transformer_layer_config`
    (a one-layer LlamaConfig whose vocab_size is the target's), the head's own fields at the top
    level, `speculators_config` naming the algorithm and verifier; tensors under `layers.0.`
    with the embedding included."""
    flat, t = eagle3_checkpoint(seed, embed=True)
    t = renamed(t, "midlayer.", "layers.0.")
    layer = {k: v for k, v in flat.items() if k not in ("architectures", "draft_vocab_size")}
    layer.update(architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
                 mlp_bias=False, head_dim=HD, torch_dtype="float32")
    if hidden_act is not None:
        layer["hidden_act"] = hidden_act
    cfg = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "speculators_version": "0.3.0",
        "transformer_layer_config": layer, "draft_vocab_size": VD, "norm_before_residual": norm_before_residual,
        "target_hidden_size": None, "eagle_aux_hidden_state_layer_ids": aux_ids, "norm_before_fc": False,
        "fc_norm": False, "norm_output": norm_output, "embed_requires_grad": False, "torch_dtype": "float32",
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "tiny-llama-target", "architectures": ["LlamaForCausalLM"]},
        },
    }
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


def run_pairs_then_step(head, token_ids: torch.Tensor, features: torch.Tensor, next_token: int):
    """run_pairs over all T pairs in one chunk, then one draft step the way EagleProposer runs
    it: the last row's output hidden fed back with `next_token` at position T over the same
    cache. Returns (output hidden [T, H], logits [T, Vd], step hidden [H], step logits [Vd])."""
    s = head.spec
    t = token_ids.numel()
    cache = KVCache(1, 2, s.num_kv_heads, 64, s.head_dim, torch.float32)
    slot, rows = torch.tensor([1]), torch.arange(t)[None]
    with torch.no_grad():
        pos = torch.arange(t)[None]
        mask = torch.arange(t)[None, None, :] <= pos[:, :, None]
        out = head.run(token_ids[None], head.project(features[None]), pos, cache.batch(slot, pos, t), mask, rows)[0]
        pos = torch.tensor([[t]])
        step = head.run(torch.tensor([[next_token]]), out[None, -1:], pos, cache.batch(slot, pos, t + 1),
                        torch.ones(1, 1, t + 1, dtype=torch.bool), torch.zeros(1, 1, dtype=torch.int64))[0, 0]
        return out, head.logits(out), step, head.logits(step)


def pairs(seed: int, feature_size: int, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (t,), generator=g), torch.randn(t, feature_size, generator=g)
