"""`spectandem bench`: speed of the engines on the machine at hand, one run, a table and JSON.

Workloads:
- demo: the trained demo pair (real acceptance). Per method and mode: batch-1 latency (ms per
  output token, tokens/s, mean acceptance length) and a throughput sweep over batch sizes; plus
  transformers' own `generate` on the same target at batch 1.
- llama8b: a Llama-3.1-8B-shaped target (hidden 4096, 32 layers, 32/8 heads, MLP 14336, vocab
  128256) with random bf16 weights made on the device (no download): plain decoding at batch 1
  and its fraction of the memory-bandwidth roofline (bytes of weights and KV read per step over
  the measured device-to-device copy bandwidth). GPU only.

This is the first part of the benchmark; the controlled-acceptance proposer, assisted generation
and the temperature table are not in it yet.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

DEMO_MODES = {
    "none": ("none", {}),
    "eagle3-chain": ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "eagle3-tree": ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
    "eagle3-fused": ("eagle3", dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True)),
    "eagle-chain": ("eagle", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "draft-model-chain": ("draft-model", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "ngram-chain": ("ngram", dict(num_steps=4, num_draft_tokens=5)),
}
PROMPTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self",
           "    for i in range(len(", "# Copyright 2001 Python Software Foundation\n", "def __repr__(self):\n"]


def _sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def copy_bandwidth(device: str) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read and written."""
    import torch

    if not device.startswith("cuda"):
        return 0.0
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    _sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def bench_demo(modes: list[str], batch_sizes: list[int], max_tokens: int, device: str, dtype) -> list[dict]:
    from spectandem.config import SamplingParams, SpecConfig
    from spectandem.demo import demo_paths
    from spectandem.local import LocalSpeculator

    records = []
    for name in modes:
        method, tree = DEMO_MODES[name]
        target, draft = demo_paths(method)
        spec = LocalSpeculator(target, draft, SpecConfig(method=method, **tree), max_slots=max(batch_sizes),
                               max_len=512, dtype=dtype, device=device)
        prompts = [spec.tokenizer.encode(p).ids for p in PROMPTS]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        spec.generate(prompts[:1], [params])  # warm-up
        for b in batch_sizes:
            batch = [prompts[i % len(prompts)] for i in range(b)]
            _sync(device)
            t0 = time.perf_counter()
            outs = spec.generate(batch, [params] * b)
            _sync(device)
            dt = time.perf_counter() - t0
            toks = sum(len(o.token_ids) for o in outs)
            rounds = sum(o.stats.num_rounds for o in outs)
            acc = sum(o.stats.accepted_tokens for o in outs)
            records.append({"workload": "demo", "method": method, "mode": name, "batch_size": b,
                            "tokens_per_s": round(toks / dt, 1), "ms_per_token": round(1000 * dt / (toks / b), 3),
                            "accept_length": round((acc + rounds) / rounds, 3) if rounds else 1.0,
                            "acceptance_rate": None})
    return records


def bench_hf_generate(max_tokens: int, device: str, dtype) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from spectandem.checkpoint import load_tokenizer
    from spectandem.demo import demo_paths

    target = demo_paths("none")[0]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()
    ids = torch.tensor([load_tokenizer(target).encode(PROMPTS[0]).ids], device=device)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
              do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids, **kw)
        _sync(device)
        t0 = time.perf_counter()
        model.generate(ids, **kw)
        _sync(device)
    dt = time.perf_counter() - t0
    return {"workload": "demo", "method": "transformers-generate", "mode": "plain", "batch_size": 1,
            "tokens_per_s": round(max_tokens / dt, 1), "ms_per_token": round(1000 * dt / max_tokens, 3),
            "accept_length": 1.0, "acceptance_rate": None}


