"""Which target features a draft head reads: None (no head), "final" (EAGLE-1: the last hidden
state) or HuggingFace hidden-state indices (EAGLE-3's auxiliary layers). The verifier returns
those features; the drafter's head is built to read them; both resolve them here, from the
configs alone, so they agree without loading weights.
"""

from __future__ import annotations

from pathlib import Path

from spectandem.checkpoint import read_config
from spectandem.codec import feature_layers_from_str


def aux_layers_from_config(cfg: dict, num_target_layers: int, source: str = "config.json") -> tuple[int, ...]:
    """Auxiliary target layers as HuggingFace hidden-state indices, ascending."""
    if cfg.get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    elif (cfg.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids") is not None:
        ids = [int(i) + 1 for i in cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]]
    else:
        n = num_target_layers
        ids = [2, n // 2, n - 3]
    for i in ids:
        if not 0 <= i <= num_target_layers:
            raise ValueError(f"{source}: auxiliary layer {i} is outside the target's hidden states "
                             f"0..{num_target_layers}")
    return tuple(sorted(ids))


def resolve_feature_layers(feature_layers: str | None, method: str, draft_dir: str | Path | None,
                           target_dir: str | Path):
    """What the drafter reads: None, "final" or HF hidden-state indices. An explicit
    `feature_layers` string wins; else the method decides (EAGLE-3: the head's auxiliary layers,
    read from its config.json without loading weights)."""
    if feature_layers is not None:
        return feature_layers_from_str(feature_layers)
    if method == "eagle":
        return "final"
    if method != "eagle3":
        return None
    if draft_dir is None:
        raise ValueError("--method eagle3 needs --draft (to read the head's auxiliary layers) or --feature-layers")
    num_layers = int(read_config(target_dir)["num_hidden_layers"])
    return aux_layers_from_config(read_config(draft_dir), num_layers, str(Path(draft_dir) / "config.json"))
