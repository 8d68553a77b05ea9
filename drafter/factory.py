"""The drafter's one engine factory: the Ray actor (drafter/actor.py), the gRPC service
(drafter/service.py) and the in-process backend (router/local.py) all build it here."""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import replace

from drafter.engine import DrafterEngine, build_proposer
from spectandem.config import EngineConfig, SamplingParams, benchmark_warning
from spectandem.modeling.target import inspect_target, load_embeddings, load_target


log = logging.getLogger("spectandem.drafter")


def _progress(text: str) -> None:
    print(f"drafter: {text}", file=sys.stderr, flush=True)


def build_engine(config: EngineConfig, target=None, context: int | None = None,
                 progress=_progress) -> tuple[DrafterEngine, int]:
    """The drafter's engine for `config.spec`, with `config.draft_kv_blocks` of KV -> (engine,
    context length: the verifier's for the same target and max_len; 0 when n-gram drafting is
    given neither). `target`, `context`: the target model already loaded in this process (the
    verifier's, `engine.runner.model`, and its runner's max_len), whose weights EAGLE heads
    share; None reads what the method needs of the target here: embeddings and lm_head for EAGLE
    heads, the vocabulary size for a draft model, nothing for n-gram drafting.
    On CUDA without `draft_kv_blocks`, the KV pool is sized from the memory budget
    (`_sized_config`), and with CUDA graphs every graph the engine replays is captured here."""
    spec = config.spec
    if spec.method == "none":
        raise ValueError("--method none has no drafter")
    if target is None:
        target, context = _target_tensors(config)
    elif context is None:
        raise ValueError("a shared target model comes with its context length")
    config = _sized_config(config, target, context, progress)
    proposer = _proposer(config, target, context)
    if config.gpu.cuda_graphs:
        import torch

        t0, before = time.perf_counter(), torch.cuda.memory_reserved(config.device)
        if captured := proposer.warm_up(config.max_slots, progress):
            grown = (torch.cuda.memory_reserved(config.device) - before) / 2**30
            # Reserved memory can also shrink meanwhile (the allocator gives cached blocks back).
            memory = f", {grown:.2f} GiB" if grown >= 0.01 else ""
            progress(f"{captured} CUDA graphs captured in {time.perf_counter() - t0:.1f} s{memory}")
    if spec.benchmark_acceptance_rate is not None:
        proposer = _controlled(proposer, spec.benchmark_acceptance_rate, target)
    return DrafterEngine(proposer, spec), context


def _target_tensors(config: EngineConfig):
    """(what the method reads of the target, context length), read here from its checkpoint."""
    from drafter.loader import TargetTensors

    spec = config.spec
    if config.target_dir is None:
        if spec.method != "ngram":
            raise ValueError(f"--method {spec.method} needs --target (the head shares the target's weights)")
        return None, config.max_len or 0
    checkpoint = inspect_target(config.target_dir, config.max_len, config.force_hf_target)
    if spec.method == "ngram":            # n-gram drafting reads no target weights
        return None, checkpoint.max_len
    if spec.method == "draft-model":      # checked against the target's vocabulary only
        return TargetTensors.read(config.target_dir), checkpoint.max_len
    # EAGLE heads: the embeddings and lm_head, on the host (the head copies them to its device).
    tensors = load_embeddings(checkpoint, config.torch_dtype, "cpu")
    if tensors is None:   # an architecture whose tensor names only transformers knows
        return load_target(checkpoint, config.torch_dtype, "cpu"), checkpoint.max_len
    return TargetTensors.read(config.target_dir, *tensors), checkpoint.max_len


def _proposer(config: EngineConfig, target, context: int):
    return build_proposer(config.spec, target, config.draft_dir, config.max_slots, context, config.torch_dtype,
                          config.device, config.draft_kv_blocks, config.block_size, **config.gpu.proposer_kwargs())