def llama8b_spec():
    from spectandem.modeling.layers import RopeSpec
    from spectandem.modeling.llama import LlamaSpec

    return LlamaSpec(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                     num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5,
                     rope=RopeSpec(head_dim=128, theta=500000.0, kind="llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position=8192),
                     max_position_embeddings=131072, tie_word_embeddings=False, qkv_bias=False, o_bias=False,
                     mlp_bias=False, qk_norm=False, eos_token_ids=(128001,))


def bench_llama8b_plain(device: str, steps: int, context: int, bandwidth: float) -> dict:
    """Plain decoding at batch 1 of an 8B-shaped bf16 target with random weights."""
    import torch

    from spectandem.kv_cache import PagedKVCache
    from spectandem.modeling.llama import LlamaModel

    spec = llama8b_spec()
    with torch.device(device):
        model = LlamaModel(spec).to(torch.bfloat16).eval()
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    cache = PagedKVCache(spec.num_layers, 1, spec.num_kv_heads, context + steps + 1, spec.head_dim, torch.bfloat16,
                         device, block_size=16)
    slot = torch.zeros(1, dtype=torch.long, device=device)
    cache.reserve(0, context + steps)
    with torch.no_grad():
        ids = torch.randint(0, spec.vocab_size, (1, context), device=device)
        pos = torch.arange(context, device=device)[None]
        mask = torch.tril(torch.ones(context, context, dtype=torch.bool, device=device))[None]
        model(ids, pos, cache.batch(slot, pos, context), mask)
        tok = torch.zeros(1, 1, dtype=torch.long, device=device)
        times = []
        for i in range(steps):
            n = context + i
            p = torch.tensor([[n]], device=device)
            _sync(device)
            t0 = time.perf_counter()
            h, _ = model(tok, p, cache.batch(slot, p, n + 1), torch.ones(1, 1, n + 1, dtype=torch.bool, device=device))
            tok = model.logits(h[:, -1:]).argmax(-1)
            _sync(device)
            times.append(time.perf_counter() - t0)
    step = sorted(times)[len(times) // 2]
    kv_bytes = 2 * spec.num_layers * spec.num_kv_heads * spec.head_dim * 2 * (context + steps // 2)
    floor = (weight_bytes + kv_bytes) / bandwidth if bandwidth else 0.0
    return {"workload": "llama8b", "method": "none", "mode": "plain", "batch_size": 1,
            "tokens_per_s": round(1 / step, 1), "ms_per_token": round(1000 * step, 3), "accept_length": 1.0,
            "acceptance_rate": None, "roofline_ms": round(1000 * floor, 3),
            "roofline_fraction": round(floor / step, 3) if floor else None,
            "weight_bytes": weight_bytes, "context": context}


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure speed on this machine (table + JSON)")
    p.add_argument("--workloads", default="demo,llama8b", help="comma-separated: demo, llama8b (GPU only)")
    p.add_argument("--modes", default=",".join(DEMO_MODES), help=f"demo modes: {', '.join(DEMO_MODES)}")
    p.add_argument("--batch-sizes", default="1,4,16,64")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--llama8b-steps", type=int, default=64)
    p.add_argument("--llama8b-context", type=int, default=512)
    p.add_argument("--out", default="benchmarks/results/bench.json")
    p.set_defaults(func=_bench)


def _bench(args) -> int:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    workloads = args.workloads.split(",")
    bandwidth = copy_bandwidth(device)
    records = []
    if "demo" in workloads:
        records += bench_demo(args.modes.split(","), [int(b) for b in args.batch_sizes.split(",")], args.max_tokens,
                              device, dtype)
        records.append(bench_hf_generate(args.max_tokens, device, dtype))
    if "llama8b" in workloads:
        if not device.startswith("cuda"):
            raise ValueError("the llama8b workload needs a CUDA device (--device cuda)")
        records.append(bench_llama8b_plain(device, args.llama8b_steps, args.llama8b_context, bandwidth))
    gpu = torch.cuda.get_device_name() if device.startswith("cuda") else "cpu"
    print(f"device {gpu}, copy bandwidth {bandwidth / 1e12:.2f} TB/s")
    print(f"{'workload':<9} {'mode':<20} {'batch':>5} {'tokens/s':>10} {'ms/token':>9} {'accept_len':>10} {'roofline':>8}")
    for r in records:
        roof = f"{r['roofline_fraction']:.2f}" if r.get("roofline_fraction") else ""
        print(f"{r['workload']:<9} {r['mode'] if r['method'] != 'transformers-generate' else 'hf-generate':<20} "
              f"{r['batch_size']:>5} {r['tokens_per_s']:>10} {r['ms_per_token']:>9} {r['accept_length']:>10} {roof:>8}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"device": gpu, "copy_bandwidth_bytes_per_s": bandwidth, "dtype": args.dtype,
                               "records": records}, indent=2) + "\n")
    print(f"-> {out}")
    return 0
