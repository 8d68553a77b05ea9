"""GPU memory budgets and KV pool sizing (`--gpu-memory-utilization`, vLLM's meaning: the
fraction of the GPU's total memory the server may use); on the CPU, each engine's pool is the
KV space `--cpu-kv-cache-gib` gives it (`cpu_kv_blocks`).

The arithmetic is in pure functions over byte counts; the engines (verifier/factory.py,
drafter/factory.py) measure their weights and one profiling pass and call them. Each engine
sizes from its own numbers only: on a GPU both engines share, serve computes the drafter's
need from its configs before either starts (`drafter_need_bytes`), gives the drafter that as
its budget and tells the verifier to leave it aside (`--memory-reserved-gib`), so neither ever
reads what the other happens to hold. That need is a pool of as many tokens as the verifier's
will hold (`shared_kv_tokens`): the drafter holds a token of every request the verifier holds.

An engine's budget is spent as: weights + peak activations of the profiling pass + a reserve
for the CUDA context, cuBLAS workspaces and the allocator's slack (RUNTIME_RESERVE_BYTES) + a
reserve for CUDA graph pools (GRAPH_RESERVE_FRACTION of the budget) + the KV pool, which takes
the rest, capped at every slot at full context (more could never be used).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

GIB = 1 << 30
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
RUNTIME_RESERVE_BYTES = 1 * GIB     # CUDA context, cuBLAS/cuDNN workspaces, allocator slack (per process)
GRAPH_RESERVE_FRACTION = 0.05       # CUDA graph pools, of the engine's budget
# The profiling pass's prompts: every slot's prefill / catch-up at this many tokens (at most the
# context), then one round at the widest tree. Longer prompts prefill densely and need more.
PROFILE_PROMPT_TOKENS = 512
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}


def blocks_for(num_entries: int, block_size: int) -> int:
    return -(-num_entries // block_size)


def kv_block_bytes(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype_bytes: int) -> int:
    """Bytes of one KV block: K and V of `block_size` entries in every layer."""
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes


def check_utilization(utilization: float) -> None:
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {utilization}")


def engine_budget(total_bytes: int, utilization: float, budget_gib: float | None = None,
                  reserved_gib: float = 0.0) -> int:
    """The bytes one engine may use on its GPU: `budget_gib` where given (serve hands the drafter
    its share so), else utilization x the GPU's total less `reserved_gib` (another engine's share
    of the same GPU)."""
    check_utilization(utilization)
    if budget_gib is not None:
        if budget_gib <= 0:
            raise ValueError(f"--memory-budget-gib must be > 0, got {budget_gib}")
        return int(budget_gib * GIB)
    if reserved_gib < 0:
        raise ValueError(f"--memory-reserved-gib must be >= 0, got {reserved_gib}")
    budget = int(utilization * total_bytes) - int(reserved_gib * GIB)
    if budget <= 0:
        raise ValueError(f"--gpu-memory-utilization {utilization} of {total_bytes / GIB:.1f} GiB leaves nothing "
                         f"after the {reserved_gib:.2f} GiB reserved for the other engine on this GPU")
    return budget


def split_budget(total_bytes: int, utilization: float, drafter_need: int) -> tuple[int, int]:
    """Both engines on one GPU: (verifier's bytes, drafter's bytes) of utilization x total. The
    drafter gets what it needs (`drafter_need_bytes`), the verifier the rest."""
    check_utilization(utilization)
    total = int(utilization * total_bytes)
    if drafter_need >= total:
        raise ValueError(f"the drafter needs {drafter_need / GIB:.2f} GiB, more than --gpu-memory-utilization "
                         f"{utilization} of {total_bytes / GIB:.1f} GiB ({total / GIB:.2f} GiB)")
    return total - drafter_need, drafter_need


@dataclass(frozen=True)
class KvSizing:
    """How an engine's budget was spent (bytes), and the KV blocks it gives."""

    budget: int
    weights: int
    peak_activations: int
    runtime_reserve: int
    graph_reserve: int
    block_bytes: int
    cap_blocks: int
    blocks: int

    def describe(self, role: str) -> str:
        g = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
        return (f"{role} memory: budget {g(self.budget)} = weights {g(self.weights)} + activations "
                f"{g(self.peak_activations)} + runtime reserve {g(self.runtime_reserve)} + CUDA graph reserve "
                f"{g(self.graph_reserve)} + KV {g(self.blocks * self.block_bytes)} ({self.blocks} blocks of "
                f"{self.block_bytes / (1 << 20):.2f} MiB; every slot at full context would take {self.cap_blocks})")


