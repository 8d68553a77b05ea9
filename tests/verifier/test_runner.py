"""verifier.runner against transformers: the native Llama-family model matches HF numerically,
tree verification equals plain causal forwards over each node's path, commit keeps exactly the
accepted path, and the transformers fallback gives transformers' own greedy tokens."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from spectandem.config import SamplingParams, SpecConfig
from spectandem.kv_cache import KVCache
from router.local import LocalSpeculator
from spectandem.modeling.llama import load_llama
from verifier.runner import HFRunner, NativeRunner, load_runner

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
AUX = (2, 4, 5)  # the demo EAGLE-3 head's layers (HF hidden-state indices)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def native_demo():
    return load_llama(DEMO)


@pytest.fixture(scope="module")
def hf_demo():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(DEMO), dtype=torch.float32).eval()


def _randomise(model, seed: int, scale: float = 0.1) -> None:
    """Weights far from HF's near-zero init, so a wrong detail moves the logits visibly; norm
    weights around 1 (a q_norm/k_norm left at ones would test nothing)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g) * scale
            p.copy_(1.0 + noise if "norm" in name or "layernorm" in name else noise)


@pytest.fixture(scope="module")
def neox_dir(tmp_path_factory) -> Path:
    """A tiny random GPTNeoXForCausalLM: no native implementation, so the transformers runner.
    It shares the demo tokenizer (vocab 4096) so LocalSpeculator can load it."""
    from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

    torch.manual_seed(0)
    cfg = GPTNeoXConfig(vocab_size=4096, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=256, rotary_pct=0.5,
                        bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = GPTNeoXForCausalLM(cfg)
    _randomise(model, 1, scale=0.2)
    d = tmp_path_factory.mktemp("neox")
    model.save_pretrained(d)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO / f, d / f)
    return d


@pytest.fixture(scope="module")
def hf_neox(neox_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(neox_dir), dtype=torch.float32).eval()


def native_forward(model, tokens: list[int], capture: tuple[int, ...] = ()):
    """Plain causal forward over `tokens` in a fresh cache -> (logits [T, V], final hidden [T, H],
    aux [T, len(capture) * H] or None)."""
    s = model.spec
    t = len(tokens)
    cache = KVCache(s.num_layers, 1, s.num_kv_heads, t, s.head_dim, torch.float32)
    pos = torch.arange(t)[None]
    mask = torch.ones(t, t, dtype=torch.bool).tril()[None]
    with torch.no_grad():
        hidden, aux = model(torch.tensor([tokens]), pos, cache.batch(torch.tensor([0]), pos, t), mask, capture)
    return model.logits(hidden)[0], hidden[0], None if aux is None else aux[0]


def hf_forward(model, tokens: list[int], capture: tuple[int, ...] = ()):
    """transformers' own forward -> (logits [T, V], aux [T, len(capture) * H] or None)."""
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k][0] for k in capture], -1) if capture else None
    return out.logits[0].float(), aux


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---------------------------------------------------------------------------------------------
# The native model against transformers.


def test_native_demo_matches_transformers(native_demo, hf_demo):
    tokens = _tokens(0, 13, 4096)
    logits, hidden, aux = native_forward(native_demo, tokens, capture=AUX)
    with torch.no_grad():
        out = hf_demo(input_ids=torch.tensor([tokens]), output_hidden_states=True)
    torch.testing.assert_close(logits, out.logits[0], atol=1e-4, rtol=0)
    torch.testing.assert_close(hidden, out.hidden_states[-1][0], atol=1e-4, rtol=0)  # after the final norm
    h = native_demo.spec.hidden_size
    for i, k in enumerate(AUX):  # the un-normalised residual stream after k layers
        torch.testing.assert_close(aux[:, i * h:(i + 1) * h], out.hidden_states[k][0], atol=1e-4, rtol=0)
    # Any order, and index 0 (the embeddings): concatenated in the order asked.
    _, _, aux2 = native_forward(native_demo, tokens, capture=(5, 0))
    torch.testing.assert_close(aux2, torch.cat([out.hidden_states[5][0], out.hidden_states[0][0]], -1),
                               atol=1e-4, rtol=0)


