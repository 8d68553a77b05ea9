"""GPU memory budgets and KV pool sizing (spectandem/memory.py): the arithmetic, on byte counts."""

import pytest

from spectandem import memory
from spectandem.config import EngineConfig, SpecConfig
from spectandem.demo import demo_paths
from spectandem.memory import GIB

# Llama-3.1-8B's attention: 32 layers, 8 KV heads of 128, bf16.
LLAMA8B_BLOCK = memory.kv_block_bytes(32, 8, 128, 16, 2)


def test_block_bytes_are_k_and_v_of_every_layer():
    assert LLAMA8B_BLOCK == 2 * 32 * 16 * 8 * 128 * 2 == 2 << 20     # 128 KiB per token


def test_engine_budget_is_the_fraction_less_the_other_engines_share():
    total = 140 * GIB
    assert memory.engine_budget(total, 0.9) == int(0.9 * total)
    assert memory.engine_budget(total, 0.9, reserved_gib=3.5) == int(0.9 * total) - int(3.5 * GIB)
    assert memory.engine_budget(total, 0.9, budget_gib=2.25) == int(2.25 * GIB)


@pytest.mark.parametrize("util", [0.0, -0.1, 1.5])
def test_utilization_out_of_range_is_refused_by_name(util):
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        memory.engine_budget(80 * GIB, util)
    with pytest.raises(ValueError, match="--gpu-memory-utilization"):
        EngineConfig(target_dir=None, gpu_memory_utilization=util)


def test_reserve_past_the_budget_is_refused():
    with pytest.raises(ValueError, match="reserved"):
        memory.engine_budget(10 * GIB, 0.5, reserved_gib=6)


def test_split_gives_the_drafter_its_need_and_the_verifier_the_rest():
    total = 140 * GIB
    v, d = memory.split_budget(total, 0.9, 3 * GIB)
    assert d == 3 * GIB and v + d == int(0.9 * total)
    with pytest.raises(ValueError, match="drafter needs"):
        memory.split_budget(total, 0.01, 3 * GIB)


def test_blocks_take_what_weights_activations_and_reserves_leave():
    budget, weights, peak = 126 * GIB, 16 * GIB, 4 * GIB
    cap = 64 * memory.blocks_for(131072 + 1, 16)        # every slot at full context: far past the GPU
    s = memory.kv_blocks_for_budget(budget, weights, peak, LLAMA8B_BLOCK, cap)
    graphs = int(memory.GRAPH_RESERVE_FRACTION * budget)
    assert s.graph_reserve == graphs
    assert s.blocks == (budget - weights - peak - memory.RUNTIME_RESERVE_BYTES - graphs) // LLAMA8B_BLOCK
    used = weights + peak + memory.RUNTIME_RESERVE_BYTES + graphs + s.blocks * LLAMA8B_BLOCK
    assert budget - LLAMA8B_BLOCK < used <= budget
    assert f"{s.blocks} blocks" in s.describe("verifier")


def test_blocks_are_capped_at_every_slot_at_full_context_and_never_negative():
    assert memory.kv_blocks_for_budget(100 * GIB, GIB, GIB, LLAMA8B_BLOCK, 1000).blocks == 1000
    assert memory.kv_blocks_for_budget(2 * GIB, 3 * GIB, GIB, LLAMA8B_BLOCK, 1000).blocks == 0


def test_a_pool_short_of_one_request_fails_naming_both_flags():
    memory.check_fits_one_request("verifier", 8193, 16, 131072, 0.9)  # exactly one request: fine
    with pytest.raises(ValueError) as err:
        memory.check_fits_one_request("verifier", 8192, 16, 131072, 0.9)
    assert "--max-len 131072" in str(err.value) and "--gpu-memory-utilization" in str(err.value)
    assert "\n" not in str(err.value)


def test_draft_pool_blocks_is_the_proposers_default_pool():
    from drafter.proposers import paged_cache

    spec = SpecConfig(method="eagle3", num_steps=4, topk=1, num_draft_tokens=5, ahead_width=4)
    cache = paged_cache(1, 3, 1, 100, 8, None, "cpu", None, 16, spec)
    assert cache.blocks.num_blocks == memory.draft_pool_blocks(spec, 3, 100, 16)


