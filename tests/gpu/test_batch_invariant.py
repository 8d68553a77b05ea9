"""Batch-invariant verification on the GPU (run with `python -m pytest -m gpu tests/gpu/test_batch_invariant.py`).

End to end, in bf16 on the demo pair with `batch_invariant=True`: greedy speculation (EAGLE-3 chain,
EAGLE-3 tree, draft LM) equals plain decoding token for token on all 24 prompts, with every prompt
in one batch and each prompt alone. Kernel level (spectandem/kernels/batch_invariant.py): a row of
bi_linear / bi_rmsnorm is bit-identical alone (M = 1) and inside M = 37 or 64; a bi_attention row is
bit-identical decoded alone and as a node of a branching tree; each kernel is close to its reference.

The `check_*` helpers take a device; tests/spectandem/test_batch_invariant_cpu.py runs them through
Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.batch_invariant import (
    bi_attention_ref,
    bi_attention_triton,
    bi_linear_ref,
    bi_linear_triton,
    bi_rmsnorm_ref,
    bi_rmsnorm_triton,
    tree_paths,
)
from spectandem.kv_cache import PagedKVCache
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
# Kernel vs reference: the same math in another summation order (and, in 16 bits, the kernel's
# output is rounded from fp32 once where the reference's may be rounded from another order).
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}
# A branching tree (parents precede children): node 7's path is 0 -> 2 -> 6 -> 7, node 5's 0 -> 1 -> 3 -> 5.
TREE_PARENTS = [-1, 0, 0, 1, 1, 3, 2, 6, 0]


def _randn(gen: torch.Generator, *shape, dtype, device) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


# ----------------------------------------------------------------------------------------------
# Checks shared with the interpreter tests


def check_linear_matches_reference(device, dtype, m: int, n: int, k: int, bias: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, 3, m, k, dtype=dtype, device=device) / k ** 0.5
    w = _randn(gen, n, k, dtype=dtype, device=device)
    b = _randn(gen, n, dtype=dtype, device=device) if bias else None
    out = bi_linear_triton(x, w, b)
    assert out.shape == (3, m, n) and out.dtype == dtype
    torch.testing.assert_close(out, bi_linear_ref(x, w, b), **TOLERANCE[dtype])


def check_linear_row_invariance(device, dtype, n: int, k: int, seed: int) -> None:
    """Bitwise: row r of M = 37 equals the same row alone (M = 1) and inside M = 64 with other rows."""
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, 37, k, dtype=dtype, device=device)
    w = _randn(gen, n, k, dtype=dtype, device=device) / k ** 0.5
    b = _randn(gen, n, dtype=dtype, device=device)
    together = bi_linear_triton(x, w, b)
    for r in (0, 5, 21, 36):
        assert torch.equal(bi_linear_triton(x[r: r + 1], w, b)[0], together[r]), f"row {r} differs at M = 1"
        other = _randn(gen, 64, k, dtype=dtype, device=device)
        other[47] = x[r]
        assert torch.equal(bi_linear_triton(other, w, b)[47], together[r]), f"row {r} differs at M = 64"


def check_rmsnorm(device, dtype, hidden: int, seed: int) -> None:
    """Close to RMSNorm's math; bitwise the same row alone and inside M = 37."""
    gen = torch.Generator().manual_seed(seed)
    x = _randn(gen, 37, hidden, dtype=dtype, device=device) * 3
    w = _randn(gen, hidden, dtype=dtype, device=device)
    together = bi_rmsnorm_triton(x, w, 1e-5)
    torch.testing.assert_close(together, bi_rmsnorm_ref(x, w, 1e-5), **TOLERANCE[dtype])
    for r in (0, 17, 36):
        assert torch.equal(bi_rmsnorm_triton(x[r: r + 1], w, 1e-5)[0], together[r]), f"row {r} differs alone"


