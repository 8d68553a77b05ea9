"""Batch-invariant verification on the CPU.

Always run: the torch references of spectandem/kernels/batch_invariant.py against the model's own
math (bi_attention_ref on a tree equals masked_attention over NativeRunner's mask; bi_rmsnorm_ref is
RMSNorm; bi_linear_ref is nn.Linear), `tree_paths`, and NativeRunner's batch-invariant prefill and
verify (through the references) against its ordinary path.

Through Triton's interpreter: the kernel-level checks of tests/gpu/test_batch_invariant.py (kernel vs
reference, bitwise row invariance, tree node == plain decode), at small sizes. They run where
Triton is installed and the interpreter is on (tests/interpreter.py; CI installs triton). The
interpreter runs each program in numpy: its bitwise row invariance (with tl.dot a row at a time,
tests/conftest.py) checks the kernels' fixed reduction order, not the GPU's numerics or speed,
which the GPU machine covers.
"""

from __future__ import annotations


import pytest
import torch

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kernels.batch_invariant import bi_attention_ref, bi_linear_ref, bi_rmsnorm_ref, tree_paths
from router.local import LocalSpeculator
from spectandem.modeling.layers import RMSNorm, masked_attention
from spectandem.tree import ancestor_mask
from tests.e2e.conftest import PROMPT_TEXTS
from tests.gpu.test_batch_invariant import (
    TREE_PARENTS,
    check_attention_matches_reference,
    check_attention_tree_invariance,
    check_linear_matches_reference,
    check_linear_row_invariance,
    check_rmsnorm,
    tree_case,
)
from tests.interpreter import interpreter
from verifier.runner import NativeRunner, load_runner


# bf16 tiles through tests/conftest.py's mend of the interpreter's `tl.dot` (triton-lang/triton#11584).
DOT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DOT_IDS = ["fp32", "fp16", "bf16"]


@interpreter
@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=DOT_IDS)
def test_interpreted_linear(dtype):
    check_linear_matches_reference("cpu", dtype, 5, 48, 72, bias=True, seed=0)
    check_linear_matches_reference("cpu", dtype, 37, 64, 256, bias=False, seed=1)
    check_linear_row_invariance("cpu", dtype, 40, 72, seed=2)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_interpreted_rmsnorm(dtype):
    check_rmsnorm("cpu", dtype, 96, seed=0)


@interpreter
@pytest.mark.parametrize("dtype", DOT_DTYPES, ids=DOT_IDS)
@pytest.mark.parametrize("heads", [(4, 2, 32), (6, 2, 16)], ids=["gqa2", "gqa3"])
def test_interpreted_attention(dtype, heads):
    check_attention_matches_reference("cpu", dtype, heads, seed=0)
    check_attention_tree_invariance("cpu", dtype, heads, seed=1)


# ----------------------------------------------------------------------------------------------
# The references against the model's math (always run)


def test_tree_paths_example():
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, -1, -1]])
    valid = torch.tensor([[True] * 4, [True, True, False, False]])
    rows, lens = tree_paths(parents, valid, torch.tensor([[40, 41, 42, 43], [7, 8, 9, 10]]))
    assert rows.tolist() == [[[40, -1, -1], [40, 41, -1], [40, 42, -1], [40, 41, 43]],
                             [[7, -1, -1], [7, 8, -1], [9, -1, -1], [10, -1, -1]]]
    assert lens.tolist() == [[1, 2, 2, 3], [1, 2, 1, 1]]


def test_tree_paths_are_the_ancestor_mask_in_depth_order():
    gen = torch.Generator().manual_seed(0)
    b, n = 6, 24
    parents = torch.full((b, n), -1)
    for i in range(1, n):
        parents[:, i] = torch.randint(0, i, (b,), generator=gen)
    valid = torch.rand(b, n, generator=gen) < 0.8
    valid[:, 0] = True
    for i in range(1, n):
        valid[:, i] &= valid.gather(1, parents[:, i: i + 1]).squeeze(1)
    rows, lens = tree_paths(parents, valid, torch.arange(n).expand(b, n))
    mask = ancestor_mask(parents, valid)
    for r in range(b):
        for i in range(n):
            path = rows[r, i, : lens[r, i]].tolist()
            assert path == mask[r, i].nonzero().flatten().tolist()  # parents precede children: depth order
            assert path[-1] == i and (rows[r, i, lens[r, i]:] == -1).all()


