"""The drafter's one engine factory: the Ray actor (drafter/actor.py), the gRPC service
(drafter/service.py) and the in-process backend (router/local.py) all build it here."""

from __future__ import annotations

import logging

from drafter.engine import DrafterEngine, build_proposer
from spectandem.config import EngineConfig, benchmark_warning
from spectandem.modeling.target import inspect_target, load_target

log = logging.getLogger("spectandem.drafter")


def build_engine(config: EngineConfig, target=None, context: int | None = None) -> tuple[DrafterEngine, int]:
    """The drafter's engine for `config.spec`, with `config.draft_kv_blocks` of KV -> (engine,
    context length: the verifier's for the same target and max_len; 0 when n-gram drafting is
    given neither). `target`, `context`: the target model already loaded in this process (the
    verifier's, `engine.runner.model`, and its runner's max_len), whose weights EAGLE heads
    share; None loads the target here (spectandem/modeling/target.py)."""
    spec = config.spec
    if spec.method == "none":
        raise ValueError("--method none has no drafter")
    if target is None:
        context = config.max_len or 0
        if spec.method != "ngram":
            if config.target_dir is None:
                raise ValueError(f"--method {spec.method} needs --target (the head shares the target's weights)")
            checkpoint = inspect_target(config.target_dir, config.max_len, config.force_hf_target)
            target, context = load_target(checkpoint, config.torch_dtype, config.device), checkpoint.max_len
        elif config.target_dir is not None:   # n-gram drafting reads no target weights
            context = inspect_target(config.target_dir, config.max_len, config.force_hf_target).max_len
    elif context is None:
        raise ValueError("a shared target model comes with its context length")
    proposer = build_proposer(spec, target, config.draft_dir, config.max_slots, context, config.torch_dtype,
                              config.device, config.draft_kv_blocks, config.block_size,
                              **config.gpu.proposer_kwargs())
    if spec.benchmark_acceptance_rate is not None:
        proposer = _controlled(proposer, spec.benchmark_acceptance_rate, target)
    return DrafterEngine(proposer, spec), context


def _controlled(proposer, rate: float, target):
    """The benchmark-only proposer (drafter/controlled.py) around the real head: drafts of the
    outputs it has seen, right at `rate`."""
    from drafter.controlled import ControlledProposer, TruthBook
    from drafter.loader import TargetTensors

    log.warning(benchmark_warning(rate))
    return ControlledProposer(proposer, truths=TruthBook(rate, TargetTensors.of(target).vocab_size))
