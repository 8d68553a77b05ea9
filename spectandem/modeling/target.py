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