def _tiny_config(arch: str):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6)
    if arch == "qwen2":      # q/k/v biases, large rope theta
        return tf.Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6}), tf.Qwen2ForCausalLM
    if arch == "qwen3":      # q_norm / k_norm, head_dim != hidden / heads, tied embeddings
        return (tf.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True,
                               rope_parameters={"rope_type": "default", "rope_theta": 1e6}), tf.Qwen3ForCausalLM)
    if arch == "mistral":
        return tf.MistralConfig(**common), tf.MistralForCausalLM
    if arch == "llama3-rope":  # llama3 frequency scaling, positions past original_max_position
        rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8}
        return tf.LlamaConfig(**common, rope_parameters=rope, attention_bias=True), tf.LlamaForCausalLM
    raise AssertionError(arch)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "llama3-rope"])
def test_native_variants_match_transformers(arch, tmp_path):
    from transformers import AutoModelForCausalLM

    cfg, cls = _tiny_config(arch)
    torch.manual_seed(0)
    model = cls(cfg)
    _randomise(model, 2)
    if cfg.tie_word_embeddings:
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model.save_pretrained(tmp_path)

    native = load_llama(tmp_path)
    s = native.spec
    assert (s.qkv_bias, s.qk_norm) == {"qwen2": (True, False), "qwen3": (False, True), "mistral": (False, False),
                                       "llama3-rope": (True, False)}[arch]
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    tokens = _tokens(3, 20, 128)
    logits, _, _ = native_forward(native, tokens)
    ref, _ = hf_forward(hf, tokens)
    assert ref.std() > 0.1  # the comparison is not between two near-constant outputs
    torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


# ---------------------------------------------------------------------------------------------
# Tree verification and commit, for both runners.

# Two requests with different prefixes; trees whose accepted paths are not contiguous in node
# order, so commit must really move entries. Padding: token -1, parent -1, invalid.
PREFIX_LENS = (5, 9)
PARENTS = [[-1, 0, 0, 1, 2, 4, 1], [-1, 0, 1, 0, 3, -1, -1]]
VALID = [[True] * 7, [True] * 5 + [False] * 2]
ACCEPTED = [[0, 2, 4, 5], [0, 3, 4, -1]]          # root first, -1 padded
PARENTS2 = [[-1, 0, 1, 0], [-1, 0, 0, 2]]          # the next round's trees


def _path(parents: list[int], node: int) -> list[int]:
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def _check_tree(runner, reference, prefixes, trees, parents, valid, cache_lens, capture):
    """Verifies `trees` and compares every valid node with a causal forward over prefix + path."""
    tok = torch.tensor([[t if ok else -1 for t, ok in zip(ts, vs)] for ts, vs in zip(trees, valid)])
    logits, feats = runner.verify([0, 1], cache_lens, tok, torch.tensor(parents), torch.tensor(valid))
    assert logits.shape == (2, len(parents[0]), logits.shape[-1])
    for b in range(2):
        for node, ok in enumerate(valid[b]):
            if not ok:
                continue
            seq = prefixes[b] + [trees[b][j] for j in _path(parents[b], node)]
            ref_logits, ref_aux = reference(seq, capture)
            torch.testing.assert_close(logits[b, node], ref_logits[-1], atol=1e-4, rtol=0)
            if capture:
                torch.testing.assert_close(feats[b, node], ref_aux[-1], atol=1e-4, rtol=0)


