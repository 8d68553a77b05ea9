"""`spectandem bench` on the demo pair: the methods over batch sizes, transformers' `generate`
(plain and assisted by the demo draft LM), and the temperature table."""

from __future__ import annotations

from benchmarks.bench.records import PROMPTS, accept_length, record, timed
from spectandem.config import GpuPaths

DEMO_MODES = {
    "none": ("none", {}),
    "eagle3-chain": ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "eagle3-tree": ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
    "eagle3-fused": ("eagle3", dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True)),
    "eagle-chain": ("eagle", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "draft-model-chain": ("draft-model", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    "ngram-chain": ("ngram", dict(num_steps=4, num_draft_tokens=5)),
}
TEMPERATURES = (0.0, 0.3, 0.5, 0.7, 1.0, 1.3, 1.5, 2.0)
# Temperature-table draft kinds -> SpecConfig.draft_sampling_min_temperature: "sampled" drafts
# carry their probabilities q and are verified by rejection sampling at every temperature > 0;
# "greedy" drafts are deterministic and verified target-only at every temperature.
DRAFT_KINDS = {"sampled": 0.0, "greedy": float("inf")}


def _speculator(mode: str, max_slots: int, device: str, dtype, gpu: GpuPaths = GpuPaths(), **cfg_overrides):
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths
    from router.local import LocalSpeculator

    method, tree = DEMO_MODES[mode]
    target, draft = demo_paths(method)
    return LocalSpeculator(target, draft, SpecConfig(method=method, **tree, **cfg_overrides), max_slots=max_slots,
                           max_len=512, dtype=dtype, device=device, **gpu.runner_kwargs())


def _one_by_one(spec, prompts: list[list[int]], params: list, device: str):
    """Batch-1 runs of each prompt in turn -> (completions, seconds)."""
    outs, seconds = [], 0.0
    for i, (p, sp) in enumerate(zip(prompts, params)):
        (out,), dt = timed(lambda: spec.generate([p], [sp], [f"one-{i}"]), (device,))
        outs.append(out)
        seconds += dt
    return outs, seconds


def bench_demo(modes: list[str], batch_sizes: list[int], num_prompts: int, max_tokens: int, device: str,
               dtype, gpu: GpuPaths = GpuPaths()) -> list[dict]:
    """Per mode: batch 1 over `num_prompts` prompts in turn, then each larger batch size at once
    (prompts cycled)."""
    from spectandem.config import SamplingParams

    records = []
    for name in modes:
        spec = _speculator(name, max(batch_sizes), device, dtype, gpu)
        method = DEMO_MODES[name][0]
        prompts = [spec.tokenizer.encode(p).ids for p in PROMPTS]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        spec.generate(prompts[:1], [params])  # warm-up
        for b in batch_sizes:
            if b == 1:
                outs, dt = _one_by_one(spec, prompts[:num_prompts], [params] * num_prompts, device)
            else:
                outs, dt = timed(lambda: spec.generate([prompts[i % len(prompts)] for i in range(b)], [params] * b),
                                 (device,))
            records.append(record(section="demo", workload="demo", method=method, mode=name, batch_size=b,
                                  tokens=sum(len(o.token_ids) for o in outs), seconds=dt,
                                  accept_length=accept_length(outs)))
    return records


def _hf_models(dtype, device: str, with_assistant: bool):
    from transformers import AutoModelForCausalLM

    from spectandem.checkpoint import load_tokenizer
    from spectandem.demo import demo_paths

    target = demo_paths("none")[0]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=dtype).to(device).eval()
    assistant = None
    if with_assistant:
        draft_lm = demo_paths("draft-model")[1]
        assistant = AutoModelForCausalLM.from_pretrained(str(draft_lm), dtype=dtype).to(device).eval()
    return model, assistant, load_tokenizer(target)


def bench_hf(num_prompts: int, max_tokens: int, device: str, dtype, assisted: bool) -> dict:
    """transformers' greedy `generate` on the demo target at batch 1, plain or assisted by the
    demo draft LM (`assistant_model`, transformers' own schedule of draft lengths). Its accept
    length is generated tokens per target forward (counted by a forward pre-hook)."""
    import torch

    model, assistant, tok = _hf_models(dtype, device, assisted)
    forwards = [0]
    hook = model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    if assistant is not None:
        kw["assistant_model"] = assistant
    tokens, seconds = 0, 0.0
    try:
        with torch.no_grad():
            for i, text in enumerate(PROMPTS[:num_prompts] * 2):
                ids = torch.tensor([tok.encode(text).ids], device=device)
                out, dt = timed(lambda: model.generate(ids, attention_mask=torch.ones_like(ids), **kw), (device,))
                if i < num_prompts:  # the first pass over the prompts is the warm-up
                    forwards[0] = 0
                    continue
                tokens += out.shape[1] - ids.shape[1]
                seconds += dt
    finally:
        hook.remove()
    method, mode = ("hf-assisted", "assisted") if assisted else ("transformers-generate", "plain")
    return record(section="assisted" if assisted else "hf", workload="demo", method=method, mode=mode, batch_size=1,
                  tokens=tokens, seconds=seconds, accept_length=tokens / forwards[0] if assisted else 1.0,
                  target_forwards=forwards[0])


def bench_temperature(temperatures: list[float], num_prompts: int, max_tokens: int, device: str, dtype,
                      seed: int, gpu: GpuPaths = GpuPaths()) -> list[dict]:
    """EAGLE-3 chain at batch 1 per temperature, with sampled drafts (verified with their q by
    rejection sampling) and with greedy drafts (verified target-only); request i has seed + i."""
    from spectandem.config import SamplingParams

    records = []
    for kind, min_temperature in DRAFT_KINDS.items():
        spec = _speculator("eagle3-chain", 1, device, dtype, gpu,
                           draft_sampling_min_temperature=min_temperature)
        prompts = [spec.tokenizer.encode(p).ids for p in PROMPTS[:num_prompts]]
        spec.generate(prompts[:1], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])  # warm-up
        for t in temperatures:
            params = [SamplingParams(max_tokens=max_tokens, temperature=t, seed=seed + i, ignore_eos=True)
                      for i in range(len(prompts))]
            outs, dt = _one_by_one(spec, prompts, params, device)
            records.append(record(section="temperature", workload="demo", method="eagle3", mode="eagle3-chain",
                                  batch_size=1, tokens=sum(len(o.token_ids) for o in outs), seconds=dt,
                                  accept_length=accept_length(outs), temperature=t, drafts=kind))
    return records
