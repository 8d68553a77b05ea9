"""Loading a target checkpoint: the native Llama-family model where the architecture has one,
transformers' otherwise, and the context length both engines use for it.

The verifier's runners (verifier/runner.py) wrap the model; the drafter takes embeddings and
lm_head from it (EAGLE heads) and the same context length, so the two sides agree on both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from spectandem.checkpoint import read_config
from spectandem.modeling.llama import NATIVE_ARCHITECTURES, LlamaSpec, load_llama


@dataclass(frozen=True)
class TargetCheckpoint:
    """What the target's config says, before any weight is read."""

    path: str
    architecture: str
    native: bool                   # runs on the native model (else transformers)
    max_len: int                   # the context: max_len capped by the checkpoint's (and its sliding window)


def inspect_target(target_dir: str | Path, max_len: int | None, force_hf: bool = False) -> TargetCheckpoint:
    """The target's architecture, runtime and context length, from config.json alone. Within a
    sliding window, sliding-window attention is full attention: capping the context there keeps
    the native path exact without a windowed mask."""
    cfg = read_config(target_dir)
    arch = (cfg.get("architectures") or [""])[0]
    context = int(cfg.get("max_position_embeddings", 2048))
    max_len = min(max_len or context, context)
    native = arch in NATIVE_ARCHITECTURES and not force_hf
    if native:
        window = LlamaSpec.from_config(cfg, f"{target_dir}/config.json").sliding_window
        if window:
            max_len = min(max_len, window)
    return TargetCheckpoint(str(target_dir), arch, native, max_len)


def load_target(target: TargetCheckpoint, dtype: torch.dtype = torch.float32, device: str = "cpu"):
    """The model: native LlamaModel, or transformers' AutoModelForCausalLM in eval mode."""
    if target.native:
        return load_llama(target.path, dtype, device)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(target.path, dtype=dtype, local_files_only=True)
    except (ValueError, OSError, KeyError) as exc:
        raise ValueError(f"{target.path}: cannot load architecture {target.architecture!r} ({exc})") from None
    return model.to(device).eval()


def embedding_names(target: TargetCheckpoint) -> tuple[str, str] | None:
    """The checkpoint names of the input embeddings and lm_head, where the architecture fixes
    them (the native Llama family); None otherwise."""
    if target.architecture in NATIVE_ARCHITECTURES:
        return "model.embed_tokens.weight", "lm_head.weight"
    return None


def load_embeddings(target: TargetCheckpoint, dtype: torch.dtype = torch.float32,
                    device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor] | None:
    """(input embeddings [V, H], lm_head [V, H]) read alone from the checkpoint's files, without
    the decoder layers; tied embeddings (or no lm_head tensor) give the embeddings twice. None
    where the names are not known (`embedding_names`): then the whole model must load."""
    from spectandem.checkpoint import CheckpointError, load_weights

    names = embedding_names(target)
    if names is None:
        return None
    cfg = read_config(target.path)
    tied = bool(cfg.get("tie_word_embeddings", False))
    wanted = names[:1] if tied else names
    found = _read_tensors(Path(target.path), wanted)
    if found is None:   # no safetensors: a PyTorch pickle loads whole, on the host
        state = load_weights(target.path)
        found = {n: state[n] for n in wanted if n in state}
    if names[0] not in found:
        raise CheckpointError(f"{target.path}: no tensor {names[0]!r} (the input embeddings)")
    embed = found[names[0]].to(device=device, dtype=dtype)
    lm_head = embed if tied or names[1] not in found else found[names[1]].to(device=device, dtype=dtype)
    return embed, lm_head


def _read_tensors(directory: Path, names: tuple[str, ...]) -> dict[str, torch.Tensor] | None:
    """These tensors from the directory's safetensors files (each file opened only for what it
    holds); None where it has none."""
    from safetensors import safe_open

    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return None
    out: dict[str, torch.Tensor] = {}
    from spectandem.checkpoint import CheckpointError

    for path in files:
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                keys = set(f.keys())
                for name in names:
                    if name in keys and name not in out:
                        out[name] = f.get_tensor(name)
        except Exception as exc:  # safetensors raises its own error types; name the file
            raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from None
    return out
