"""Loading EAGLE-1/2 and EAGLE-3 draft heads from their public checkpoint formats.

Accepted:
- configs: flat HuggingFace-style config.json (official EAGLE, SGLang, SpecForge), and vLLM's
  speculators format for EAGLE-3 (`speculators_model_type: "eagle3"`, architecture
  `Eagle3Speculator`, a one-layer `llama` decoder's fields under `transformer_layer_config`, the
  head's own fields at the top level, `speculators_config.algorithm` "eagle3"; it must state
  `norm_before_residual`, which speculators and vLLM default differently);
- files: model.safetensors, or pytorch_model.bin through torch.load(weights_only=True);
- key prefixes: `midlayer.` (official / SpecForge EAGLE-3), `layers.0.` (EAGLE-1, speculators),
  each optionally under `model.`;
- `fc.bias` present or not (the bias is decided by the weights, cross-checked with `bias`);
- EAGLE-3 `d2t` offsets (target id = i + d2t[i]); `t2d` and speculators' `verifier_norm` /
  `verifier_lm_head` are ignored (training-only);
- auxiliary layers: top-level `eagle_aux_hidden_state_layer_ids` are HuggingFace hidden-state
  indices; `eagle_config.eagle_aux_hidden_state_layer_ids` (SpecForge/SGLang) count decoder-layer
  outputs from 0, so 1 is added; with neither, (2, L//2, L-3);
- embeddings (and the EAGLE-1 lm_head) come from the target when the file has none;
- `hidden_act`: silu (the default), swish, gelu, gelu_new, gelu_pytorch_tanh, relu;
- EAGLE-3 `norm_before_residual` (the residual is hidden_norm(u));
- `norm_output`, whose meaning depends on the format: SpecForge's (default true) false means no
  final norm before lm_head; speculators' (default false) true means the normed output is fed
  back to the next draft step. EAGLE-1 heads accept only SpecForge's false (they have no norm).
Refused with the field named: other activations, `norm_before_fc` / `fc_norm` true, speculators
configs of another model type, algorithm or decoder type, or with more than one layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from drafter.heads import HEAD_CLASSES, DraftHead, HeadSpec
from spectandem.checkpoint import CheckpointError, load_weights, read_config
from spectandem.feature_layers import aux_layers_from_config
from spectandem.modeling.layers import ACTIVATIONS, RopeSpec
from spectandem.modeling.llama import LlamaModel

@dataclass(frozen=True)
class TargetTensors:
    """What a head needs of its target: shapes, and the weights it may share (None: shapes only,
    what a draft model is checked against)."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    embed_tokens: torch.Tensor | None   # [V, Ht]
    lm_head: torch.Tensor | None        # [V, Ht]

    @staticmethod
    def of(model) -> "TargetTensors":
        """From the native LlamaModel or any transformers causal LM."""
        if isinstance(model, LlamaModel):
            s = model.spec
            return TargetTensors(s.vocab_size, s.hidden_size, s.num_layers,
                                 model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach())
        cfg = model.config
        return TargetTensors(int(cfg.vocab_size), int(cfg.hidden_size), int(cfg.num_hidden_layers),
                             model.get_input_embeddings().weight.detach(),
                             model.get_output_embeddings().weight.detach())

    @staticmethod
    def read(target_dir: str | Path, embed_tokens: torch.Tensor | None = None,
             lm_head: torch.Tensor | None = None) -> "TargetTensors":
        """From the target's config.json and its embeddings and lm_head as read alone
        (spectandem/modeling/target.py load_embeddings)."""
        cfg = read_config(target_dir)
        return TargetTensors(int(cfg["vocab_size"]), int(cfg["hidden_size"]), int(cfg["num_hidden_layers"]),
                             embed_tokens, lm_head)