def tree_case(device, dtype, num_heads: int, num_kv_heads: int, head_dim: int, cache_lens: list[int], seed: int):
    """Two requests in a PagedKVCache with random committed entries and the branching TREE_PARENTS
    tree written at cache_len + j (request 1's last node is padding) -> (cache, bi_attention args)."""
    gen = torch.Generator().manual_seed(seed)
    n = len(TREE_PARENTS)
    cache = PagedKVCache(1, 4, num_kv_heads, 256, head_dim, dtype, device, block_size=BLOCK_SIZE)
    for pool in (cache.k[0], cache.v[0]):
        pool.copy_(_randn(gen, *pool.shape, dtype=dtype, device=device))
    slots = torch.tensor([3, 1], device=device)
    for slot, c in zip(slots.tolist(), cache_lens):
        cache.reserve(slot, c + n)
    parents = torch.tensor([TREE_PARENTS, TREE_PARENTS], device=device)
    valid = torch.ones(2, n, dtype=torch.bool, device=device)
    valid[1, -1] = False
    base = torch.tensor(cache_lens, device=device)[:, None]
    write = cache.rows(slots, base + torch.arange(n, device=device))
    path_rows, path_lens = tree_paths(parents, valid, write)
    q = _randn(gen, 2, num_heads, n, head_dim, dtype=dtype, device=device)
    args = (q, cache.k[0], cache.v[0], cache._tables[slots], base.expand(2, n), path_rows, path_lens,
            head_dim ** -0.5, BLOCK_SIZE)
    return cache, args


def check_attention_matches_reference(device, dtype, heads: tuple[int, int, int], seed: int) -> None:
    num_heads, num_kv_heads, head_dim = heads
    _, args = tree_case(device, dtype, num_heads, num_kv_heads, head_dim, [77, 9], seed)
    torch.testing.assert_close(bi_attention_triton(*args), bi_attention_ref(*args), **TOLERANCE[dtype])


def check_attention_tree_invariance(device, dtype, heads: tuple[int, int, int], seed: int) -> None:
    """Bitwise: every valid node of the branching tree equals plain decoding of the same token. The
    decode runs in a third slot whose committed entries are the request's prefix, then the node's
    ancestors (as commit leaves them), in a batch of 1 and next to an unrelated request."""
    num_heads, num_kv_heads, head_dim = heads
    cache_lens = [77, 9]
    cache, args = tree_case(device, dtype, num_heads, num_kv_heads, head_dim, cache_lens, seed)
    q, k_pool, v_pool, _, _, path_rows, path_lens, scale, _ = args
    together = bi_attention_triton(*args)
    decode_slot = torch.tensor([0], device=device)
    for b, c in enumerate(cache_lens):
        for j in range(len(TREE_PARENTS) - b):
            d = int(path_lens[b, j])
            cache.free(0)
            cache.reserve(0, c + d)
            src = cache.rows(torch.tensor([3, 1], device=device)[b: b + 1], torch.arange(c, device=device)[None])
            dst = cache.rows(decode_slot, torch.arange(c + d, device=device)[None])
            for pool in (k_pool, v_pool):
                pool[dst[0]] = torch.cat([pool[src[0]], pool[path_rows[b, j, :d]]])
            qj = q[b: b + 1, :, j: j + 1]
            alone = bi_attention_triton(qj, k_pool, v_pool, cache._tables[decode_slot],
                                        torch.tensor([[c + d - 1]], device=device), dst[:, -1:, None],
                                        torch.ones(1, 1, dtype=torch.long, device=device), scale, BLOCK_SIZE)
            assert torch.equal(alone[0, 0], together[b, j]), f"request {b}, node {j} differs decoded alone"
            # Next to request 1's root as a plain decode row: B = 2.
            tables = torch.cat([cache._tables[decode_slot], args[3][1:]])
            own_rows = torch.stack([dst[0, -1], path_rows[1, 0, 0]]).view(2, 1, 1)
            pair = bi_attention_triton(torch.cat([qj, q[1:, :, :1]]), k_pool, v_pool, tables,
                                       torch.tensor([[c + d - 1], [cache_lens[1]]], device=device), own_rows,
                                       torch.ones(2, 1, dtype=torch.long, device=device), scale, BLOCK_SIZE)
            assert torch.equal(pair[0, 0], together[b, j]), f"request {b}, node {j} differs in a batch of 2"
            assert torch.equal(pair[1, 0], together[1, 0]), "request 1's root differs decoded"