def _demo_config(method="eagle3", device="cuda", **kw):
    target, draft = demo_paths(method)
    return EngineConfig(target_dir=str(target), draft_dir=None if draft is None else str(draft),
                        spec=SpecConfig(method=method), max_slots=4, max_len=256, dtype="bfloat16", device=device, **kw)


def test_a_drafter_given_its_need_sizes_its_pool_at_every_slot_at_full_context():
    """The drafter's budget (computed by serve from configs) holds its pool at the cap when its
    measured activations stay within the estimate."""
    config = _demo_config()
    from spectandem.checkpoint import read_config

    tcfg = read_config(config.target_dir)
    need = memory.drafter_need_bytes(config.spec, tcfg, config.draft_dir, "bfloat16", 4, 256, 16)
    weights = (memory.safetensors_elements(config.draft_dir) + 2 * tcfg["vocab_size"] * tcfg["hidden_size"]) * 2
    rows = config.spec.max_draft_nodes + 1 + config.spec.topk * config.spec.ahead_width
    dcfg = read_config(config.draft_dir)
    peak = memory.drafter_activation_bytes(dcfg, 4, rows, tcfg["vocab_size"], 2)
    block = memory.kv_block_bytes(1, dcfg["num_key_value_heads"], dcfg["head_dim"], 16, 2)
    cap = memory.draft_pool_blocks(config.spec, 4, 256, 16)
    assert memory.kv_blocks_for_budget(need, weights, peak, block, cap).blocks == cap


def test_engine_flags_split_one_gpu_and_leave_the_cpu_alone():
    util = ["--gpu-memory-utilization", "0.8"]
    assert memory.engine_memory_flags(_demo_config(device="cpu", gpu_memory_utilization=0.8)) == (util, util)
    assert memory.engine_memory_flags(_demo_config("ngram", gpu_memory_utilization=0.8)) == (util, util)
    v, d = memory.engine_memory_flags(_demo_config(gpu_memory_utilization=0.8))
    share = memory.drafter_budget_gib(_demo_config(gpu_memory_utilization=0.8))
    assert share > 0
    assert v == util + ["--memory-reserved-gib", str(share)] and d == util + ["--memory-budget-gib", str(share)]
    # No utilization (the library's default, outside the command-line entry points): no sizing, no split.
    assert memory.engine_memory_flags(_demo_config()) == ([], [])
    assert memory.shared_gpu_configs(_demo_config()) == (_demo_config(), _demo_config())
    vc, dc = memory.shared_gpu_configs(_demo_config(gpu_memory_utilization=0.8))
    assert (vc.memory_reserved_gib, vc.memory_budget_gib, dc.memory_budget_gib) == (share, None, share)


def test_kv_capacity_line():
    line = memory.kv_capacity_line({"num_blocks": 10, "block_size": 16, "used_blocks": 0},
                                   {"num_blocks": 3, "block_size": 16})
    assert line == "verifier KV cache: 160 tokens (10 blocks of 16), drafter KV cache: 48 tokens (3 blocks of 16)"
    assert memory.kv_capacity_line({"num_blocks": 2, "block_size": 8}, None).endswith("drafter KV cache: none")


