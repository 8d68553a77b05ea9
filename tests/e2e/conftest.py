"""Shared fixtures: the demo pair, fixed prompts, and transformers' own greedy outputs (the oracle)."""

from __future__ import annotations

import pytest
import torch

from spectandem.checkpoint import load_tokenizer
from spectandem.config import SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator

PROMPT_TEXTS = [
    "def fibonacci(n):\n", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self",
    "    for i in range(len(", "# Copyright 2001 Python Software Foundation\n", "def __repr__(self):\n        return",
    "try:\n    import _thread\nexcept ImportError:\n", "    if not isinstance(value, str):\n        raise",
    "\"\"\"Utilities for", "def read(self, size=-1):\n", "    @property\n    def name(self):\n",
    "import re\n\n_pattern = re.compile(", "class Error(Exception):\n", "    def close(self):\n        if self.",
    "__all__ = [", "def _check(", "        except OSError:\n", "    return ''.join(", "if __name__ == '__main__':\n",
    "def encode(s, encoding='utf-8'):", "        self.buffer = []\n", "from collections import namedtuple\n",
    "    def __len__(self):\n", "lines = text.splitlines()\n",
]
MAX_TOKENS = 32


@pytest.fixture(scope="session")
def tokenizer():
    return load_tokenizer(demo_paths("none")[0])


@pytest.fixture(scope="session")
def prompts(tokenizer):
    return [tokenizer.encode(t).ids for t in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def oracle(prompts):
    """transformers' own greedy `generate` on the demo target, one prompt at a time (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(demo_paths("none")[0]), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_TOKENS,
                               do_sample=False, eos_token_id=0, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def speculator(method: str, max_slots: int = 32, max_len: int | None = 256, **tree) -> LocalSpeculator:
    target, draft = demo_paths(method)
    return LocalSpeculator(target, draft, SpecConfig(method=method, **tree), max_slots=max_slots, max_len=max_len)
