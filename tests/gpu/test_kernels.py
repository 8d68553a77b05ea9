"""spectandem.kernels on the GPU (run with `python -m pytest -m gpu tests/gpu/test_kernels.py`): each
Triton kernel against its torch reference over random sizes (GQA, ragged prefixes, block_size 16,
T in {1, 5, 16}, bf16 and fp32), and the attention kernel's batch invariance: a query row is
bit-identical whether verified alone (T = 1), inside a chain of 16, next to other rows or requests.

The `check_*` helpers take a device; tests/spectandem/test_kernels_cpu.py runs the same checks
through Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from spectandem.block_manager import blocks_for
from spectandem.kernels import (
    HAVE_TRITON,
    compact_rows_ref,
    compact_rows_triton,
    greedy_accept_ref,
    greedy_accept_triton,
    paged_tree_attention_ref,
    paged_tree_attention_triton,
)
from spectandem.kernels import attention
from spectandem.kv_cache import PagedKVCache
from spectandem.modeling.layers import masked_attention
from spectandem.tree import ancestor_mask

pytestmark = pytest.mark.gpu

BLOCK_SIZE = 16
# Kernel vs reference: fp32 differs only in summation order; in 16 bits the reference also rounds
# the scores and probabilities to q's dtype, the kernel keeps them in fp32 until the P @ V product.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-4), torch.float16: dict(atol=1e-2, rtol=1e-2),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


# ----------------------------------------------------------------------------------------------
# Random inputs


def random_tree(gen: torch.Generator, batch: int, num_nodes: int, vocab: int, device) -> tuple:
    """Valid trees as verify_greedy accepts them: parents [B, N] (parents[:, 0] = -1, 0 <= parent < i),
    node_valid [B, N] (root valid; a node whose parent is padding is padding too), token ids [B, N]
    from a small vocabulary so that siblings often share a token, -1 on some padding nodes."""
    parents = torch.full((batch, num_nodes), -1, dtype=torch.int64)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    valid = torch.rand(batch, num_nodes, generator=gen) < 0.85
    valid[:, 0] = True
    for i in range(1, num_nodes):
        valid[:, i] &= valid.gather(1, parents[:, i: i + 1]).squeeze(1)
    tokens = torch.randint(0, vocab, (batch, num_nodes), generator=gen)
    tokens[~valid & (torch.rand(batch, num_nodes, generator=gen) < 0.5)] = -1
    return tokens.to(device), parents.to(device), valid.to(device)


def random_paged_kv(gen: torch.Generator, batch: int, num_kv_heads: int, head_dim: int, span: list[int],
                    dtype, device) -> tuple:
    """Pools [rows, nkv, hd] of random values, every row (trash included) distinct, and block
    tables [B, max_blocks] mapping request b's entries [0, span[b]) onto shuffled blocks, -1 after."""
    needed = [blocks_for(s, BLOCK_SIZE) for s in span]
    num_blocks = sum(needed) + 3  # a few blocks nobody owns
    max_blocks = max(needed) + 1  # at least one unmapped column in every table
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.full((batch, max_blocks), -1, dtype=torch.int32)
    taken = 0
    for b, n in enumerate(needed):
        tables[b, :n] = order[taken: taken + n].to(torch.int32)
        taken += n
    rows = num_blocks * BLOCK_SIZE + 1
    k_pool = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_pool = torch.randn(rows, num_kv_heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return k_pool, v_pool, tables.to(device)


# ----------------------------------------------------------------------------------------------
# Checks shared with the interpreter tests


def check_attention_matches_reference(device, dtype, num_tokens: int, num_heads: int, num_kv_heads: int,
                                      head_dim: int, max_prefix: int, tree: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    batch = 3
    prefix = torch.randint(0, max_prefix + 1, (batch,), generator=gen)
    prefix[0] = max_prefix  # ragged, and the longest request crosses several key chunks
    k_pool, v_pool, tables = random_paged_kv(gen, batch, num_kv_heads, head_dim,
                                             (prefix + num_tokens).tolist(), dtype, device)
    q = torch.randn(batch, num_heads, num_tokens, head_dim, generator=gen).to(device=device, dtype=dtype)
    mask = None
    if tree:
        _, parents, valid = random_tree(gen, batch, num_tokens, 4, "cpu")
        mask = ancestor_mask(parents, valid).to(device)
    args = (q, k_pool, v_pool, tables, prefix.to(device), mask, head_dim ** -0.5, BLOCK_SIZE)
    out = paged_tree_attention_triton(*args)
    expected = paged_tree_attention_ref(*args)
    assert out.shape == expected.shape == (batch, num_tokens, num_heads * head_dim)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def check_attention_matches_paged_cache(device, dtype, seed: int) -> None:
    """The kernel over a real PagedKVCache equals what NativeRunner.verify computes today: write the
    tree's K/V through PagedCacheBatch.update, build the verify mask, masked_attention."""
    gen = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads, head_dim, num_nodes, layer = 4, 2, 32, 5, 1
    cache = PagedKVCache(2, 4, num_kv_heads, 96, head_dim, dtype, device, block_size=BLOCK_SIZE)
    for t in (cache.k[layer], cache.v[layer]):
        t.copy_(torch.randn(t.shape, generator=gen).to(t))
    slots, cache_lens = [2, 0], [37, 9]
    for slot, c in zip(slots, cache_lens):
        cache.reserve(slot, c + num_nodes)
    _, parents, valid = random_tree(gen, len(slots), num_nodes, 4, "cpu")
    tree = ancestor_mask(parents, valid).to(device)  # [B, N, N]
    q = torch.randn(len(slots), num_heads, num_nodes, head_dim, generator=gen).to(device=device, dtype=dtype)
    k_new = torch.randn(len(slots), num_kv_heads, num_nodes, head_dim, generator=gen).to(device=device, dtype=dtype)
    v_new = torch.randn(len(slots), num_kv_heads, num_nodes, head_dim, generator=gen).to(device=device, dtype=dtype)

    # NativeRunner.verify's mask and cache batch.
    base = torch.tensor(cache_lens, device=device)
    write = base[:, None] + torch.arange(num_nodes, device=device)  # [B, N]
    span = int(base.max()) + num_nodes
    cols = torch.arange(span, device=device)
    mask = (cols[None, None, :] < base[:, None, None]).expand(len(slots), num_nodes, span).clone()
    rows = torch.arange(len(slots), device=device)[:, None, None]
    mask[rows, torch.arange(num_nodes, device=device)[None, :, None], write[:, None, :]] = tree
    slot_t = torch.tensor(slots, device=device)
    k_all, v_all = cache.batch(slot_t, write, span).update(layer, k_new, v_new)
    expected = masked_attention(q, k_all, v_all, mask, head_dim ** -0.5)

    out = paged_tree_attention_triton(q, cache.k[layer], cache.v[layer], cache._tables[slot_t], base, tree,
                                      head_dim ** -0.5, BLOCK_SIZE)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def check_attention_batch_invariance(device, dtype, num_heads: int, num_kv_heads: int, head_dim: int,
                                     seed: int) -> None:
    """Bitwise: row t of a chain of 16 (causal, and the same chain as an explicit tree mask) equals
    that token verified alone with t more committed entries, in a batch of 3 or alone, and does not
    change when every other query row is redrawn."""
    gen = torch.Generator().manual_seed(seed)
    batch, chain = 3, 16
    prefix = torch.tensor([50, 7, 61])  # chains cross the 64-entry key chunk at different rows
    k_pool, v_pool, tables = random_paged_kv(gen, batch, num_kv_heads, head_dim, (prefix + chain).tolist(),
                                             dtype, device)
    q = torch.randn(batch, num_heads, chain, head_dim, generator=gen).to(device=device, dtype=dtype)
    scale, prefix_d = head_dim ** -0.5, prefix.to(device)
    chain_mask = torch.ones(chain, chain, dtype=torch.bool, device=device).tril().expand(batch, chain, chain)
    together = paged_tree_attention_triton(q, k_pool, v_pool, tables, prefix_d, None, scale, BLOCK_SIZE)
    as_tree = paged_tree_attention_triton(q, k_pool, v_pool, tables, prefix_d, chain_mask.contiguous(), scale,
                                          BLOCK_SIZE)
    assert torch.equal(together, as_tree)
    for b in range(batch):
        for t in range(chain):
            alone = paged_tree_attention_triton(q[b: b + 1, :, t: t + 1].contiguous(), k_pool, v_pool,
                                                tables[b: b + 1], prefix_d[b: b + 1] + t, None, scale, BLOCK_SIZE)
            assert torch.equal(alone[0, 0], together[b, t]), f"request {b}, chain row {t} differs alone"
    for t in range(chain):  # plain decoding of the whole batch: T = 1 at every depth
        step = paged_tree_attention_triton(q[:, :, t: t + 1].contiguous(), k_pool, v_pool, tables,
                                           prefix_d + t, None, scale, BLOCK_SIZE)
        assert torch.equal(step[:, 0], together[:, t]), f"chain row {t} differs at T = 1 in a batch of {batch}"
    redrawn = torch.randn(q.shape, generator=gen).to(device=device, dtype=dtype)
    keep = 5
    redrawn[1, :, keep] = q[1, :, keep]
    other = paged_tree_attention_triton(redrawn, k_pool, v_pool, tables, prefix_d, None, scale, BLOCK_SIZE)
    assert torch.equal(other[1, keep], together[1, keep])


def check_paired_tiles_equal_single(device, dtype, monkeypatch, seed: int) -> None:
    """Bitwise: a program computing two row blocks (each chunk of K/V loaded once for both) gives
    every row exactly what one program per row block gives, in one pass and split, for trees of
    20 and 36 rows per kv head (2 and 3 row blocks: the last program's second block is empty)."""
    gen = torch.Generator().manual_seed(seed)
    batch, num_heads, num_kv_heads, head_dim = 3, 8, 2, 64
    for num_tokens in (5, 9):
        prefix = torch.tensor([70, 3, 130])
        k_pool, v_pool, tables = random_paged_kv(gen, batch, num_kv_heads, head_dim, (prefix + num_tokens).tolist(),
                                                 dtype, device)
        q = torch.randn(batch, num_heads, num_tokens, head_dim, generator=gen).to(device=device, dtype=dtype)
        _, parents, valid = random_tree(gen, batch, num_tokens, 4, "cpu")
        mask = ancestor_mask(parents, valid).to(device)
        args = (q, k_pool, v_pool, tables, prefix.to(device), mask, head_dim ** -0.5, BLOCK_SIZE)
        for split_len in (None, 64):
            outs = {}
            for tiles in (1, 2):
                monkeypatch.setattr(attention, "tiles_per_program", lambda q, nkv, tiles=tiles: tiles)
                outs[tiles] = paged_tree_attention_triton(*args, split_len=split_len)
            assert torch.equal(outs[1], outs[2]), f"T = {num_tokens}, split_len {split_len}: paired tiles differ"


def check_accept_matches_reference(device, batch: int, num_nodes: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tokens, parents, valid = random_tree(gen, batch, num_nodes, 3, device)
    argmax = torch.randint(0, 3, (batch, num_nodes), generator=gen).to(device)
    got = greedy_accept_triton(argmax, tokens, parents, valid)
    expected = greedy_accept_ref(argmax, tokens, parents, valid)
    for name, a, e in zip(got._fields, got, expected):
        assert torch.equal(a.cpu(), e.cpu()), f"{name}: kernel {a.tolist()} != verify_greedy {e.tolist()}"


def check_accept_tie_rule(device) -> None:
    """Two siblings carry the target's token: the lower node index wins, as in verify_greedy."""
    tokens = torch.tensor([[5, 7, 7, 9, 9]], device=device)
    parents = torch.tensor([[-1, 0, 0, 2, 1]], device=device)
    valid = torch.ones(1, 5, dtype=torch.bool, device=device)
    argmax = torch.tensor([[7, 9, 9, 3, 4]], device=device)
    got = greedy_accept_triton(argmax, tokens, parents, valid)
    assert got.accepted_nodes.tolist() == [[0, 1, 4, -1, -1]]
    assert got.num_accepted.tolist() == [2]
    assert got.output_token_ids.tolist() == [[7, 9, 4, -1, -1]]
    assert got.bonus_token_ids.tolist() == [4]
    expected = greedy_accept_ref(argmax, tokens, parents, valid)
    assert all(torch.equal(a, e) for a, e in zip(got, expected))


def check_compact_matches_paged_cache(device, dtype, seed: int) -> None:
    """Copy the accepted paths of a batch exactly as NativeRunner.commit does; the kernel's pools equal
    PagedKVCache.compact's bit for bit (trash row included)."""
    gen = torch.Generator().manual_seed(seed)
    num_layers, num_nodes = 3, 16

    def make_cache() -> PagedKVCache:
        cache = PagedKVCache(num_layers, 4, 2, 96, 32, dtype, device, block_size=BLOCK_SIZE)
        for slot, n in zip((3, 1, 0), (40 + num_nodes, 7 + num_nodes, 63 + num_nodes)):
            cache.reserve(slot, n)
        return cache

    reference, kernel = make_cache(), make_cache()
    for pools in zip(reference.k + reference.v, kernel.k + kernel.v):
        values = torch.randn(pools[0].shape, generator=gen).to(device=device, dtype=dtype)
        for p in pools:
            p.copy_(values)
    slots, cache_lens = torch.tensor([3, 1, 0], device=device), torch.tensor([40, 7, 63], device=device)
    # Accepted paths: increasing node ids, root first, -1 padded (lengths 5, 1 and 3).
    nodes = torch.tensor([[0, 2, 5, 6, 11], [0, -1, -1, -1, -1], [0, 1, 15, -1, -1]], device=device)
    rank = torch.arange(nodes.shape[1], device=device)[None]
    ok = nodes >= 0
    src_index = torch.where(ok, cache_lens[:, None] + nodes, reference.trash_index)  # [B, A] logical
    dst_index = torch.where(ok, cache_lens[:, None] + rank, reference.trash_index)
    reference.compact(slots, src_index, dst_index)
    compact_rows_triton(kernel.k + kernel.v, kernel.rows(slots, src_index), kernel.rows(slots, dst_index))
    for layer in range(num_layers):
        assert torch.equal(kernel.k[layer], reference.k[layer]), f"k of layer {layer} differs"
        assert torch.equal(kernel.v[layer], reference.v[layer]), f"v of layer {layer} differs"


def check_compact_random_overlaps(device, dtype, seed: int) -> None:
    """Random pairs where most destinations are also sources: equal to the gather-then-scatter copy."""
    gen = torch.Generator().manual_seed(seed)
    pools = [torch.randn(200, 2, 8, generator=gen).to(device=device, dtype=dtype) for _ in range(4)]
    dst = torch.randperm(200, generator=gen)[:60]
    src = torch.cat([dst[20:], torch.randint(0, 200, (20,), generator=gen)])  # 40 of 60 sources are destinations
    expected = [p.clone() for p in pools]
    compact_rows_ref(expected, src.to(device), dst.to(device))
    compact_rows_triton(pools, src.to(device), dst.to(device))
    assert all(torch.equal(p, e) for p, e in zip(pools, expected))


# ----------------------------------------------------------------------------------------------
# GPU tests


def check_packed_causal_matches_reference(device, dtype, lens: list[int], num_heads: int, num_kv_heads: int,
                                          head_dim: int, seed: int) -> None:
    """The packed prefill's attention (prefill_attention.py) against its reference: prompts of
    `lens` tokens back to back, q, k and v strided as a forward's projections leave them ([T, heads,
    hd] transposed), each prompt's rows attending only within it (a negative control: the same q
    with one prompt's keys changed changes that prompt's rows alone)."""
    from spectandem.kernels.prefill_attention import packed_causal_attention_ref, packed_causal_attention_triton

    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)
    q = torch.randn(total, num_heads, head_dim, generator=gen).to(dtype).to(device).transpose(0, 1)
    k = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device).transpose(0, 1)
    v = torch.randn(total, num_kv_heads, head_dim, generator=gen).to(dtype).to(device).transpose(0, 1)
    starts = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = packed_causal_attention_triton(q, k, v, starts, max(lens), scale)
    ref = packed_causal_attention_ref(q, k, v, starts, max(lens), scale)
    assert out.shape == (total, num_heads * head_dim)
    torch.testing.assert_close(out.float(), ref.float(), **TOLERANCE[dtype])
    # Each row sees its prompt only, and within it only the tokens up to its own: the last prompt's
    # values changed move the last prompt's rows alone; its last token's value moves its last row alone.
    s, e = int(starts[-2]), int(starts[-1])
    v2 = v.clone()
    v2[:, s:e] += 1.0
    out2 = packed_causal_attention_triton(q, k, v2, starts, max(lens), scale)
    assert torch.equal(out2[:s], out[:s]) and not torch.equal(out2[s:e], out[s:e])
    v3 = v.clone()
    v3[:, e - 1] += 1.0
    out3 = packed_causal_attention_triton(q, k, v3, starts, max(lens), scale)
    assert torch.equal(out3[: e - 1], out[: e - 1]) and not torch.equal(out3[e - 1], out[e - 1])


@pytest.fixture(scope="module", autouse=True)
def _cuda_and_triton():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    if not HAVE_TRITON:
        pytest.fail("tests/gpu/test_kernels.py needs triton on the GPU machine")


DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 64), (12, 4, 64)], ids=["gqa4-128", "mha-64", "gqa3-64"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "causal"])
def test_attention_matches_reference(dtype, num_tokens, heads, tree):
    num_heads, num_kv_heads, head_dim = heads
    for seed in range(3):
        check_attention_matches_reference("cuda", dtype, num_tokens, num_heads, num_kv_heads, head_dim,
                                          max_prefix=300, tree=tree, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_attention_matches_paged_cache(dtype):
    check_attention_matches_paged_cache("cuda", dtype, seed=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("heads", [(8, 2, 128), (4, 4, 64)], ids=["gqa4-128", "mha-64"])
def test_attention_batch_invariance(dtype, heads):
    check_attention_batch_invariance("cuda", dtype, *heads, seed=1)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_paired_tiles_equal_single(dtype, monkeypatch):
    check_paired_tiles_equal_single("cuda", dtype, monkeypatch, seed=4)


def test_tiles_per_program_pairs_only_a_full_launch():
    """Two row blocks a program only where there are two and the launch's row blocks fill the GPU
    at least four times over."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    q = lambda b, t: torch.empty(b, 32, t, 128, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    assert attention.tiles_per_program(q(1024, 1), 8) == 1          # one row block each
    full = -(-4 * sms // 16)                                         # 8 kv heads x 2 blocks x full >= 4 x sms
    assert attention.tiles_per_program(q(full, 5), 8) == 2
    assert attention.tiles_per_program(q(full - 1, 5), 8) == 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("lens", [(1,), (70, 3, 129), (248, 226, 42, 162, 135, 244)], ids=["1", "70-3-129", "wave-6"])
@pytest.mark.parametrize("heads", [(32, 8, 128), (4, 4, 64)], ids=["gqa4-128", "mha-64"])
def test_packed_causal_matches_reference(dtype, lens, heads):
    check_packed_causal_matches_reference("cuda", dtype, list(lens), *heads, seed=len(lens))


@pytest.mark.parametrize("batch,num_nodes", [(1, 1), (4, 5), (16, 16), (8, 64), (3, 37)])
def test_accept_matches_verify_greedy(batch, num_nodes):
    for seed in range(5):
        check_accept_matches_reference("cuda", batch, num_nodes, seed)


def test_accept_tie_rule():
    check_accept_tie_rule("cuda")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compact_matches_paged_cache(dtype):
    check_compact_matches_paged_cache("cuda", dtype, seed=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compact_random_overlaps(dtype):
    for seed in range(3):
        check_compact_random_overlaps("cuda", dtype, seed)


def test_kernels_replay_in_a_cuda_graph():
    """No host sync in any wrapper: all three launches are captured once and replayed with new
    lengths, trees and rows copied into the captured inputs."""
    gen = torch.Generator().manual_seed(2)
    batch, num_nodes = 2, 5
    k_pool, v_pool, tables = random_paged_kv(gen, batch, 2, 64, [90, 90], torch.bfloat16, "cuda")
    q = torch.randn(batch, 8, num_nodes, 64, generator=gen).to("cuda", torch.bfloat16)
    prefix = torch.tensor([40, 3], device="cuda")
    tokens, parents, valid = random_tree(gen, batch, num_nodes, 3, "cuda")
    mask = ancestor_mask(parents, valid)
    argmax = torch.randint(0, 3, (batch, num_nodes), generator=gen).cuda()
    src, dst = torch.tensor([50, 60], device="cuda"), torch.tensor([41, 42], device="cuda")
    pools = [torch.randn(100, 2, 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(2)]

    def step():
        out = paged_tree_attention_triton(q, k_pool, v_pool, tables, prefix, mask, 0.125, BLOCK_SIZE)
        compact_rows_triton(pools, src, dst)
        return out, greedy_accept_triton(argmax, tokens, parents, valid)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels and uploads the pools' pointer table
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured_out, captured_accept = step()

    prefix.copy_(torch.tensor([71, 12]))
    new_tokens, new_parents, new_valid = random_tree(gen, batch, num_nodes, 3, "cuda")
    for static, new in ((tokens, new_tokens), (parents, new_parents), (valid, new_valid),
                        (mask, ancestor_mask(new_parents, new_valid))):
        static.copy_(new)
    src.copy_(torch.tensor([7, 8]))
    expected_pools = [p.clone() for p in pools]
    compact_rows_ref(expected_pools, src, dst)
    graph.replay()
    torch.cuda.synchronize()
    out = paged_tree_attention_triton(q, k_pool, v_pool, tables, prefix, mask, 0.125, BLOCK_SIZE)
    assert torch.equal(captured_out, out)
    assert all(torch.equal(a, e) for a, e in zip(captured_accept, greedy_accept_ref(argmax, tokens, parents, valid)))
    assert all(torch.equal(p, e) for p, e in zip(pools, expected_pools))
