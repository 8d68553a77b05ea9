"""Reading HuggingFace-format directories from local disk: config.json, weights and
tokenizer. Weights load only from safetensors or `torch.load(weights_only=True)`; nothing is
ever downloaded.
"""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import torch


class CheckpointError(ValueError):
    """A checkpoint directory or file is missing, malformed or unsafe; the message names it."""


def read_config(directory: str | Path) -> dict:
    path = Path(directory) / "config.json"
    if not Path(directory).is_dir():
        raise CheckpointError(f"{directory}: not a directory (models load from local directories only)")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None


def declared_draft_length(config: dict, source: str = "config.json") -> int | None:
    """The draft tokens per round a draft head's config states, as the speculators format states
    them (`speculators_config.proposal_methods[0].speculative_tokens`, the number vLLM serves
    such a head with unless told otherwise); None where the config states none. A stated value
    that is not a positive integer is refused, with the field named."""
    methods = (config.get("speculators_config") or {}).get("proposal_methods")
    if not methods:
        return None
    if not isinstance(methods, list) or not isinstance(methods[0], dict):
        raise CheckpointError(f"{source}: speculators_config.proposal_methods must be a list of objects")
    value = methods[0].get("speculative_tokens")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{source}: speculators_config.proposal_methods[0].speculative_tokens must be an "
                              f"integer >= 1, got {value!r}")
    return value


def eos_token_ids(config: dict) -> tuple[int, ...]:
    """A checkpoint config's `eos_token_id` (one id, a list of them, or none) as a tuple."""
    eos = config.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(int(e) for e in eos) if isinstance(eos, list) else (int(eos),)


def load_bin(path: Path) -> dict[str, torch.Tensor]:
    """A PyTorch pickle, loaded with weights_only=True: tensors only, never code."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, AttributeError, EOFError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: refused to load (only plain tensors are accepted; "
                              f"weights_only unpickling failed: {first})") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise CheckpointError(f"{path}: expected a dict of tensors")
    return state


def load_safetensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(path), device="cpu")
    except Exception as exc:  # safetensors raises its own error types; name the file
        raise CheckpointError(f"{path}: cannot read safetensors ({exc})") from None


def load_weights(directory: str | Path, prefer: tuple[str, ...] = ("safetensors", "bin")) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint directory: model.safetensors, sharded safetensors with an
    index, or pytorch_model.bin (weights_only)."""
    d = Path(directory)
    candidates = {
        "safetensors": sorted(d.glob("*.safetensors")),
        "bin": [p for p in (d / "pytorch_model.bin",) if p.is_file()] + sorted(d.glob("pytorch_model-*.bin")),
    }
    for kind in prefer:
        files = candidates[kind]
        if not files:
            continue
        state: dict[str, torch.Tensor] = {}
        for f in files:
            state.update(load_safetensors(f) if kind == "safetensors" else load_bin(f))
        return state
    raise CheckpointError(f"{d}: no weights found (looked for *.safetensors and pytorch_model.bin)")


def load_tokenizer(directory: str | Path):
    from tokenizers import Tokenizer

    path = Path(directory) / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: missing tokenizer.json")
    return Tokenizer.from_file(str(path))