_LAYER_PREFIXES = ("model.midlayer.", "model.layers.0.", "midlayer.", "layers.0.")
# Training-only tensors: the vocabulary mask and speculators' copies of the target's final norm
# and lm_head (the teacher of its training loss).
_IGNORED = ("t2d", "verifier_norm.weight", "verifier_lm_head.weight")
# speculators format: the head's own fields, at the top level beside `transformer_layer_config`.
_SPECULATORS_HEAD_FIELDS = ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids",
                            "norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def _normalise_keys(state: dict[str, torch.Tensor], path: str) -> dict[str, torch.Tensor]:
    """Maps checkpoint names onto the head's parameter names (`layer.*`, `fc.*`, ...)."""
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        name = key
        for prefix in _LAYER_PREFIXES:
            if key.startswith(prefix):
                name = "layer." + key[len(prefix):]
                break
        else:
            if name.startswith("model."):
                name = name[len("model."):]
        if name in _IGNORED or "rotary_emb" in name:
            continue
        if name.startswith("layers."):
            raise CheckpointError(f"{path}: tensor {key!r}: heads with more than one layer are not supported")
        out[name] = tensor
    return out


def detect_kind(state: dict[str, torch.Tensor], hidden: int, source: str = "checkpoint") -> str:
    """EAGLE-3 has 2H-wide q/k/v inputs; EAGLE-1 has fc [H, 2H] and H-wide q/k/v."""
    q = state.get("layer.self_attn.q_proj.weight")
    if q is None:
        raise CheckpointError(f"{source}: no self_attn.q_proj.weight found: not an EAGLE head")
    return "eagle3" if q.shape[1] == 2 * hidden else "eagle"


def is_speculators_config(cfg: dict) -> bool:
    """vLLM's speculators format: `speculators_model_type`, an `Eagle3Speculator` /
    `Eagle3DraftModel` architecture, or the decoder's fields nested under
    `transformer_layer_config`."""
    return ("speculators_model_type" in cfg or "transformer_layer_config" in cfg
            or bool({"Eagle3Speculator", "Eagle3DraftModel"} & set(cfg.get("architectures") or [])))


def flatten_speculators_config(cfg: dict, source: str = "config.json") -> dict:
    """A speculators-format EAGLE-3 config as one flat dict: the decoder fields of
    `transformer_layer_config` with the head's own top-level fields over them."""
    model_kind = cfg.get("speculators_model_type")
    if model_kind != "eagle3":
        raise CheckpointError(f"{source}: speculators_model_type {model_kind!r} is not supported (only 'eagle3')")
    algorithm = (cfg.get("speculators_config") or {}).get("algorithm", "eagle3")
    if algorithm != "eagle3":
        raise CheckpointError(f"{source}: speculators_config.algorithm {algorithm!r} is not supported (only 'eagle3')")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise CheckpointError(f"{source}: speculators format without a transformer_layer_config")
    if layer.get("model_type") != "llama":
        raise CheckpointError(f"{source}: transformer_layer_config.model_type {layer.get('model_type')!r} is not "
                              "supported (only 'llama' decoder layers)")
    if int(layer.get("num_hidden_layers", 1)) != 1:
        raise CheckpointError(f"{source}: transformer_layer_config.num_hidden_layers "
                              f"{layer['num_hidden_layers']}: heads with more than one layer are not supported")
    if "norm_before_residual" not in cfg:
        # speculators reads an absent field as false, vLLM as true: only the file can say.
        raise CheckpointError(f"{source}: speculators config without norm_before_residual")
    return {**layer, **{k: cfg[k] for k in _SPECULATORS_HEAD_FIELDS if k in cfg}}


def _flag(cfg: dict, name: str, default: bool, source: str, fmt: str = "") -> bool:
    value = cfg.get(name, default)
    if not isinstance(value, bool):
        raise CheckpointError(f"{source}: {name}{f' ({fmt} format)' if fmt else ''} must be true or false, "
                              f"not {value!r}")
    return value


def head_options(cfg: dict, kind: str, speculators: bool, source: str = "config.json") -> dict:
    """HeadSpec's computation options from a (flattened) head config, refusing what the heads
    cannot compute. `norm_output` has two meanings: in SpecForge configs (default true) false
    drops the final norm before lm_head; in speculators configs (default false) true feeds the
    normed output back to the next step."""
    act = cfg.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise CheckpointError(f"{source}: hidden_act {act!r} is not supported "
                              f"(supported: {', '.join(ACTIVATIONS)})")
    for name in ("norm_before_fc", "fc_norm"):
        if _flag(cfg, name, False, source):
            raise CheckpointError(f"{source}: {name}=true (a norm on the target features before fc) "
                                  "is not supported")
    before_residual = _flag(cfg, "norm_before_residual", False, source)
    if speculators:
        if kind != "eagle3":
            raise CheckpointError(f"{source}: speculators eagle3 config for an {kind} head")
        final_norm, normed_feedback = True, _flag(cfg, "norm_output", False, source, "speculators")
    else:
        final_norm, normed_feedback = _flag(cfg, "norm_output", True, source, "SpecForge"), False
    if kind == "eagle":
        if before_residual:
            raise CheckpointError(f"{source}: norm_before_residual=true on an EAGLE-1 head (it has no hidden_norm)")
        if "norm_output" in cfg and final_norm:
            raise CheckpointError(f"{source}: norm_output=true (SpecForge format: a final norm before lm_head) "
                                  "on an EAGLE-1 head, which has none")
        final_norm = True  # EAGLE-1 has no final norm at all: the flag is an EAGLE-3 option
    return {"hidden_act": act, "norm_before_residual": before_residual, "final_norm": final_norm,
            "normed_feedback": normed_feedback}


