"""Fixtures of the drafter.loader tests: a tiny random Llama target (untied embedding and
lm_head) saved in the transformers format, and loaded natively."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectandem.modeling.llama import load_llama
from tests.drafter.loader.eagle_checkpoints import HT, L, V


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=V, hidden_size=HT, intermediate_size=64, num_hidden_layers=L,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      tie_word_embeddings=False)
    d = tmp_path_factory.mktemp("target")
    LlamaForCausalLM(cfg).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def target(target_dir):
    return load_llama(target_dir)