def check_tree_rounds(runner, reference, vocab: int, capture: tuple[int, ...]):
    """prefill -> verify a tree -> commit a path -> verify the next tree on top of it."""
    prompts = [_tokens(10 + b, n, vocab) for b, n in enumerate(PREFIX_LENS)]
    logits, feats = runner.prefill([0, 1], prompts)
    for b, p in enumerate(prompts):
        ref_logits, ref_aux = reference(p, capture)
        torch.testing.assert_close(logits[b], ref_logits[-1], atol=1e-4, rtol=0)
        if capture:
            assert feats[b].shape == ref_aux.shape == (len(p), ref_aux.shape[-1])
            torch.testing.assert_close(feats[b], ref_aux, atol=1e-4, rtol=0)

    # Round 1: roots are the first sampled tokens (not in the cache yet), cache_len = len(prompt).
    trees = [_tokens(20 + b, len(PARENTS[b]), vocab) for b in range(2)]
    cache_lens = list(PREFIX_LENS)
    _check_tree(runner, reference, prompts, trees, PARENTS, VALID, cache_lens, capture)
    runner.commit([0, 1], cache_lens, torch.tensor(ACCEPTED))

    # Round 2: the committed path is in the cache, at the positions right after the prompt.
    prefixes = [prompts[b] + [trees[b][j] for j in ACCEPTED[b] if j >= 0] for b in range(2)]
    cache_lens = [len(p) for p in prefixes]
    trees2 = [_tokens(30 + b, len(PARENTS2[b]), vocab) for b in range(2)]
    _check_tree(runner, reference, prefixes, trees2, PARENTS2, [[True] * 4] * 2, cache_lens, capture)
    # A one-token round (plain decoding) after that round's commit of the root alone.
    runner.commit([0, 1], cache_lens, torch.tensor([[0], [0]]))
    prefixes = [p + [t[0]] for p, t in zip(prefixes, trees2)]
    nxt = [[5], [6]]
    _check_tree(runner, reference, prefixes, nxt, [[-1], [-1]], [[True], [True]],
                [len(p) for p in prefixes], capture)


def test_native_runner_tree_verify_and_commit(native_demo):
    runner = NativeRunner(native_demo, AUX, max_slots=3, max_len=64)

    def reference(seq, capture):
        logits, _, aux = native_forward(native_demo, seq, capture)
        return logits, aux

    check_tree_rounds(runner, reference, 4096, AUX)


def test_hf_runner_tree_verify_and_commit_on_demo(hf_demo):
    runner, model = load_runner(DEMO, AUX, max_slots=3, max_len=64, force_hf=True)
    assert isinstance(runner, HFRunner)
    check_tree_rounds(runner, lambda seq, capture: hf_forward(model, seq, capture), 4096, AUX)


def test_hf_runner_tree_verify_and_commit_on_gpt_neox(neox_dir, hf_neox):
    runner, model = load_runner(neox_dir, None, max_slots=3, max_len=64)
    assert isinstance(runner, HFRunner) and type(model).__name__ == "GPTNeoXForCausalLM"
    check_tree_rounds(runner, lambda seq, capture: hf_forward(hf_neox, seq, capture), 4096, ())


def test_load_runner_picks_native_for_llama(native_demo):
    runner, model = load_runner(DEMO, "final", max_slots=1, max_len=None)
    assert isinstance(runner, NativeRunner) and runner.max_len == 2048
    assert torch.equal(model.lm_head.weight, native_demo.lm_head.weight)


# ---------------------------------------------------------------------------------------------
# Whole greedy generations: speculative (n-gram drafts) through the runners == transformers.

PROMPTS = [[7, 8, 9, 10, 7, 8, 9, 10, 7, 8], [100, 200, 300, 400, 500], [42] * 6 + [43, 44]]
NEW_TOKENS = 24


def _hf_greedy(model, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[0, len(prompt):].tolist()


def _speculative_greedy(target_dir: Path, force_hf: bool):
    spec = LocalSpeculator(target_dir, None, SpecConfig(method="ngram", num_steps=3, num_draft_tokens=4),
                           force_hf_target=force_hf)
    return spec.generate(PROMPTS, [SamplingParams(max_tokens=NEW_TOKENS)] * len(PROMPTS))


@pytest.mark.parametrize("force_hf", [True, False], ids=["hf-runner", "native-runner"])
def test_ngram_speculation_matches_transformers_generate_on_demo(force_hf, hf_demo):
    completions = _speculative_greedy(DEMO, force_hf)
    for prompt, c in zip(PROMPTS, completions):
        assert c.token_ids == _hf_greedy(hf_demo, prompt), prompt
    assert sum(c.stats.accepted_tokens for c in completions) > 0  # drafts were really accepted


def test_ngram_speculation_matches_transformers_generate_on_gpt_neox(neox_dir, hf_neox):
    completions = _speculative_greedy(neox_dir, force_hf=False)  # not native: transformers anyway
    for prompt, c in zip(PROMPTS, completions):
        assert c.token_ids == _hf_greedy(hf_neox, prompt), prompt
    assert sum(c.stats.accepted_tokens for c in completions) > 0