def test_attention_ref_equals_masked_attention_on_a_tree():
    """Node j sees the committed entries and its ancestors: the mask NativeRunner.verify builds."""
    cache_lens = [77, 9]
    cache, args = tree_case("cpu", torch.float32, 4, 2, 32, cache_lens, seed=3)
    q, k_pool, v_pool = args[:3]
    n = len(TREE_PARENTS)
    parents = torch.tensor([TREE_PARENTS] * 2)
    valid = torch.ones(2, n, dtype=torch.bool)
    valid[1, -1] = False
    base = torch.tensor(cache_lens)[:, None]
    span = max(cache_lens) + n
    cols = torch.arange(span)
    mask = (cols[None, None, :] < base[:, :, None]).expand(2, n, span).clone()
    node_cols = base + torch.arange(n)                                              # [B, N]
    mask[torch.arange(2)[:, None, None], torch.arange(n)[None, :, None], node_cols[:, None, :]] = ancestor_mask(
        parents, valid)
    read = cache.rows(torch.tensor([3, 1]), cols.expand(2, span))
    expected = masked_attention(q, k_pool[read].transpose(1, 2), v_pool[read].transpose(1, 2), mask, 32 ** -0.5)
    torch.testing.assert_close(bi_attention_ref(*args), expected, atol=1e-5, rtol=1e-5)


def test_attention_ref_row_without_keys_is_zero():
    _, args = tree_case("cpu", torch.float32, 4, 2, 32, [5, 3], seed=0)
    q, k_pool, v_pool, tables, prefix, path_rows, path_lens = args[:7]
    out = bi_attention_ref(q, k_pool, v_pool, tables, torch.zeros_like(prefix), path_rows, torch.zeros_like(path_lens),
                           *args[7:])
    assert torch.equal(out, torch.zeros_like(out))


def test_rmsnorm_and_linear_refs_are_the_modules():
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        norm = RMSNorm(64, 1e-5).to(dtype)
        norm.weight.data = torch.randn(64, generator=gen).to(dtype)
        x = (torch.randn(3, 5, 64, generator=gen) * 4).to(dtype)
        assert torch.equal(bi_rmsnorm_ref(x, norm.weight, norm.eps), norm(x))
    lin = torch.nn.Linear(64, 48)
    x = torch.randn(7, 64, generator=gen)
    torch.testing.assert_close(bi_linear_ref(x, lin.weight, lin.bias), lin(x), atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------------------
# NativeRunner's batch-invariant path, through the references


def test_runner_refuses_batch_invariant_on_cpu():
    with pytest.raises(ValueError, match="CUDA device"):
        load_runner(demo_paths("none")[0], None, 2, 64, batch_invariant=True)


def _invariant_runner(max_slots: int) -> NativeRunner:
    """A CPU runner on the batch-invariant path. The kernels need CUDA, so the runner refuses the
    flag here; set after construction, the path runs on the torch references (same plumbing)."""
    runner, _ = load_runner(demo_paths("none")[0], (1, 4, 7), max_slots, 128)
    runner.batch_invariant = True
    return runner


def test_runner_invariant_path_matches_ordinary_path():
    """Prefill (ragged prompts) and a branching-tree verify: logits and features close to the
    ordinary forward's, so the keys and positions the runner builds are the mask's."""
    ordinary, _ = load_runner(demo_paths("none")[0], (1, 4, 7), 4, 128)
    invariant = _invariant_runner(4)
    prompts = [[5, 9, 200, 31, 7, 7, 1000], [3, 4], [17, 18, 19, 20, 21]]
    slots = [2, 0, 3]
    n = len(TREE_PARENTS)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, 4000, (3, n), generator=gen)
    parents = torch.tensor([TREE_PARENTS] * 3)
    valid = torch.ones(3, n, dtype=torch.bool)
    valid[1, 5:] = False
    outs = []
    for runner in (ordinary, invariant):
        logits, feats = runner.prefill(slots, prompts)
        v_logits, v_feats = runner.verify(slots, [len(p) for p in prompts], tokens, parents, valid)
        outs.append((logits, feats, v_logits[valid], v_feats[valid]))
    (lo, fo, vlo, vfo), (li, fi, vli, vfi) = outs
    torch.testing.assert_close(li, lo, atol=1e-4, rtol=1e-4)
    for a, b in zip(fi, fo):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vli, vlo, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(vfi, vfo, atol=1e-4, rtol=1e-4)


def test_runner_invariant_path_greedy_equals_plain():
    """EAGLE-3 tree speculation on the invariant path (references, fp32) yields plain decoding's tokens."""
    prompts_text = PROMPT_TEXTS[:4]
    outs = []
    for method, tree in (("none", {}), ("eagle3", dict(num_steps=4, topk=2, num_draft_tokens=8))):
        t, d = demo_paths(method)
        spec = LocalSpeculator(t, d, SpecConfig(method=method, **tree), max_slots=4, max_len=128)
        spec.verifier.runner.batch_invariant = True  # see _invariant_runner
        prompts = [spec.tokenizer.encode(p).ids for p in prompts_text]
        outs.append(spec.generate(prompts, [SamplingParams(max_tokens=16)] * len(prompts)))
    assert [c.token_ids for c in outs[1]] == [c.token_ids for c in outs[0]]
    assert sum(c.stats.accepted_tokens for c in outs[1]) > 0