def _sized_config(config: EngineConfig, target, context: int, progress) -> EngineConfig:
    """`config` with `draft_kv_blocks` set from the GPU memory budget: a proposer on a small
    pool is built and run once at the largest batch (every slot's catch-up, then a sampled
    draft of every slot), its peak allocation measured, and the blocks the rest of the budget
    holds (at most every slot at full context) chosen. On the CPU, the blocks
    `cpu_kv_cache_gib` holds (`_cpu_sized_config`). Unchanged with draft_kv_blocks given, and for
    n-gram drafting (no cache)."""
    if config.draft_kv_blocks is not None or config.spec.method == "ngram":
        return config
    if config.device == "cpu" and config.cpu_kv_cache_gib is not None:
        return _cpu_sized_config(config, target, context, progress)
    if not config.device.startswith("cuda") or config.gpu_memory_utilization is None:
        return config
    import torch

    from spectandem import memory

    device = torch.device(config.device)
    budget = memory.engine_budget(memory.device_total_bytes(device), config.gpu_memory_utilization,
                                  config.memory_budget_gib, config.memory_reserved_gib)
    spec = config.spec
    prompt = max(1, min(memory.PROFILE_PROMPT_TOKENS, context - spec.num_steps * max(spec.topk, 1) - 2))
    probe_blocks = memory.draft_pool_blocks(spec, config.max_slots, prompt + spec.num_steps + 2, config.block_size)
    before = memory.allocated_bytes(device)
    probe = _proposer(replace(config, draft_kv_blocks=probe_blocks, gpu=replace(config.gpu, cuda_graphs=False)),
                      target, context)
    block_bytes = cache_block_bytes(probe.cache)
    weights = memory.allocated_bytes(device) - before - probe_blocks * block_bytes
    peak = memory.measure_peak(lambda: _profile(DrafterEngine(probe, spec), probe, config.max_slots, prompt),
                               device)
    del probe
    torch.cuda.empty_cache()
    cap = memory.draft_pool_blocks(spec, config.max_slots, context, config.block_size)
    sizing = memory.kv_blocks_for_budget(budget, weights, peak, block_bytes, cap)
    progress(sizing.describe("drafter"))
    memory.check_fits_one_request("drafter", sizing.blocks, config.block_size, context,
                                  config.gpu_memory_utilization)
    return replace(config, draft_kv_blocks=sizing.blocks)


def _cpu_sized_config(config: EngineConfig, target, context: int, progress) -> EngineConfig:
    """`config` with `draft_kv_blocks` what `cpu_kv_cache_gib` holds (at most every slot at full
    context, with room for draft-ahead forks): a block's bytes read off a proposer on a one-block
    pool."""
    from spectandem import memory

    probe = _proposer(replace(config, draft_kv_blocks=1, gpu=replace(config.gpu, cuda_graphs=False)), target, context)
    block_bytes = cache_block_bytes(probe.cache)
    del probe
    cap = memory.draft_pool_blocks(config.spec, config.max_slots, context, config.block_size)
    blocks = memory.cpu_kv_blocks("drafter", config.cpu_kv_cache_gib, block_bytes, cap, config.block_size, context)
    if blocks < cap:
        progress(f"KV pool of {blocks * config.block_size} tokens ({config.cpu_kv_cache_gib:g} GiB, "
                 f"--cpu-kv-cache-gib); every request at full context would take {cap * config.block_size}")
    return replace(config, draft_kv_blocks=blocks)


def cache_block_bytes(cache) -> int:
    """Bytes of one block of a PagedKVCache (K and V, every layer)."""
    per_row = sum(t[0].numel() * t.element_size() for t in (*cache.k, *cache.v))
    return per_row * cache.block_size


def _profile(engine: DrafterEngine, proposer, max_slots: int, prompt: int) -> None:
    """Every slot's prompt caught up, then one sampled draft of every slot (q rows included)."""
    import torch

    head = proposer.head
    device = proposer.cache.k[0].device
    feats = None if head is None else torch.zeros(prompt, head.spec.feature_size, dtype=proposer.cache.k[0].dtype,
                                                  device=device)
    params = SamplingParams(temperature=1.0)
    ids = [f"profile-{i}" for i in range(max_slots)]
    engine.add_many([(rid, [1] * prompt, 1, params, i, feats, 0) for i, rid in enumerate(ids)])
    engine.draft(ids)
    for rid in ids:
        engine.remove(rid)


def _controlled(proposer, rate: float, target):
    """The benchmark-only proposer (drafter/controlled.py) around the real head: drafts of the
    outputs it has seen, right at `rate`."""
    from drafter.controlled import ControlledProposer, TruthBook
    from drafter.loader import TargetTensors

    log.warning(benchmark_warning(rate))
    tensors = target if isinstance(target, TargetTensors) else TargetTensors.of(target)
    return ControlledProposer(proposer, truths=TruthBook(rate, tensors.vocab_size))
