"""The split-KV path of the paged tree attention (`split_len`, spectandem/kernels/attention.py) on the
GPU (run with `python -m pytest -m gpu tests/gpu/test_split_attention.py`):

- against the torch reference over random trees, prefixes and shuffled tables, for several split_len
  (64, 128, 192), block sizes that do and do not divide them (segments starting mid-block), rows whose
  span ends mid-segment, exactly on a segment boundary, or one entry past it; tables with no spare column;
- padding rows (prefix 0, a table of -1, an identity mask) give exact zeros, the rows around them
  unchanged;
- batch invariance for a fixed split_len, bit for bit: a row alone, in a batch of 3, with its
  neighbours redrawn, with a wider table (more segments); node t of a chain against the same token
  verified alone with t more committed entries, across segment boundaries;
- spans of more segments than lanes (a lane takes several), against the reference and bit for bit
  alone, beside shorter rows and under wider or narrower tables;
- Llama-3.1-8B attention shapes (32 heads, 8 kv heads, hd 128, prefix 512, block_size 16) in bf16;
- a captured split launch replayed with new lengths and trees equals the eager launch.

The `check_*` helpers take a device; tests/verifier/test_split_attention_cpu.py runs them through
Triton's interpreter at small sizes."""

from __future__ import annotations

import pytest
import torch

from spectandem.block_manager import blocks_for
from spectandem.kernels import HAVE_TRITON, paged_tree_attention_ref, paged_tree_attention_triton
from spectandem.kernels.attention import split_len_for
from spectandem.tree import ancestor_mask
from tests.gpu.test_kernels import random_tree

pytestmark = pytest.mark.gpu

# Split kernel vs reference: fp32 differs only in summation order; in 16 bits the reference also rounds
# the scores and probabilities to q's dtype (as in tests/gpu/test_kernels.py).
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ----------------------------------------------------------------------------------------------
# Random inputs


