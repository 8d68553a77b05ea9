"""Greedy output of the demo pair on CUDA with graphs, with the KV pool sized from memory and with
a fixed pool, against plain decoding (fp32): which one departs from plain decoding."""

import sys

from router.local import LocalSpeculator
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS

plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=32, max_len=1024, device="cuda")
prompts = [plain.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
want = [o.token_ids for o in plain.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))]
for kv in (None, 2048):
    for graphs in (False, True):
        spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=32, max_len=1024,
                               device="cuda", cuda_graphs=graphs, kv_blocks=kv, draft_kv_blocks=kv)
        outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
        bad = [i for i, (o, e) in enumerate(zip(outs, want)) if o.token_ids != e]
        print(f"kv_blocks={kv} cuda_graphs={graphs}: {len(bad)} of {len(prompts)} differ {bad[:5]}", flush=True)
        del spec
