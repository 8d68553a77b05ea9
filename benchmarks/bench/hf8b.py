"""`spectandem bench --sections hf8b`: transformers' own greedy `generate` on the 8B-shaped bf16
target, the baseline the issue's "20 times transformers' generate" target is stated against. The
model is transformers' LlamaForCausalLM built from the same shapes with the native target's
weights loaded into it (the parameter names are HuggingFace's), on the same device; batch 1, one
random prompt, static shapes of neither: `generate` as a user would call it.
"""

from __future__ import annotations


def hf_llama(model):
    """transformers' LlamaForCausalLM with `model`'s (a native LlamaModel) config and weights."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = model.spec
    rope = s.rope
    cfg = LlamaConfig(vocab_size=s.vocab_size, hidden_size=s.hidden_size, intermediate_size=s.intermediate_size,
                      num_hidden_layers=s.num_layers, num_attention_heads=s.num_heads,
                      num_key_value_heads=s.num_kv_heads, head_dim=s.head_dim, rms_norm_eps=s.rms_norm_eps,
                      max_position_embeddings=s.max_position_embeddings, tie_word_embeddings=False,
                      rope_parameters={"rope_type": rope.kind, "rope_theta": rope.theta, "factor": rope.factor,
                                       "low_freq_factor": rope.low_freq_factor,
                                       "high_freq_factor": rope.high_freq_factor,
                                       "original_max_position_embeddings": rope.original_max_position})
    dtype = next(model.parameters()).dtype
    device = next(model.parameters()).device
    with torch.device("meta"):
        hf = LlamaForCausalLM(cfg).to(dtype)
    hf = hf.to_empty(device=device)
    state = {k: v for k, v in model.state_dict().items() if "rotary_emb" not in k}
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [k for k in missing if "rotary_emb" not in k]
    if missing or unexpected:
        raise RuntimeError(f"weights do not map onto LlamaForCausalLM: missing {missing[:4]}, unexpected {unexpected[:4]}")
    for name, buf in hf.named_buffers():       # rotary inv_freq: recompute what to_empty left unset
        if name.endswith("inv_freq"):
            buf.copy_(rope.inv_freq().to(buf))
    return hf.eval()


def bench_hf8b(model, device: str, prompt_len: int, max_tokens: int, seed: int) -> dict:
    import torch

    from benchmarks.bench.records import record, timed

    hf = hf_llama(model)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.spec.vocab_size, (1, prompt_len), generator=g).to(device)
    kw = dict(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
              attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        hf.generate(ids, **{**kw, "max_new_tokens": 8, "min_new_tokens": 8})       # warm-up
        out, seconds = timed(lambda: hf.generate(ids, **kw), (device,))
    tokens = out.shape[1] - ids.shape[1]
    del hf
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return record(section="hf8b", workload="llama8b", method="transformers-generate", mode="plain", batch_size=1,
                  tokens=tokens, seconds=seconds, accept_length=1.0)
