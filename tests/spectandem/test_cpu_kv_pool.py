"""On the CPU each engine's KV pool is what --cpu-kv-cache-gib holds (EngineConfig.cpu_kv_cache_gib),
at most every slot at full context, built by the factories every backend uses
(verifier/factory.py, drafter/factory.py): the demo pair's real engines, sized and serving."""

import pytest

from drafter.factory import build_engine as build_drafter
from spectandem import memory
from spectandem.block_manager import blocks_for
from spectandem.config import EngineConfig, SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from verifier.factory import build_engine as build_verifier

MAX_LEN, SLOTS = 2048, 8


def _config(gib: float | None) -> EngineConfig:
    target, draft = demo_paths("eagle3")
    return EngineConfig(target_dir=str(target), draft_dir=str(draft), spec=SpecConfig(method="eagle3"),
                        max_slots=SLOTS, max_len=MAX_LEN, cpu_kv_cache_gib=gib)


def _verifier_block_bytes(engine) -> int:
    s = engine.runner.spec
    return memory.kv_block_bytes(s.num_layers, s.num_kv_heads, s.head_dim, 16, 4)


def test_the_verifier_pool_holds_what_the_space_does_and_serves():
    engine = build_verifier(_config(0.05), progress=lambda text: None)
    blocks = int(0.05 * memory.GIB) // _verifier_block_bytes(engine)
    assert blocks < SLOTS * blocks_for(MAX_LEN + 1, 16)                # less than every slot at full context
    assert engine.runner.cache.blocks.num_blocks == blocks
    out = engine.prefill(["a"], [[5, 6, 7, 8]], [SamplingParams()], [0])
    assert out[0].first_token_id >= 0


def test_without_the_space_every_slot_gets_its_full_context():
    engine = build_verifier(_config(None), progress=lambda text: None)
    assert engine.runner.cache.blocks.num_blocks == SLOTS * blocks_for(MAX_LEN + 1, 16)
    big = build_verifier(_config(64.0), progress=lambda text: None)   # more than every slot could use: the cap
    assert big.runner.cache.blocks.num_blocks == SLOTS * blocks_for(MAX_LEN + 1, 16)


def test_a_verifier_pool_short_of_one_request_is_refused_by_name():
    with pytest.raises(ValueError, match=r"verifier: --cpu-kv-cache-gib 0.01 holds .* --max-len 2048"):
        build_verifier(_config(0.01), progress=lambda text: None)


def test_the_drafter_pool_holds_what_the_space_does():
    said = []
    engine, context = build_drafter(_config(0.002), progress=said.append)
    cache = engine.proposer.cache
    per_block = sum(t[0].numel() * t.element_size() for t in (*cache.k, *cache.v)) * cache.block_size
    assert context == MAX_LEN
    assert cache.blocks.num_blocks == int(0.002 * memory.GIB) // per_block
    assert cache.blocks.num_blocks < memory.draft_pool_blocks(_config(None).spec, SLOTS, MAX_LEN, 16)
    assert said and "--cpu-kv-cache-gib" in said[0]
    with pytest.raises(ValueError, match=r"drafter: --cpu-kv-cache-gib 0.0001 holds"):
        build_drafter(_config(0.0001), progress=said.append)
