"""NativeRunner's `triton_attention` verify path on the CPU, through the torch reference of
spectandem/kernels/attention.py (the kernel needs CUDA, so the runner refuses the flag here; set
after construction, the same PagedTreeBatch plumbing runs the reference).

Against today's dense verify on the demo target, over two rounds with a commit between them: chains
and branching trees, batch > 1 in scrambled slots, some rows ending in padding nodes; logits and
features agree to a few fp32 ulps (the reference gathers and masks another span: another summation
order), argmaxes exactly. The padded static step (what a CUDA graph replays) against the unpadded
eager one; greedy EAGLE-3 tree speculation on the path equals plain decoding; the refusals and the
flag plumbing (GpuPaths, --triton-attention)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from spectandem.config import GpuPaths, SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.service_args import add_model_flags
from spectandem.kernels import paged_tree_attention_triton
from router.local import LocalSpeculator
from spectandem.modeling.llama import load_llama
from tests.e2e.conftest import PROMPT_TEXTS
from tests.gpu.test_triton_attention import check_padding_rows
from tests.interpreter import interpreter
from tests.verifier.random_trees import accepted_paths, random_trees
from verifier.graphs import VerifyGraphs
from verifier.runner import NativeRunner, load_runner

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
AUX = (2, 4, 5)
MAX_LEN = 160
ULPS = dict(atol=5e-5, rtol=1e-5)   # fp32 logits of magnitude ~10, another summation order


@pytest.fixture(scope="module")
def model():
    return load_llama(DEMO)


def _tree_runner(model, features, max_slots: int = 8) -> NativeRunner:
    """A CPU runner on the triton_attention path (the reference; see the module docstring)."""
    runner = NativeRunner(model, features, max_slots=max_slots, max_len=MAX_LEN)
    runner.triton_attention = True
    return runner


def _chain(g: torch.Generator, b: int, n: int):
    parents = torch.arange(-1, n - 1).expand(b, n).clone()
    valid = torch.ones(b, n, dtype=torch.bool)
    valid[1:, n - 1:] = False  # every row but the first ends in a padding node
    return torch.randint(1, 4096, (b, n), generator=g).masked_fill(~valid, -1), parents, valid


def _close(a, b, valid):
    (la, fa), (lb, fb) = a, b
    assert la.shape == lb.shape
    torch.testing.assert_close(lb[valid], la[valid], **ULPS)
    assert torch.equal(lb[valid].argmax(-1), la[valid].argmax(-1))
    if fa is None:
        assert fb is None
    else:
        torch.testing.assert_close(fb[valid], fa[valid], **ULPS)


def _rounds(runners, g, b: int, n: int, make_tree, compare, num_rounds: int = 2, after_prefill=None) -> None:
    """Prefill ragged prompts, then `num_rounds` verify + commit rounds on every runner; the later
    rounds read the committed paths (compacted) and the tree scratch written after them.
    `after_prefill()`, if given, runs between the two."""
    slots = list(range(b))[::-1]
    prompts = [torch.randint(1, 4096, (3 + 11 * i,), generator=g).tolist() for i in range(b)]
    for r in runners:
        r.prefill(slots, prompts)
    if after_prefill is not None:
        after_prefill()
    cache_lens = [len(p) for p in prompts]
    for _ in range(num_rounds):
        tokens, parents, valid = make_tree(g, b, n)
        compare(*[r.verify(slots, cache_lens, tokens, parents, valid) for r in runners], valid)
        accepted = accepted_paths(parents, valid)
        for r in runners:
            r.commit(slots, cache_lens, accepted)
        cache_lens = [c + int((a >= 0).sum()) for c, a in zip(cache_lens, accepted)]


@pytest.mark.parametrize("features", [AUX, None], ids=["aux", "none"])
@pytest.mark.parametrize("make_tree", [_chain, random_trees], ids=["chain", "tree"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5), (2, 16)])
def test_tree_path_matches_dense_verify(model, features, make_tree, b, n):
    g = torch.Generator().manual_seed(100 * b + n)
    dense = NativeRunner(model, features, max_slots=8, max_len=MAX_LEN)
    _rounds((dense, _tree_runner(model, features)), g, b, n, make_tree, _close)


@pytest.mark.parametrize("b", [2, 3])
def test_padded_static_tree_step_matches_eager(model, b):
    """B = 3 runs in bucket 4 (a padding row: prefix 0, no blocks, identity mask); B = 2 fills its
    bucket and is the eager tree step bit for bit. Both runners prefill eagerly (the static step
    is attached after the prefill, which with it would run as a padded chain: a few ulps away)."""
    g = torch.Generator().manual_seed(b)
    eager = _tree_runner(model, "final")
    static = _tree_runner(model, "final")
    graphs = VerifyGraphs(model, static.cache, graph=False, batch_buckets=(1, 2, 4), tree_attention=True)

    def compare(a, s, valid):
        if b == 2:
            assert torch.equal(a[0], s[0]) and torch.equal(a[1], s[1])
        else:
            _close(a, s, valid)

    _rounds((eager, static), g, b, 7, random_trees, compare, after_prefill=lambda: setattr(static, "graphs", graphs))
    assert not static.graphs._captured  # graph=False: nothing captured, one static step per call


def test_greedy_tree_speculation_on_the_tree_path_equals_plain():
    """EAGLE-3 tree speculation and plain decoding, both on the tree path (reference, fp32)."""
    outs = []
    for method, tree in (("none", {}), ("eagle3", dict(num_steps=4, topk=2, num_draft_tokens=8))):
        t, d = demo_paths(method)
        spec = LocalSpeculator(t, d, SpecConfig(method=method, **tree), max_slots=4, max_len=128)
        spec.verifier.runner.triton_attention = True  # see _tree_runner
        prompts = [spec.tokenizer.encode(p).ids for p in PROMPT_TEXTS[:4]]
        outs.append(spec.generate(prompts, [SamplingParams(max_tokens=16)] * len(prompts)))
    assert [c.token_ids for c in outs[1]] == [c.token_ids for c in outs[0]]
    assert sum(c.stats.accepted_tokens for c in outs[1]) > 0


def test_triton_attention_needs_cuda_and_the_native_runner(model):
    with pytest.raises(ValueError, match="triton_attention needs a CUDA device"):
        NativeRunner(model, None, max_slots=1, max_len=32, triton_attention=True)
    with pytest.raises(ValueError, match="triton_attention needs a CUDA device"):
        NativeRunner(model, None, max_slots=1, max_len=32, triton_attention=True, cuda_graphs=True)
    with pytest.raises(ValueError, match="needs the native runner"):
        load_runner(DEMO, None, max_slots=1, max_len=32, force_hf=True, triton_attention=True)


def test_flag_and_gpu_paths():
    p = argparse.ArgumentParser()
    add_model_flags(p)
    paths = GpuPaths.from_args(p.parse_args(["--cuda-graphs", "--triton-attention"]))
    assert paths == GpuPaths(cuda_graphs=True, triton_attention=True)
    assert paths.flags() == ["--cuda-graphs", "--triton-attention", "--no-decode-ahead"]
    assert paths.runner_kwargs() == {"cuda_graphs": True, "batch_invariant": False, "triton_attention": True}
    assert not GpuPaths.from_args(p.parse_args([])).runner_kwargs()["triton_attention"]
    with pytest.raises(ValueError, match="choose one"):
        GpuPaths(batch_invariant=True, triton_attention=True)


# ----------------------------------------------------------------------------------------------
# The Triton kernel itself, through Triton's interpreter (tests/interpreter.py; skipped where triton
# is missing; tests/gpu/test_triton_attention.py covers the kernel on the GPU). fp32 only: the
# interpreter casts fp32 to bf16 by truncation, past the GPU's bf16 tolerances.


@interpreter
def test_interpreted_padding_rows():
    check_padding_rows("cpu", torch.float32)


@interpreter
def test_interpreted_kernel_in_the_runner(model, monkeypatch):
    """The runner's tree path through the kernel itself (PagedTreeBatch sends CPU tensors to the
    reference; patched here to the kernel), padded static step included: the kernel's layout
    convention is the one the runner writes."""
    import spectandem.kv_cache

    monkeypatch.setattr(spectandem.kv_cache, "paged_tree_attention", paged_tree_attention_triton)
    dense = NativeRunner(model, AUX, max_slots=8, max_len=MAX_LEN)
    static = _tree_runner(model, AUX)
    static.graphs = VerifyGraphs(model, static.cache, graph=False, batch_buckets=(4,), tree_attention=True)
    g = torch.Generator().manual_seed(1)
    _rounds((dense, _tree_runner(model, AUX), static), g, 3, 5, random_trees,
            lambda a, b, c, valid: (_close(a, b, valid), _close(a, c, valid)))