def load_head(directory: str | Path, target: "TargetTensors | LlamaModel", kind: str | None = None,
              dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu") -> DraftHead:
    """Loads a draft head for `target`. `kind` is "eagle" or "eagle3" (None: from the weights)."""
    directory = Path(directory)
    if not isinstance(target, TargetTensors):
        target = TargetTensors.of(target)
    cfg = read_config(directory)
    src = str(directory)
    speculators = is_speculators_config(cfg)
    if speculators:
        cfg = flatten_speculators_config(cfg, f"{directory / 'config.json'}")
    raw = load_weights(directory)
    state = _normalise_keys(raw, src)
    try:
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
    except KeyError as exc:
        raise CheckpointError(f"{directory / 'config.json'}: missing field {exc.args[0]!r}") from None
    detected = detect_kind(state, hidden, src)
    if kind is not None and kind != detected:
        raise CheckpointError(f"{src}: asked for an {kind} head but the weights are {detected}")
    options = head_options(cfg, detected, speculators, f"{directory / 'config.json'}")
    tspec = target
    vocab = int(cfg.get("vocab_size", tspec.vocab_size))
    if vocab != tspec.vocab_size:
        raise CheckpointError(f"{directory / 'config.json'}: vocab_size {vocab} does not match "
                              f"the target's {tspec.vocab_size}")
    target_hidden = int(cfg.get("target_hidden_size") or hidden)
    if target_hidden != tspec.hidden_size:
        raise CheckpointError(f"{directory / 'config.json'}: head expects target hidden size "
                              f"{target_hidden}, the target has {tspec.hidden_size}")
    if hidden != tspec.hidden_size and "embed_tokens.weight" not in state:
        raise CheckpointError(f"{src}: head hidden size {hidden} differs from the target's "
                              f"{tspec.hidden_size} and the file has no embed_tokens.weight")
    head_dim = int(cfg.get("head_dim") or hidden // heads)
    if detected == "eagle3":
        if (cfg.get("eagle_config") or {}).get("use_aux_hidden_state") is False:
            raise CheckpointError(f"{directory / 'config.json'}: use_aux_hidden_state=false heads are not supported")
        lm = state.get("lm_head.weight")
        draft_vocab = int(lm.shape[0]) if lm is not None else vocab
        aux = aux_layers_from_config(cfg, tspec.num_layers, f"{directory / 'config.json'}")
    else:
        draft_vocab, aux = vocab, ()
    spec = HeadSpec(
        kind=detected, hidden_size=hidden, target_hidden_size=target_hidden,
        intermediate_size=int(cfg["intermediate_size"]), num_heads=heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads), head_dim=head_dim,
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        rope=RopeSpec.from_config(cfg, head_dim, f"{directory / 'config.json'}"),
        vocab_size=vocab, draft_vocab_size=draft_vocab,
        # The weights decide the fc bias: configs that disagree with their files are common
        # (formats.md 1.1, SGLang #5773).
        fc_bias="fc.bias" in state, qkv_bias="layer.self_attn.q_proj.bias" in state,
        aux_layers=aux, **options,
    )
    head = HEAD_CLASSES[detected](spec)
    # Weights taken from the target where the format says so.
    state.setdefault("embed_tokens.weight", target.embed_tokens)
    if detected == "eagle" or "lm_head.weight" not in state:
        state["lm_head.weight"] = target.lm_head
    if detected == "eagle3" and "d2t" not in state and draft_vocab == vocab:
        state["d2t"] = torch.zeros(vocab, dtype=torch.int64)  # full vocabulary: identity mapping
    expected = head.state_dict()
    missing = sorted(expected.keys() - state.keys())
    unexpected = sorted(state.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointError(f"{src}: tensors do not match an {detected} head "
                              f"(missing {missing[:6]}, unexpected {unexpected[:6]})")
    for name, tensor in state.items():
        if tuple(tensor.shape) != tuple(expected[name].shape):
            raise CheckpointError(f"{src}: tensor {name} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(expected[name].shape)} from config.json")
    d2t = state["d2t"] if detected == "eagle3" else None
    if d2t is not None:
        ids = d2t + torch.arange(d2t.numel())
        if d2t.numel() and (ids.min() < 0 or ids.max() >= vocab):
            raise CheckpointError(f"{src}: d2t maps draft ids outside the target vocabulary 0..{vocab - 1}")
    head.load_state_dict({k: v.to(expected[k].dtype) if k != "d2t" else v for k, v in state.items()})
    head.rotary.inv_freq = spec.rope.inv_freq()
    head = head.to(device=device)
    for p in head.parameters():
        p.data = p.data.to(dtype)
    return head.eval()


def save_head(head: DraftHead, directory: str | Path, draft_length: int | None = None) -> None:
    """Writes `head` in its public format: config.json + model.safetensors, without the
    tensors taken from the target (embeddings, unless the head is narrower or wider than the
    target and so cannot share them; EAGLE-1 lm_head). EAGLE-3 uses the official
    `midlayer.` names, bf16 weights, int64 `d2t` and bool `t2d`; EAGLE-1 uses `layers.0.`.
    The config states `hidden_act`, and `norm_before_residual` / `norm_output` (SpecForge's
    meaning) where they differ from the defaults; a head with normed feedback has no field in
    this format and is refused. `draft_length`: the draft tokens per round the config states
    (speculators' `speculators_config.proposal_methods[0].speculative_tokens`), which serve then
    drafts by default; None states none."""
    import json

    from safetensors.torch import save_file

    spec = head.spec
    if spec.normed_feedback:
        raise ValueError("save_head: a head that feeds its normed output back (speculators' norm_output) "
                         "cannot be written in the flat EAGLE format")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    prefix = "midlayer." if spec.kind == "eagle3" else "layers.0."
    tensors: dict[str, torch.Tensor] = {}
    own_embedding = spec.hidden_size != spec.target_hidden_size  # load_head requires it then
    for name, tensor in head.state_dict().items():
        if (name == "embed_tokens.weight" and not own_embedding) or (spec.kind == "eagle" and name == "lm_head.weight"):
            continue
        key = prefix + name[len("layer."):] if name.startswith("layer.") else name
        tensors[key] = tensor.detach().to("cpu").contiguous()
        if tensor.is_floating_point():
            tensors[key] = tensors[key].to(torch.bfloat16)
    if spec.kind == "eagle3":
        used = head.d2t.cpu() + torch.arange(spec.draft_vocab_size)
        t2d = torch.zeros(spec.vocab_size, dtype=torch.bool)
        t2d[used] = True
        tensors["t2d"] = t2d
    save_file(tensors, str(directory / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3" if spec.kind == "eagle3" else "LlamaForCausalLMEagle"],
        "model_type": "llama",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": spec.hidden_act,
        "rms_norm_eps": spec.rms_norm_eps,
        "rope_theta": spec.rope.theta,
        "vocab_size": spec.vocab_size,
        "bias": spec.fc_bias,
        "torch_dtype": "bfloat16",
        "tie_word_embeddings": False,
    }
    if spec.kind == "eagle3":
        cfg["draft_vocab_size"] = spec.draft_vocab_size
        cfg["target_hidden_size"] = spec.target_hidden_size
        cfg["eagle_aux_hidden_state_layer_ids"] = list(spec.aux_layers)
        if spec.norm_before_residual:
            cfg["norm_before_residual"] = True
        if not spec.final_norm:
            cfg["norm_output"] = False
    if draft_length is not None:   # the depth serve drafts with by default (spectandem/checkpoint.py)
        cfg["speculators_config"] = {"proposal_methods": [{"proposal_type": "greedy",
                                                           "speculative_tokens": int(draft_length)}]}
    (directory / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