def paged_kv(gen: torch.Generator, spans: list[int], block_size: int, num_kv_heads: int, head_dim: int,
             dtype, device, spare_columns: int = 1) -> tuple:
    """Pools [rows, nkv, hd] of random values and tables [B, max_blocks] (int32) mapping request b's
    entries [0, spans[b]) onto shuffled blocks, -1 after; the longest request leaves `spare_columns`
    columns unmapped (0: its last block is the table's last column)."""
    needed = [blocks_for(s, block_size) for s in spans]
    num_blocks = sum(needed) + 3  # a few blocks nobody owns
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((len(spans), max(needed) + spare_columns), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[taken: taken + n].to(torch.int32)
        taken += n
    rows = num_blocks * block_size + 1
    k_pool = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_pool = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return k_pool, v_pool, tables.to(device)


def boundary_prefixes(split_len: int, num_tokens: int) -> list[int]:
    """Prefixes whose spans (prefix + T) end exactly on a segment boundary, one entry past it (a
    segment of one entry), one short of it, and mid-segment; a request with no prefix. Example
    (split_len 64, T = 5): [123, 124, 122, 91, 0] -> spans 128, 129, 127, 96, 5."""
    s, t = split_len, num_tokens
    return [max(0, 2 * s - t), 2 * s - t + 1, max(0, 2 * s - t - 1), max(0, s + s // 2 - t), 0]


# ----------------------------------------------------------------------------------------------
# Checks shared with the interpreter tests


def check_split_matches_reference(device, dtype, *, prefix: list[int], num_tokens: int, heads: tuple,
                                  split_len: int, block_size: int, tree: bool, seed: int, tolerance: dict,
                                  spare_columns: int = 1) -> None:
    """The split path against paged_tree_attention_ref, and (to the same tolerance) the one-pass kernel."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    batch = len(prefix)
    prefix_t = torch.tensor(prefix)
    k_pool, v_pool, tables = paged_kv(gen, (prefix_t + num_tokens).tolist(), block_size, num_kv_heads, head_dim,
                                      dtype, device, spare_columns)
    q = torch.randn(batch, num_heads, num_tokens, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = None
    if tree:
        _, parents, valid = random_tree(gen, batch, num_tokens, 4, "cpu")
        mask = ancestor_mask(parents, valid).to(device)
    args = (q, k_pool, v_pool, tables, prefix_t.to(device), mask, head_dim ** -0.5, block_size)
    out = paged_tree_attention_triton(*args, split_len=split_len)
    expected = paged_tree_attention_ref(*args)
    assert out.shape == expected.shape == (batch, num_tokens, num_heads * head_dim)
    torch.testing.assert_close(out, expected, **tolerance)
    torch.testing.assert_close(out, paged_tree_attention_triton(*args), **tolerance)


def check_split_padding_rows(device, dtype, split_len: int, block_size: int = 16) -> None:
    """A padding row as VerifyGraphs builds it (prefix 0, a table of -1, identity mask) yields exact
    zeros on the split path, and the real rows around it equal the same rows without it, bit for bit."""
    gen = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_dim, n = 4, 2, 32, 5
    prefix = torch.tensor([split_len + 6, 0, 9, 0])  # rows 1 and 3 are padding; row 0 spans two segments
    k_pool, v_pool, tables = paged_kv(gen, (prefix + n).tolist(), block_size, num_kv_heads, head_dim, dtype, device)
    pad = torch.tensor([1, 3], device=device)
    tables[pad] = -1
    q = torch.randn(4, num_heads, n, head_dim, generator=gen).to(device=device, dtype=dtype)
    parents = torch.tensor([[-1, 0, 0, 1, 2]] * 4)
    mask = ancestor_mask(parents, torch.ones(4, n, dtype=torch.bool)).to(device)
    mask[pad] = torch.eye(n, dtype=torch.bool, device=device)
    scale = head_dim ** -0.5
    out = paged_tree_attention_triton(q, k_pool, v_pool, tables, prefix.to(device), mask, scale, block_size,
                                      split_len=split_len)
    assert torch.equal(out[pad], torch.zeros_like(out[pad]))
    assert not torch.isnan(out).any()
    real = torch.tensor([0, 2], device=device)
    alone = paged_tree_attention_triton(q[real].contiguous(), k_pool, v_pool, tables[real], prefix.to(device)[real],
                                        mask[real].contiguous(), scale, block_size, split_len=split_len)
    assert torch.equal(out[real], alone)


def check_split_batch_invariance(device, dtype, heads: tuple, split_len: int, block_size: int, seed: int,
                                 chain: int = 16, nodes: tuple[int, ...] | None = None) -> None:
    """Bitwise, for one split_len: row t of a chain (causal, and the same chain as an explicit tree
    mask) equals that token verified alone with t more committed entries, in a batch of 3 at T = 1
    too; a request's rows do not change when the other rows are redrawn or when the table gets wider
    (more segments, all past the spans). `nodes` picks the chain rows checked alone (default: all)."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    s = split_len
    prefix = torch.tensor([s - 3, 5, 2 * s - chain // 2])  # the chains cross a segment boundary at rows 3, -, chain/2
    k_pool, v_pool, tables = paged_kv(gen, (prefix + chain).tolist(), block_size, num_kv_heads, head_dim, dtype,
                                      device)
    batch = len(prefix)
    q = torch.randn(batch, num_heads, chain, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale, prefix_d = head_dim ** -0.5, prefix.to(device)

    def attend(q_, tables_, prefix_, mask_=None):
        return paged_tree_attention_triton(q_, k_pool, v_pool, tables_, prefix_, mask_, scale, block_size,
                                           split_len=split_len)

    together = attend(q, tables, prefix_d)
    chain_mask = torch.ones(chain, chain, dtype=torch.bool, device=device).tril().expand(batch, chain, chain)
    assert torch.equal(attend(q, tables, prefix_d, chain_mask.contiguous()), together)
    for b in range(batch):
        for t in (range(chain) if nodes is None else nodes):
            alone = attend(q[b: b + 1, :, t: t + 1].contiguous(), tables[b: b + 1], prefix_d[b: b + 1] + t)
            assert torch.equal(alone[0, 0], together[b, t]), f"request {b}, chain row {t} differs alone"
    for t in (range(chain) if nodes is None else nodes):  # plain decoding of the whole batch: T = 1
        step = attend(q[:, :, t: t + 1].contiguous(), tables, prefix_d + t)
        assert torch.equal(step[:, 0], together[:, t]), f"chain row {t} differs at T = 1 in a batch of {batch}"
    for b in range(batch):  # each request alone, whole chain
        assert torch.equal(attend(q[b: b + 1], tables[b: b + 1], prefix_d[b: b + 1])[0], together[b])
    wider = torch.cat([tables, torch.full((batch, 2 * s // block_size + 1), -1, dtype=tables.dtype,
                                          device=device)], dim=1)
    assert torch.equal(attend(q, wider, prefix_d), together), "more segments past the spans changed the rows"
    redrawn = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    keep = chain // 2
    redrawn[1, :, keep] = q[1, :, keep]
    assert torch.equal(attend(redrawn, tables, prefix_d)[1, keep], together[1, keep])


def check_split_lanes_wrap(device, dtype, heads: tuple, split_len: int, block_size: int, seed: int,
                           tolerance: dict | None) -> None:
    """Spans past _MAX_SPLITS (32) segments, so a lane takes several (segment s in lane s % 32):
    the result against the reference (where `tolerance` is given), and bit for bit the same rows
    alone, as chain rows against the token verified alone, and under a wider table; a span of
    fewer segments in the same launch is unchanged by its neighbour's wrap. Example (split_len
    64): prefix 2100 + T 3 -> 34 segments, lanes 0 and 1 take two each."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim = heads
    chain = 3
    wrap = 32 * split_len
    prefix = torch.tensor([wrap + split_len + 52 - chain, wrap - 1, 40])  # 34 segments; 32 + 1 (its last
    # chain row ends one entry past 32 segments); 1
    k_pool, v_pool, tables = paged_kv(gen, (prefix + chain).tolist(), block_size, num_kv_heads, head_dim, dtype,
                                      device)
    batch = len(prefix)
    q = torch.randn(batch, num_heads, chain, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale, prefix_d = head_dim ** -0.5, prefix.to(device)

    def attend(q_, tables_, prefix_):
        return paged_tree_attention_triton(q_, k_pool, v_pool, tables_, prefix_, None, scale, block_size,
                                           split_len=split_len)

    together = attend(q, tables, prefix_d)
    if tolerance is not None:
        torch.testing.assert_close(together, paged_tree_attention_ref(q, k_pool, v_pool, tables, prefix_d, None,
                                                                      scale, block_size), **tolerance)
    for b in range(batch):
        for t in range(chain):
            alone = attend(q[b: b + 1, :, t: t + 1].contiguous(), tables[b: b + 1], prefix_d[b: b + 1] + t)
            assert torch.equal(alone[0, 0], together[b, t]), f"request {b}, chain row {t} differs alone"
    short = tables[2:, : blocks_for(int(prefix[2]) + chain, block_size)]   # a table of 1 lane
    assert torch.equal(attend(q[2:], short.contiguous(), prefix_d[2:]), together[2:])
    wider = torch.cat([tables, torch.full((batch, 3 * split_len // block_size), -1, dtype=tables.dtype,
                                          device=device)], dim=1)
    assert torch.equal(attend(q, wider, prefix_d), together), "a wider table changed the rows"


def check_bad_split_len(device) -> None:
    """split_len must be a positive multiple of BLOCK_N (64 for head_dim <= 128, 32 above), on the
    kernel's wrapper as on the reference."""
    gen = torch.Generator().manual_seed(0)
    for head_dim, block_n in ((32, 64), (256, 32)):
        k_pool, v_pool, tables = paged_kv(gen, [10], 16, 1, head_dim, torch.float32, device)
        q = torch.randn(1, 1, 1, head_dim, generator=gen).to(device)
        args = (q, k_pool, v_pool, tables, torch.tensor([9], device=device), None, 1.0, 16)
        for bad in (0, -block_n, block_n // 2, block_n + 16, float(block_n), True):
            for fn in (paged_tree_attention_triton, paged_tree_attention_ref):
                with pytest.raises(ValueError, match=f"split_len must be .* BLOCK_N = {block_n}"):
                    fn(*args, split_len=bad)
        assert paged_tree_attention_triton(*args, split_len=block_n).shape == (1, 1, head_dim)


# ----------------------------------------------------------------------------------------------
# GPU tests


@pytest.fixture(scope="module", autouse=True)
def _cuda_and_triton():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    if not HAVE_TRITON:
        pytest.fail("tests/gpu/test_split_attention.py needs triton on the GPU machine")


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
HEADS = [(8, 2, 128), (4, 4, 64), (12, 4, 64)]
HEAD_IDS = ["gqa4-128", "mha-64", "gqa3-64"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
@pytest.mark.parametrize("split_len,block_size", [(64, 16), (128, 16), (64, 24), (192, 128)],
                         ids=["64-b16", "128-b16", "64-b24", "192-b128"])
def test_split_matches_reference(dtype, num_tokens, heads, split_len, block_size):
    for seed, tree in ((0, True), (1, False)):
        check_split_matches_reference("cuda", dtype, prefix=boundary_prefixes(split_len, num_tokens),
                                      num_tokens=num_tokens, heads=heads, split_len=split_len,
                                      block_size=block_size, tree=tree, seed=seed, tolerance=TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 16])
def test_split_ragged_and_full_tables(dtype, num_tokens):
    """Random ragged prefixes up to 700 and tables without a spare column: the last segment may be
    cut short by the table's end (num_splits rounds the table's entries up)."""
    gen = torch.Generator().manual_seed(num_tokens)
    for seed in range(3):
        prefix = torch.randint(0, 700, (4,), generator=gen).tolist()
        check_split_matches_reference("cuda", dtype, prefix=prefix, num_tokens=num_tokens, heads=(8, 2, 128),
                                      split_len=128, block_size=16, tree=True, seed=seed,
                                      tolerance=TOLERANCE[dtype], spare_columns=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("split_len", [64, 128])
def test_split_padding_rows(dtype, split_len):
    check_split_padding_rows("cuda", dtype, split_len)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 64)], ids=["gqa4-128", "mha-64"])
@pytest.mark.parametrize("split_len,block_size", [(64, 16), (128, 24)], ids=["64-b16", "128-b24"])
def test_split_batch_invariance(dtype, heads, split_len, block_size):
    check_split_batch_invariance("cuda", dtype, heads, split_len, block_size, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("split_len,block_size", [(64, 16), (128, 24)], ids=["64-b16", "128-b24"])
def test_split_lanes_wrap(dtype, split_len, block_size):
    check_split_lanes_wrap("cuda", dtype, (8, 2, 128), split_len, block_size, seed=4, tolerance=TOLERANCE[dtype])


def test_bad_split_len():
    check_bad_split_len("cuda")


@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("num_tokens", [1, 16])
@pytest.mark.parametrize("split", ["chosen", "4096"])
def test_llama8b_shapes(batch, num_tokens, split):
    """32 heads, 8 kv heads, hd 128, prefix 512, block_size 16, bf16, a cache of 131,072 entries per
    request (8,193 table columns); split_len as PagedKVCache picks it (64, 32 lanes) and 4,096 (one
    lane a segment, 33 lanes' worth of table)."""
    block_size, width = 16, blocks_for(131072 + 1, 16)
    split_len = split_len_for(128) if split == "chosen" else 4096
    assert split != "chosen" or split_len == 64
    gen = torch.Generator().manual_seed(batch * 100 + num_tokens)
    prefix = torch.tensor([512] + [512 - 37 * i for i in range(1, batch)])
    k_pool, v_pool, tables = paged_kv(gen, (prefix + num_tokens).tolist(), block_size, 8, 128, torch.bfloat16,
                                      "cuda")
    tables = torch.cat([tables, torch.full((batch, width - tables.shape[1]), -1, dtype=tables.dtype,
                                           device="cuda")], dim=1)
    q = torch.randn(batch, 32, num_tokens, 128, generator=gen).to("cuda", torch.bfloat16)
    _, parents, valid = random_tree(gen, batch, num_tokens, 4, "cpu")
    mask = ancestor_mask(parents, valid).cuda()
    args = (q, k_pool, v_pool, tables, prefix.cuda(), mask, 128 ** -0.5, block_size)
    out = paged_tree_attention_triton(*args, split_len=split_len)
    torch.testing.assert_close(out, paged_tree_attention_ref(*args), **TOLERANCE[torch.bfloat16])
    torch.testing.assert_close(out, paged_tree_attention_triton(*args), **TOLERANCE[torch.bfloat16])


@pytest.mark.parametrize("tree", [True, False], ids=["tree", "causal"])
def test_split_launch_replays_in_a_cuda_graph(tree):
    """No host sync on the split path: the pair is captured once and replayed with new lengths and
    trees copied into the captured inputs, equal to the eager launch bit for bit."""
    gen = torch.Generator().manual_seed(3)
    batch, num_nodes, block_size, split_len = 4, 5, 16, 64
    k_pool, v_pool, tables = paged_kv(gen, [300] * batch, block_size, 8, 128, torch.bfloat16, "cuda")
    q = torch.randn(batch, 32, num_nodes, 128, generator=gen).to("cuda", torch.bfloat16)
    prefix = torch.tensor([40, 3, 130, 0], device="cuda")
    _, parents, valid = random_tree(gen, batch, num_nodes, 3, "cuda")
    mask = ancestor_mask(parents, valid) if tree else None

    def step():
        return paged_tree_attention_triton(q, k_pool, v_pool, tables, prefix, mask, 0.125, block_size,
                                           split_len=split_len)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles both kernels
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()

    prefix.copy_(torch.tensor([250, 64, 63, 129]))  # more live segments than at capture
    if tree:
        _, new_parents, new_valid = random_tree(gen, batch, num_nodes, 3, "cuda")
        mask.copy_(ancestor_mask(new_parents, new_valid))
    q.copy_(torch.randn(q.shape, generator=gen).to(q))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
    prefix.copy_(torch.tensor([0, 7, 1, 2]))  # fewer
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, step())
