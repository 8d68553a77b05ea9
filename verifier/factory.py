"""The verifier's one engine factory: the Ray actor (verifier/actor.py), the gRPC service
(verifier/service.py) and the in-process backend (router/local.py) all build it here."""

from __future__ import annotations

import sys

import torch

from spectandem.config import EngineConfig, SamplingParams
from spectandem.messages import DraftTree
from verifier.engine import VerifierEngine

# The profiling pass's verify width: nodes per request, at least any tree's (root included).
PROFILE_VERIFY_NODES = 64


def _progress(text: str) -> None:
    print(f"verifier: {text}", file=sys.stderr, flush=True)


def build_engine(config: EngineConfig, feature_layers=None, progress=_progress, warm_up: bool = True) -> VerifierEngine:
    """The target's engine: its runner (native or transformers) with `config.kv_blocks` of KV.
    `feature_layers`: the target features its results carry (None, "final" or HF hidden-state
    indices; the drafter's head decides: spectandem/feature_layers.py resolve_feature_layers). The loaded
    model is `engine.runner.model` (an in-process drafter shares its weights).
    On CUDA without `kv_blocks`, the native runner's pool is sized from the memory budget
    (`_size_pool`), on the CPU from `cpu_kv_cache_gib` (`_size_cpu_pool`), and with CUDA graphs every graph the engine replays is captured here
    (`warm_up_engine`; `warm_up` False leaves that to the caller, once it has set the runner's
    feature layers)."""
    from spectandem import memory
    from spectandem.checkpoint import read_config
    from verifier.runner import NativeRunner, load_runner

    if config.target_dir is None:
        raise ValueError("the verifier needs a target checkpoint directory (--target)")
    vocab = int(read_config(config.target_dir)["vocab_size"])
    sized = config.kv_blocks is None and config.device.startswith("cuda") and config.gpu_memory_utilization is not None
    on_cpu = config.kv_blocks is None and config.device == "cpu" and config.cpu_kv_cache_gib is not None
    before = memory.allocated_bytes(config.device) if sized else 0
    gpu = config.gpu.runner_kwargs()
    if sized:   # graphs come with the sized pool
        gpu["cuda_graphs"] = False
    runner, _ = load_runner(config.target_dir, feature_layers, config.max_slots, config.max_len, config.torch_dtype,
                            config.device, config.force_hf_target, 1 if sized or on_cpu else config.kv_blocks,
                            config.block_size, **gpu)
    if sized and isinstance(runner, NativeRunner):
        _size_pool(runner, config, vocab, memory.allocated_bytes(config.device) - before, progress)
    if on_cpu and isinstance(runner, NativeRunner):
        _size_cpu_pool(runner, config, progress)
    engine = VerifierEngine(runner, config.max_slots, vocab, decode_ahead=config.gpu.decode_ahead)
    if warm_up:
        warm_up_engine(engine, config, progress)
    return engine


def warm_up_engine(engine: VerifierEngine, config: EngineConfig, progress=_progress) -> None:
    """Captures the CUDA graphs of every verify the engine will run: trees of 1 to
    `config.spec`'s widest (root included), plain steps, graphed prefills. Nothing on the CPU."""
    if config.device.startswith("cuda"):
        engine.runner.warm_up(list(range(1, config.spec.max_draft_nodes + 2)), progress)


def _size_pool(runner, config: EngineConfig, vocab: int, weights: int, progress) -> None:
    """Gives `runner` the KV pool its memory budget holds: one profiling pass on a small pool
    (every slot's prefill of a PROFILE_PROMPT_TOKENS prompt, then a verify of
    PROFILE_VERIFY_NODES nodes per slot, sampled), its peak allocation measured, then the pool of
    the blocks the rest of the budget holds (at most every slot at full context)."""
    from spectandem import memory
    from spectandem.block_manager import blocks_for

    device = runner.device
    budget = memory.engine_budget(memory.device_total_bytes(device), config.gpu_memory_utilization,
                                  config.memory_budget_gib, config.memory_reserved_gib)
    nodes = min(PROFILE_VERIFY_NODES, runner.max_len // 2)
    prompt = max(1, min(memory.PROFILE_PROMPT_TOKENS, runner.max_len - nodes - 1))
    block_bytes = memory.kv_block_bytes(runner.spec.num_layers, runner.spec.num_kv_heads, runner.spec.head_dim,
                                        config.block_size, runner.dtype.itemsize)
    weights -= _pool_bytes(runner.cache)   # the one-block pool load_runner made
    runner.set_cache(config.max_slots * blocks_for(prompt + nodes + 1, config.block_size), config.block_size, False)
    peak = memory.measure_peak(lambda: _profile(VerifierEngine(runner, config.max_slots, vocab), config.max_slots,
                                                prompt, nodes), device)
    runner.set_cache(1, config.block_size, False)
    torch.cuda.empty_cache()
    cap = config.max_slots * blocks_for(runner.max_len + 1, config.block_size)
    sizing = memory.kv_blocks_for_budget(budget, weights, peak, block_bytes, cap)
    progress(sizing.describe("verifier"))
    memory.check_fits_one_request("verifier", sizing.blocks, config.block_size, runner.max_len,
                                  config.gpu_memory_utilization)
    runner.set_cache(sizing.blocks, config.block_size, config.gpu.runner_kwargs()["cuda_graphs"])


def _size_cpu_pool(runner, config: EngineConfig, progress) -> None:
    """Gives `runner` the KV pool `config.cpu_kv_cache_gib` holds on the CPU (at most every slot at
    full context)."""
    from spectandem import memory
    from spectandem.block_manager import blocks_for

    block_bytes = memory.kv_block_bytes(runner.spec.num_layers, runner.spec.num_kv_heads, runner.spec.head_dim,
                                        config.block_size, runner.dtype.itemsize)
    cap = config.max_slots * blocks_for(runner.max_len + 1, config.block_size)
    blocks = memory.cpu_kv_blocks("verifier", config.cpu_kv_cache_gib, block_bytes, cap, config.block_size,
                                  runner.max_len)
    if blocks < cap:
        progress(f"KV pool of {blocks * config.block_size} tokens ({config.cpu_kv_cache_gib:g} GiB, "
                 f"--cpu-kv-cache-gib); every request at full context would take {cap * config.block_size}")
    runner.set_cache(blocks, config.block_size, False)


def _pool_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for t in (*cache.k, *cache.v))


def _profile(engine: VerifierEngine, max_slots: int, prompt: int, nodes: int) -> None:
    """Every slot prefilled with a `prompt`-token prompt, then one sampled verify of a chain of
    `nodes` nodes per slot; the slots released."""
    ids = [f"profile-{i}" for i in range(max_slots)]
    params = [SamplingParams(temperature=1.0)] * max_slots
    engine.prefill(ids, [[1] * prompt] * max_slots, params, list(range(max_slots)))
    b, n = max_slots, nodes
    tree = DraftTree(request_ids=ids, committed_lens=[prompt + 1] * b,
                     token_ids=torch.ones(b, n, dtype=torch.long),
                     parents=torch.arange(-1, n - 1, dtype=torch.long).expand(b, n).clone(),
                     node_valid=torch.ones(b, n, dtype=torch.bool), scores=torch.zeros(b, n))
    engine.verify(tree)
    for rid in ids:
        engine.release(rid)
