"""NativeRunner's `triton_attention` verify path on the GPU (run with
`python -m pytest -m gpu tests/gpu/test_triton_attention.py`).

- Eager: the Triton paged tree attention (PagedTreeBatch) against today's dense verify (gather +
  masked_attention) over three rounds with commits: fp32 logits and features to a few ulps with
  equal argmaxes (the kernel sums in another order), bf16 loosely.
- CUDA graphs: the graphed tree step equals the same padded step run eagerly bit for bit, and the
  unpadded eager tree step bit for bit when B fills its bucket (the kernel's rows do not depend on
  the batch, and no span padding exists on this path), to a few ulps otherwise; one graph per
  (Bc, N) serves every span.
- Padding rows (prefix 0, a table of -1, an identity mask): zeros, no K/V read, the other rows
  unchanged bit for bit (`check_padding_rows`, also run through Triton's interpreter by
  tests/verifier/test_triton_attention_cpu.py).
- End to end in fp32 with triton_attention and cuda_graphs on: greedy EAGLE-3 chain and tree
  speculation equal plain decoding with the same flags on the 24 prompts."""

from __future__ import annotations

import pytest
import torch

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kernels import HAVE_TRITON, paged_tree_attention_triton
from router.local import LocalSpeculator
from spectandem.modeling.llama import load_llama
from spectandem.tree import ancestor_mask
from tests.e2e.conftest import PROMPT_TEXTS
from tests.verifier.random_trees import accepted_paths, random_trees
from spectandem.cuda_graphs import BATCH_BUCKETS
from verifier.graphs import VerifyGraphs
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

AUX = (2, 4, 5)
MAX_LEN = 512
# Kernel vs dense attention through 8 layers, logits [B, N, V] float32 of magnitude ~10: another
# summation order (online softmax in chunks of 64 entries); in bf16 every layer rounds differently.
TOLERANCE = {torch.float32: dict(atol=2e-4, rtol=1e-4), torch.bfloat16: dict(atol=0.25, rtol=0.05)}
# Padded graph vs unpadded eager: the same kernels but other matmul shapes.
ULPS = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=0.25, rtol=0.05)}


@pytest.fixture(scope="module", autouse=True)
def _cuda_and_triton():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    if not HAVE_TRITON:
        pytest.fail("tests/gpu/test_triton_attention.py needs triton on the GPU machine")


def _rounds(runners, b: int, n: int, check, num_rounds: int = 3) -> None:
    """Prefill ragged prompts (some past several 64-entry key chunks), then verify + commit rounds."""
    g = torch.Generator().manual_seed(100 * b + n)
    slots = list(range(b))[::-1]
    prompts = [torch.randint(1, 4096, (5 + (37 * i) % 300,), generator=g).tolist() for i in range(b)]
    # One prompt a prefill: a runner with graphs prefills a batch in groups of one padded length
    # (prefill_groups), one without in one forward, and those matmul shapes round the K/V
    # differently; one at a time, every runner's cache holds the same K/V bit for bit.
    for r in runners:
        for slot, prompt in zip(slots, prompts):
            r.prefill([slot], [prompt])
    cache_lens = [len(p) for p in prompts]
    for _ in range(num_rounds):
        tokens, parents, valid = random_trees(g, b, n)
        check([r.verify(slots, cache_lens, tokens, parents, valid) for r in runners], valid)
        accepted = accepted_paths(parents, valid)
        for r in runners:
            r.commit(slots, cache_lens, accepted)
        cache_lens = [c + int((a >= 0).sum()) for c, a in zip(cache_lens, accepted)]


def _close(a, b, valid, dtype, tolerance) -> None:
    (la, fa), (lb, fb) = a, b
    torch.testing.assert_close(lb[valid], la[valid], **tolerance[dtype])
    torch.testing.assert_close(fb[valid], fa[valid], **tolerance[dtype])
    same = lb[valid].argmax(-1) == la[valid].argmax(-1)
    agree = same.float().mean()
    if dtype == torch.float32:
        assert bool(same.all()), f"argmaxes differ on {int((~same).sum())} of {same.numel()} nodes"
    else:  # bf16 near-ties may flip; nearly all must agree
        assert agree >= 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5), (4, 16), (20, 5)])
