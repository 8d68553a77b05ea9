"""The verifier's one engine factory: the Ray actor (verifier/actor.py), the gRPC service
(verifier/service.py) and the in-process backend (router/local.py) all build it here."""

from __future__ import annotations

from spectandem.config import EngineConfig
from verifier.engine import VerifierEngine


def build_engine(config: EngineConfig, feature_layers=None) -> VerifierEngine:
    """The target's engine: its runner (native or transformers) with `config.kv_blocks` of KV.
    `feature_layers`: the target features its results carry (None, "final" or HF hidden-state
    indices; the drafter's head decides: spectandem/feature_layers.py resolve_feature_layers). The loaded
    model is `engine.runner.model` (an in-process drafter shares its weights)."""
    from spectandem.checkpoint import read_config
    from verifier.runner import load_runner

    if config.target_dir is None:
        raise ValueError("the verifier needs a target checkpoint directory (--target)")
    runner, _ = load_runner(config.target_dir, feature_layers, config.max_slots, config.max_len, config.torch_dtype,
                            config.device, config.force_hf_target, config.kv_blocks, config.block_size,
                            **config.gpu.runner_kwargs())
    return VerifierEngine(runner, config.max_slots, int(read_config(config.target_dir)["vocab_size"]))