# ----------------------------------------------------------------------------------------------
# GPU: kernels


@pytest.fixture(scope="module")
def cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    if not HAVE_TRITON:
        pytest.fail("batch-invariant verification needs triton on the GPU machine")
    return "cuda"


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
HEADS = [(4, 2, 64), (32, 8, 128), (12, 4, 64)]
HEAD_IDS = ["demo", "llama8b", "gqa3"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("m,n,k", [(1, 256, 256), (37, 512, 256), (5, 4096, 4096), (16, 4096, 72), (3, 14336, 4096)])
def test_linear_matches_reference(cuda, dtype, m, n, k):
    check_linear_matches_reference(cuda, dtype, m, n, k, bias=n == 512, seed=m)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("n,k", [(256, 256), (4096, 256), (5000, 4096), (14336, 4096), (32001, 512)])
def test_linear_rows_are_batch_invariant(cuda, dtype, n, k):
    check_linear_row_invariance(cuda, dtype, n, k, seed=n)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 256, 4096, 5000])
def test_rmsnorm(cuda, dtype, hidden):
    check_rmsnorm(cuda, dtype, hidden, seed=hidden)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_attention_matches_reference(cuda, dtype, heads):
    for seed in range(3):
        check_attention_matches_reference(cuda, dtype, heads, seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_attention_tree_node_equals_plain_decode(cuda, dtype, heads):
    check_attention_tree_invariance(cuda, dtype, heads, seed=1)


# ----------------------------------------------------------------------------------------------
# GPU: greedy speculation equals plain decoding in bf16

CONFIGS = [
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
    ("draft-model", dict(num_steps=4, topk=1, num_draft_tokens=5)),
]
MAX_TOKENS = 48


def _spec(method: str, **tree) -> LocalSpeculator:
    t, d = demo_paths(method)
    return LocalSpeculator(t, d, SpecConfig(method=method, **tree), max_slots=32, max_len=512, dtype=torch.bfloat16,
                           device="cuda", batch_invariant=True)


def _greedy(spec: LocalSpeculator, prompts: list[list[int]]) -> tuple[list[list[int]], list[list[int]], int]:
    """(all prompts in one batch, each prompt alone, accepted draft tokens of the batch)."""
    params = SamplingParams(max_tokens=MAX_TOKENS)
    batched = spec.generate(prompts, [params] * len(prompts))
    alone = [spec.generate([p], [params])[0].token_ids for p in prompts]
    return [c.token_ids for c in batched], alone, sum(c.stats.accepted_tokens for c in batched)


@pytest.fixture(scope="module")
def plain(cuda):
    spec = _spec("none")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    batched, alone, _ = _greedy(spec, prompts)
    assert len(prompts) >= 20
    differ = [i for i, (a, b) in enumerate(zip(batched, alone)) if a != b]
    assert not differ, f"plain decoding differs batched and alone on prompts {differ}"
    return prompts, batched


@pytest.mark.parametrize("method,tree", CONFIGS, ids=["eagle3-chain", "eagle3-tree", "draft-lm"])
def test_bf16_greedy_speculation_equals_plain(plain, method, tree):
    prompts, expected = plain
    batched, alone, accepted = _greedy(_spec(method, **tree), prompts)
    differ = [i for i, (c, e) in enumerate(zip(batched, expected)) if c != e]
    assert not differ, f"bf16 {method} {tree}: prompts {differ} differ from plain decoding (all in one batch)"
    differ = [i for i, (c, e) in enumerate(zip(alone, expected)) if c != e]
    assert not differ, f"bf16 {method} {tree}: prompts {differ} differ from plain decoding (each alone)"
    assert accepted > 0