def test_eager_triton_verify_matches_dense(dtype, b, n):
    model = load_llama(demo_paths("none")[0], dtype, "cuda")
    dense = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN)
    triton = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN, triton_attention=True)
    assert triton.graphs is None
    _rounds((dense, triton), b, n, lambda outs, valid: _close(*outs, valid, dtype, TOLERANCE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5), (4, 16), (20, 5)])
def test_graphed_triton_verify_equals_eager_triton(dtype, b, n):
    model = load_llama(demo_paths("none")[0], dtype, "cuda")
    eager = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN, triton_attention=True)
    static = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN, triton_attention=True)
    static.graphs = VerifyGraphs(static.model, static.cache, graph=False, tree_attention=True)
    graphed = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN, cuda_graphs=True, triton_attention=True)
    # The verify step is what this compares: every runner prefills eagerly, as `eager` does (a
    # short prompt would otherwise prefill as a padded chain through the step: test_graphs.py).
    for r in (static, graphed):
        r._graphed_prefill_nodes = lambda prompts: 0

    def check(outs, valid):
        (la, fa), (ls, fs), (lg, fg) = outs
        assert torch.equal(lg, ls) and torch.equal(fg, fs), "graph replay differs from the same step run eagerly"
        if b in BATCH_BUCKETS:  # no padding at all: the eager step, bit for bit
            assert torch.equal(lg, la) and torch.equal(fg, fa), "unpadded graph differs from the eager tree step"
        else:
            _close((la, fa), (lg, fg), valid, dtype, ULPS)

    _rounds((eager, static, graphed), b, n, check)
    # The kernel reads the lengths on the device: three rounds over growing spans, one graph.
    assert list(graphed.graphs._captured) == [(next(r for r in BATCH_BUCKETS if r >= b), n, None, AUX)]


def check_padding_rows(device, dtype) -> None:
    """A padding row as VerifyGraphs builds it (prefix 0, a table of -1, identity mask) yields exact
    zeros, and the real rows around it equal the same rows without it, bit for bit. (The row loads
    no K/V at all: every pool access is masked by the table's -1.)"""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, n, block_size = 4, 2, 32, 5, 16
    prefix = torch.tensor([70, 0, 9])  # row 1 is padding; row 0 spans two 64-entry key chunks
    tables = torch.full((3, 6), -1, dtype=torch.long)
    tables[0, :5] = torch.tensor([3, 0, 5, 1, 6])  # 75 entries
    tables[2, 0] = 2  # 14 entries
    rows = 7 * block_size + 1
    k_pool = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_pool = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    q = torch.randn(3, num_heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 3)
    mask = ancestor_mask(parents, torch.ones(3, n, dtype=torch.bool))
    mask[1] = torch.eye(n, dtype=torch.bool)
    out = paged_tree_attention_triton(q, k_pool, v_pool, tables.to(device), prefix.to(device), mask.to(device),
                                      head_dim ** -0.5, block_size)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    real = torch.tensor([0, 2])
    alone = paged_tree_attention_triton(q[real].contiguous(), k_pool, v_pool, tables[real].to(device),
                                        prefix[real].to(device), mask[real].contiguous().to(device),
                                        head_dim ** -0.5, block_size)
    assert torch.equal(out[real.to(device)], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_padding_rows(dtype):
    check_padding_rows("cuda", dtype)


def _speculator(method: str, **tree) -> LocalSpeculator:
    return LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=32, max_len=MAX_LEN,
                           device="cuda", cuda_graphs=True, triton_attention=True)


@pytest.fixture(scope="module")
def plain():
    spec = _speculator("none")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    return prompts, [o.token_ids for o in outs]


CONFIGS = [
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
]


@pytest.mark.parametrize("method,tree", CONFIGS, ids=["eagle3-chain", "eagle3-tree"])
def test_greedy_with_triton_attention_equals_plain(plain, method, tree):
    prompts, expected = plain
    spec = _speculator(method, **tree)
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected)) if o.token_ids != e]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    graphs = spec.verifier.runner.graphs
    assert graphs.tree_attention and graphs._captured
    assert sum(o.stats.accepted_tokens for o in outs) > 0