def _header_only_checkpoint(directory, config: dict, elements: int) -> str:
    """A config.json and a *.safetensors file with only a header (what the sizing reads)."""
    import json
    import struct

    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    header = json.dumps({"weight": {"dtype": "BF16", "shape": [elements], "data_offsets": [0, 0]}}).encode()
    (directory / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return str(directory)


def test_on_a_shared_gpu_the_drafter_pool_holds_the_tokens_the_verifiers_pool_will(tmp_path):
    """An 8B-shaped target (131,072 context) and its EAGLE-3 head on one 141 GiB GPU at 0.9: the
    drafter gets a budget for as many tokens as the verifier's pool will hold with the rest, not
    for every slot at full context (64 x 131,072 tokens, several times what the verifier holds)."""
    from spectandem.config import EngineConfig, SpecConfig

    tcfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072}
    target = _header_only_checkpoint(tmp_path / "target", tcfg, 8_030_261_248)
    head_cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "num_hidden_layers": 1}
    head = _header_only_checkpoint(tmp_path / "head", head_cfg, 380_000_000)
    config = EngineConfig(target_dir=target, draft_dir=head, spec=SpecConfig(method="eagle3"), max_slots=64,
                          max_len=None, dtype="bfloat16", device="cuda", gpu_memory_utilization=0.9)
    total = 141 * memory.GIB
    share = int(memory.drafter_budget_gib(config, total) * memory.GIB)
    # The verifier's pool from the rest, as verifier/factory.py sizes it (its activations as estimated).
    rows = config.spec.max_draft_nodes + 1
    verifier_budget = memory.engine_budget(total, 0.9, reserved_gib=share / memory.GIB)
    token_bytes = memory.kv_block_bytes(32, 8, 128, 1, 2)
    verifier_tokens = memory.kv_blocks_for_budget(
        verifier_budget, 8_030_261_248 * 2, memory.verifier_activation_bytes(tcfg, 64, rows, 2), token_bytes,
        64 * 131072).blocks
    drafter_blocks = memory.kv_blocks_for_budget(
        share, (380_000_000 + 2 * 128256 * 4096) * 2,
        memory.drafter_activation_bytes(head_cfg, 64, rows + config.spec.topk * config.spec.ahead_width, 128256, 2),
        memory.kv_block_bytes(1, 8, 128, 16, 2), memory.draft_pool_blocks(config.spec, 64, 131072, 16)).blocks
    forks = memory.fork_blocks(config.spec, 64, 16)
    assert 500_000 < verifier_tokens < 64 * 131072
    assert verifier_tokens <= (drafter_blocks - forks) * 16 <= 1.01 * verifier_tokens + 64 * 16
    # Negative control: sized for every slot at full context, the drafter would take many times more.
    full = memory.drafter_need_bytes(config.spec, tcfg, head, "bfloat16", 64, 131072, 16)
    assert full > 3 * share


def test_the_drafter_estimate_covers_its_heads_catch_up_of_every_slots_prompt():
    """The 8B-shaped EAGLE-3 head with the demo tokenizer's 4,096-token vocabulary, 64 slots, bf16:
    its profiling pass (every slot's 512-token catch-up, then a sampled draft) peaked at 2.54 GiB
    on an H100, almost all of it the catch-up's MLP rows; the logits of the widest draft are a few
    MiB. The estimate serve gives the drafter must cover the measured peak (an estimate of the
    logits alone left the drafter no KV pool on an 80 GiB GPU)."""
    head_cfg = {"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32, "num_key_value_heads": 8,
                "head_dim": 128, "num_hidden_layers": 1}
    measured = 2.54 * memory.GIB
    estimate = memory.drafter_activation_bytes(head_cfg, 64, 16, 4096, 2)
    assert measured <= estimate <= 2 * measured
    assert 64 * 16 * 4096 * 24 < measured / 10   # negative control: the logits term alone is far below


# ---- the CPU: each engine's pool from --cpu-kv-cache-gib

def test_cpu_pool_is_what_the_space_holds_capped_at_every_slot_at_full_context():
    block = memory.kv_block_bytes(8, 2, 64, 16, 4)                      # the demo target in float32
    assert memory.cpu_kv_blocks("verifier", 1.0, block, 10 ** 9, 16, 2048) == GIB // block
    assert memory.cpu_kv_blocks("verifier", 1.0, block, 300, 16, 2048) == 300


def test_a_cpu_pool_short_of_one_request_fails_naming_both_flags():
    with pytest.raises(ValueError, match=r"verifier: --cpu-kv-cache-gib 4 holds .* --max-len 131072 .*lower --max-len "
                                         r"or raise --cpu-kv-cache-gib"):
        memory.cpu_kv_blocks("verifier", 4.0, LLAMA8B_BLOCK * 2, 10 ** 9, 16, 131072)   # float32: 256 KiB a token


@pytest.mark.parametrize("gib", [0.0, -1.0])
def test_cpu_space_out_of_range_is_refused_by_name(gib):
    with pytest.raises(ValueError, match="--cpu-kv-cache-gib must be > 0"):
        EngineConfig(target_dir=None, cpu_kv_cache_gib=gib)