def kv_blocks_for_budget(budget: int, weights: int, peak_activations: int, block_bytes: int, cap_blocks: int,
                         runtime_reserve: int = RUNTIME_RESERVE_BYTES,
                         graph_fraction: float = GRAPH_RESERVE_FRACTION) -> KvSizing:
    """The KV blocks that fit in `budget` after weights, the profiling pass's peak activations and
    the reserves; at most `cap_blocks` (every slot at full context), at least 0."""
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    graph_reserve = int(graph_fraction * budget)
    free = budget - weights - peak_activations - runtime_reserve - graph_reserve
    blocks = max(0, min(cap_blocks, free // block_bytes))
    return KvSizing(budget, weights, peak_activations, runtime_reserve, graph_reserve, block_bytes, cap_blocks,
                    blocks)


def check_fits_one_request(role: str, blocks: int, block_size: int, max_len: int, utilization: float) -> None:
    """Refuses a pool that cannot hold one request at the full context."""
    need = blocks_for(max_len + 1, block_size)
    if blocks < need:
        raise ValueError(f"{role}: the GPU memory budget leaves {blocks} KV blocks ({blocks * block_size} tokens), "
                         f"fewer than one request at --max-len {max_len} needs ({need} blocks of {block_size}): "
                         f"lower --max-len or raise --gpu-memory-utilization (now {utilization})")


DEFAULT_CPU_KV_CACHE_GIB = 4.0   # each engine's KV pool on the CPU (--cpu-kv-cache-gib)


def check_cpu_kv_space(gib: float) -> None:
    if not gib > 0:
        raise ValueError(f"--cpu-kv-cache-gib must be > 0, got {gib}")


def cpu_kv_blocks(role: str, gib: float, block_bytes: int, cap_blocks: int, block_size: int, max_len: int) -> int:
    """The KV blocks of an engine's pool on the CPU: as many as `gib` GiB hold, at most
    `cap_blocks` (every slot at full context). Refuses a pool that cannot hold one request at
    the full context."""
    check_cpu_kv_space(gib)
    if block_bytes <= 0:
        raise ValueError(f"block_bytes must be > 0, got {block_bytes}")
    blocks = min(cap_blocks, int(gib * GIB) // block_bytes)
    need = blocks_for(max_len + 1, block_size)
    if blocks < need:
        raise ValueError(f"{role}: --cpu-kv-cache-gib {gib:g} holds {blocks * block_size} tokens of KV, fewer than "
                         f"one request at --max-len {max_len} needs ({need * block_size}, "
                         f"{need * block_bytes / GIB:.2f} GiB): lower --max-len or raise --cpu-kv-cache-gib")
    return blocks


# The drafter's need, from its configs (serve, before the engines start).

def ahead_slots(spec, max_slots: int) -> int:
    """Extra cache slots for draft-ahead forks: per request, one per tree node and one per outcome."""
    return max_slots * (spec.max_draft_nodes + 1 + spec.ahead_width) if spec.ahead_width else 0


def draft_pool_blocks(spec, max_slots: int, max_len: int, block_size: int) -> int:
    """The drafter's pool at every request at full length, plus room for draft-ahead forks (each
    borrows its request's full blocks and needs a copy of the partial one plus what it absorbs
    and drafts)."""
    return max_slots * blocks_for(max_len + 1, block_size) + fork_blocks(spec, max_slots, block_size)


def fork_blocks(spec, max_slots: int, block_size: int) -> int:
    """The draft-ahead forks' part of the drafter's pool (draft_pool_blocks)."""
    fork_entries = block_size + spec.num_steps + 1 + max(0, spec.num_steps - 1) * spec.topk
    return ahead_slots(spec, max_slots) * blocks_for(fork_entries, block_size)


def safetensors_elements(directory: str | Path) -> int:
    """Tensor elements in a directory's *.safetensors files, from their headers alone."""
    total = 0
    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise ValueError(f"{directory}: no *.safetensors files to size the drafter from")
    for path in files:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, entry in header.items():
            if name != "__metadata__":
                count = 1
                for d in entry["shape"]:
                    count *= int(d)
                total += count
    return total


def _attention_shape(cfg: dict) -> tuple[int, int, int]:
    """(layers, kv heads, head dim) of a model or draft config (a speculators config nests the
    layer's)."""
    layer = cfg.get("transformer_layer_config") or cfg
    heads = int(layer["num_attention_heads"])
    head_dim = int(layer.get("head_dim") or int(layer["hidden_size"]) // heads)
    return int(layer.get("num_hidden_layers", 1)), int(layer.get("num_key_value_heads") or heads), head_dim


def prefill_activation_bytes(cfg: dict, max_slots: int, dtype_bytes: int) -> int:
    """An estimate of a model's activations in the profiling pass's prefill: every slot's prompt
    of PROFILE_PROMPT_TOKENS at once, a few hidden-sized and MLP-sized rows per token. `cfg`: the
    model's config.json (a draft head's nested transformer_layer_config too)."""
    layer = cfg.get("transformer_layer_config") or cfg
    hidden = int(layer["hidden_size"])
    inter = int(layer.get("intermediate_size") or 4 * hidden)
    return max_slots * PROFILE_PROMPT_TOKENS * (6 * hidden + 3 * inter) * dtype_bytes


def drafter_activation_bytes(draft_cfg: dict, max_slots: int, rows_per_slot: int, vocab: int,
                             dtype_bytes: int) -> int:
    """An estimate of the drafter's profiling peak: every slot's catch-up of its prompt through the
    draft model (`prefill_activation_bytes`), or a few float32/float64 copies of the logits of every
    row it drafts at once (logits, log-probs, probabilities, the sampled q rows)."""
    return max(prefill_activation_bytes(draft_cfg, max_slots, dtype_bytes), max_slots * rows_per_slot * vocab * 24)


def verifier_activation_bytes(target_cfg: dict, max_slots: int, rows_per_slot: int, dtype_bytes: int) -> int:
    """An estimate of the verifier's profiling peak: every slot's prefill
    (`prefill_activation_bytes`), or the logits of its widest round."""
    return max(prefill_activation_bytes(target_cfg, max_slots, dtype_bytes),
               max_slots * rows_per_slot * int(target_cfg["vocab_size"]) * 24)


def shared_kv_tokens(budget: int, verifier_fixed: int, drafter_fixed: int, verifier_token_bytes: int,
                     drafter_token_bytes: int) -> int:
    """Both engines on one GPU: the tokens each KV pool holds when the KV memory of `budget`
    (after both engines' fixed costs and graph reserves) is split so that both hold the same
    number (the drafter holds a token of every request the verifier holds, never more)."""
    usable = int(budget * (1 - GRAPH_RESERVE_FRACTION)) - verifier_fixed - drafter_fixed
    return max(0, usable // (verifier_token_bytes + drafter_token_bytes))


def drafter_need_bytes(spec, target_cfg: dict, draft_dir: str | Path | None, dtype: str, max_slots: int,
                       max_len: int, block_size: int, draft_kv_blocks: int | None = None,
                       shared_budget: int | None = None, target_dir: str | Path | None = None) -> int:
    """What the drafter needs on its GPU: its weights (head or draft model; an EAGLE head's copies
    of the target's embeddings and lm_head), its KV pool, its activations and the runtime and CUDA
    graph reserves. The pool holds every slot at full context, or, given the `shared_budget`
    (bytes) of a GPU it shares with the verifier of `target_dir`, as many tokens as the verifier's
    pool will (`shared_kv_tokens`) when that is fewer, plus its draft-ahead forks. 0 for n-gram
    drafting (no GPU)."""
    if spec.method in ("none", "ngram"):
        return 0
    from spectandem.checkpoint import read_config

    nbytes = DTYPE_BYTES[dtype]
    cfg = read_config(draft_dir)
    weights = safetensors_elements(draft_dir) * nbytes
    vocab = int(target_cfg["vocab_size"])
    if spec.method in ("eagle", "eagle3"):   # embeddings and (EAGLE-1) lm_head from the target
        weights += 2 * vocab * int(target_cfg["hidden_size"]) * nbytes
    layers, kv_heads, head_dim = _attention_shape(cfg)
    block = kv_block_bytes(layers, kv_heads, head_dim, block_size, nbytes)
    rows = spec.max_draft_nodes + 1 + max(spec.topk, 1) * max(spec.ahead_width, 1)
    fixed = weights + drafter_activation_bytes(cfg, max_slots, rows, vocab, nbytes) + RUNTIME_RESERVE_BYTES
    blocks = draft_kv_blocks or draft_pool_blocks(spec, max_slots, max_len, block_size)
    if draft_kv_blocks is None and shared_budget is not None:
        verifier_fixed = (safetensors_elements(target_dir) * nbytes + RUNTIME_RESERVE_BYTES
                          + verifier_activation_bytes(target_cfg, max_slots, spec.max_draft_nodes + 1, nbytes))
        tokens = shared_kv_tokens(shared_budget, verifier_fixed, fixed,
                                  kv_block_bytes(*_attention_shape(target_cfg), 1, nbytes), block // block_size)
        # every slot's partial block on top of the shared tokens
        blocks = min(blocks, blocks_for(tokens, block_size) + max_slots + fork_blocks(spec, max_slots, block_size))
    return int((fixed + blocks * block) / (1 - GRAPH_RESERVE_FRACTION)) + 1


# Measurements on the engine's device (torch imported here only).

def device_total_bytes(device) -> int:
    import torch

    return int(torch.cuda.get_device_properties(torch.device(device)).total_memory)


def allocated_bytes(device) -> int:
    import torch

    return int(torch.cuda.memory_allocated(torch.device(device)))


def measure_peak(fn, device) -> int:
    """Bytes `fn()` allocates at its peak on `device` beyond what was allocated before it."""
    import torch

    dev = torch.device(device)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    fn()
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    torch.cuda.empty_cache()
    return int(max(0, peak))


# Both engines on one GPU (serve, the in-process pair).

def drafter_budget_gib(config, total_bytes: int | None = None) -> float | None:
    """The drafter's budget in GiB where it shares a CUDA device with the verifier (EngineConfig
    `config`, the pair's): its need (`drafter_need_bytes`) for a pool of as many tokens as the
    verifier's will hold in --gpu-memory-utilization of the device's `total_bytes` (read from
    the device when not given), in whole MiB. None where no split is needed: on the CPU, for
    n-gram drafting (no GPU memory), or where the engine's budget is given."""
    if (not config.device.startswith("cuda") or config.spec.method in ("none", "ngram")
            or config.memory_budget_gib is not None or config.gpu_memory_utilization is None):
        return None
    from spectandem.checkpoint import read_config

    tcfg = read_config(config.target_dir)
    longest = int(tcfg.get("max_position_embeddings", 2048))
    context = min(config.max_len or longest, longest)
    shared = None
    if total_bytes is None:
        try:
            total_bytes = device_total_bytes(config.device)
        except (AssertionError, RuntimeError):   # no CUDA in this process (a Ray driver off the GPU):
            total_bytes = None                      # a pool for every slot at full context
    if total_bytes is not None:
        shared = int(config.gpu_memory_utilization * total_bytes)
    need = drafter_need_bytes(config.spec, tcfg, config.draft_dir, config.dtype, config.max_slots, context,
                              config.block_size, config.draft_kv_blocks, shared, config.target_dir)
    return -(-need // (1 << 20)) / 1024


def shared_gpu_configs(config):
    """(verifier's EngineConfig, drafter's) for a pair on one device: the drafter gets its
    `drafter_budget_gib`, the verifier --gpu-memory-utilization's share less that."""
    from dataclasses import replace

    share = drafter_budget_gib(config)
    if share is None:
        return config, config
    return replace(config, memory_reserved_gib=share), replace(config, memory_budget_gib=share)


def engine_memory_flags(config) -> tuple[list[str], list[str]]:
    """The command-line flags of `shared_gpu_configs` for (the verifier, the drafter) process."""
    if config.gpu_memory_utilization is None:
        return [], []
    util = ["--gpu-memory-utilization", str(config.gpu_memory_utilization)]
    share = drafter_budget_gib(config)
    if share is None:
        return util, util
    return util + ["--memory-reserved-gib", str(share)], util + ["--memory-budget-gib", str(share)]


def kv_capacity_line(verifier_kv: dict, drafter_kv: dict | None) -> str:
    """serve's start-up line of both pools (engine info's kv: num_blocks, block_size)."""
    def side(kv: dict | None) -> str:
        if not kv or not kv.get("num_blocks"):
            return "none"
        n, bs = int(kv["num_blocks"]), int(kv["block_size"])
        return f"{n * bs} tokens ({n} blocks of {bs})"
    return f"verifier KV cache: {side(verifier_kv)}, drafter KV cache: {side(drafter_kv)}"
