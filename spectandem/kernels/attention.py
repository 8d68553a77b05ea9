"""Tree-masked attention over the paged KV cache, batch-invariant.

Glossary (the verifier's words, see verifier/runner.py and spectandem/kv_cache.py):

    pool            `k_pool, v_pool [rows, nkv, hd]`: one layer of PagedKVCache. Logical entry i of
                    request b lives at row `block_tables[b, i // block_size] * block_size +
                    i % block_size`. Example (block_size 4, table [7, 2]): entry 5 -> row 2*4+1 = 9.
    prefix_lens     `[B]`: the committed entries (`cache_len`), visible to every query row.
    round entries   The T query tokens' own K/V, already written at entries prefix_len .. prefix_len+T-1
                    (query token t at prefix_len + t, as NativeRunner.verify writes a tree's nodes).
    tree_mask       `[B, T, T]` bool: query t may see round entry j (True on the diagonal and on t's
                    ancestors; `spectandem.tree.ancestor_mask`). None = causal over the round
                    entries (j <= t), i.e. plain decoding or a chain.

Query token t of request b attends to entries `[0, prefix_len)` and to the round entries its row of
tree_mask allows, nothing else: exactly the mask NativeRunner.verify builds. Example: prefix_len 3,
T = 3, parents [-1, 0, 0] -> token 2 sees entries 0, 1, 2 (prefix), 3 (root) and 5 (itself), not 4.

Batch invariance (what "batch-invariant verification" needs). The kernel reduces over the cache in a
fixed order: logical entries in chunks of BLOCK_N starting at entry 0, whatever T, B or the other
rows are, with one tile shape (BLOCK_M x BLOCK_N, a function of head_dim only) and an online softmax
in fp32. Entries a row may not see get probability exactly 0, and a chunk it cannot see at all
leaves its running max, sum and accumulator bit-for-bit unchanged (rescale factor exp2(0) = 1,
added terms 0). So a query row's output depends only on its own query and the entries it sees:
the token verified alone (T = 1, prefix_len + t committed entries) and the same token as node t of a
chain of 16 give bit-identical results, as do different batch sizes and different sibling rows.
The torch reference has no such guarantee (its matmul tiling follows the shapes), and the two differ
in the last bits: plain decoding and verification must both go through the kernel. tree_mask=None
is turned into a causal mask tensor so that both run the one compiled kernel.

Lengths are read on the device (prefix_lens is loaded by the kernel, never `.item()`ed), so the
launch needs no host sync and can be captured in a CUDA graph with fixed B and T.
"""

from __future__ import annotations

import math

import torch

from spectandem.kernels import HAVE_TRITON
from spectandem.modeling.layers import masked_attention

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_M = 16   # query rows per program; fixed so a row's arithmetic never depends on T
_NUM_WARPS = 4

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_rows", "num_tokens", "max_blocks"])
    def _paged_tree_attention_kernel(
        q_ptr, k_ptr, v_ptr,  # q [B, nh, T, hd]; k, v [rows, nkv, hd]
        tables_ptr,  # [B, max_blocks] physical block ids, -1 where none
        prefix_ptr,  # [B] entries visible to every row
        mask_ptr,  # [B, T, T] uint8: the bool tree mask
        out_ptr,  # [B, T, nh * hd]
        qk_scale,  # scale * log2(e): the softmax runs in base 2
        num_rows,  # T * GROUP query rows per (request, kv head)
        num_tokens,  # T
        max_blocks,
        stride_qb, stride_qh, stride_qt,
        stride_kr, stride_kh,
        stride_tb,
        stride_mb, stride_mt,
        stride_ob, stride_ot,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,  # query heads per kv head
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr,  # block_size of the cache
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // NUM_KV_HEADS
        kv_head = pid % NUM_KV_HEADS
        # The GROUP query heads sharing a kv head are packed into the rows, so each K/V chunk is
        # loaded once per kv head: row r is token r // GROUP of head kv_head * GROUP + r % GROUP.
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = r < num_rows
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + tok[:, None] * stride_qt + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        prefix = tl.load(prefix_ptr + b).to(tl.int32)
        span = prefix + num_tokens

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max (base-2 logits)
        l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(s - m_i)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        # Chunks start at entry 0 for every row: the fixed reduction order of the docstring.
        for start in range(0, span, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # logical entries
            page = n // PAGE
            block = tl.load(tables_ptr + b * stride_tb + page, mask=(n < span) & (page < max_blocks), other=-1)
            phys = block.to(tl.int64) * PAGE + n % PAGE
            kv_mask = (block >= 0)[:, None] & d_ok[None, :]
            kv_offs = phys[:, None] * stride_kr + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]

            j = n - prefix  # round entry index
            in_round = (j >= 0) & (n < span)
            allowed = tl.load(mask_ptr + b * stride_mb + tok[:, None] * stride_mt + j[None, :],
                              mask=row_ok[:, None] & in_round[None, :], other=0) != 0
            visible = (n < prefix)[None, :] | (in_round[None, :] & allowed)
            s = tl.where(visible, s, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead so no NaN appears.
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision="ieee")
            m_i = m_new

        # Rows that see nothing (padding) get zeros; real rows always see themselves.
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + tok[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_tree_attention(
    q: torch.Tensor,  # [B, nh, T, hd]
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] integer, -1 where none
    prefix_lens: torch.Tensor,  # [B] integer
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, or None for causal
    scale: float,
    block_size: int,
) -> torch.Tensor:  # [B, T, nh * hd]
    """The kernel for CUDA tensors when Triton is installed, the torch reference otherwise."""
    if q.is_cuda and HAVE_TRITON:
        return paged_tree_attention_triton(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, scale,
                                           block_size)
    return paged_tree_attention_ref(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, scale, block_size)


def paged_tree_attention_triton(
    q: torch.Tensor,  # [B, nh, T, hd]
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] integer, -1 where none
    prefix_lens: torch.Tensor,  # [B] integer
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, or None for causal
    scale: float,
    block_size: int,
) -> torch.Tensor:  # [B, T, nh * hd]
    """Validates the inputs and launches the kernel (see the module docstring for the semantics).

    Entries a row may see must be mapped in block_tables (PagedKVCache.reserve does that); unmapped
    entries read as zeros here and as the trash row in the reference, and no well-formed mask sees them.
    """
    if not HAVE_TRITON:
        raise RuntimeError("paged_tree_attention_triton needs the triton package")
    _check_inputs(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, block_size)
    last_dim_contiguous = {"q": q, "k_pool": k_pool, "v_pool": v_pool, "block_tables": block_tables,
                           "tree_mask": tree_mask}
    for name, value in last_dim_contiguous.items():
        if value is not None and value.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {value.stride()}")
    if k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool must share strides, got {k_pool.stride()} and {v_pool.stride()}")
    batch_size, num_heads, num_tokens, head_dim = q.shape
    num_kv_heads = k_pool.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty(batch_size, num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if batch_size == 0 or num_tokens == 0:
        return out
    if tree_mask is None:
        # Causal is a tree mask too, and passing it as one keeps a single compiled kernel: on the
        # H200 a variant computing causality in registers differed from the masked one in the last
        # bit, and plain decoding must match verification bit for bit. [T, T], broadcast over B.
        tree_mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=q.device).tril_().expand(
            batch_size, num_tokens, num_tokens)
    mask = tree_mask.view(torch.uint8)  # same storage, no copy; both Triton backends load bytes
    grid = (batch_size * num_kv_heads, triton.cdiv(num_tokens * group, _BLOCK_M))
    _paged_tree_attention_kernel[grid](
        q, k_pool, v_pool, block_tables, prefix_lens, mask, out,
        scale * math.log2(math.e), num_tokens * group, num_tokens, block_tables.shape[1],
        q.stride(0), q.stride(1), q.stride(2),
        k_pool.stride(0), k_pool.stride(1),
        block_tables.stride(0),
        mask.stride(0), mask.stride(1),
        out.stride(0), out.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), PAGE=block_size,
        BLOCK_M=_BLOCK_M, BLOCK_N=_block_n(head_dim),
        num_warps=_NUM_WARPS,
    )
    return out


def paged_tree_attention_ref(
    q: torch.Tensor,  # [B, nh, T, hd]
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] integer, -1 where none
    prefix_lens: torch.Tensor,  # [B] integer
    tree_mask: torch.Tensor | None,  # [B, T, T] bool, or None for causal
    scale: float,
    block_size: int,
) -> torch.Tensor:  # [B, T, nh * hd]
    """The same in torch, as the model computes it today: gather the rows of entries
    [0, max(prefix_lens) + T) (PagedKVCache.rows), build the dense [B, T, span] mask
    (NativeRunner.verify) and call masked_attention."""
    _check_inputs(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, block_size)
    batch_size, _, num_tokens, _ = q.shape
    device = q.device
    prefix = prefix_lens.to(device=device, dtype=torch.int64)
    span = int(prefix.max()) + num_tokens if batch_size else num_tokens
    cols = torch.arange(span, device=device)  # [span] logical entries
    page = (cols // block_size).clamp(max=block_tables.shape[1] - 1)
    block = block_tables.to(device=device, dtype=torch.int64)[:, page]  # [B, span]
    mapped = (block >= 0) & (cols < block_tables.shape[1] * block_size)
    rows = torch.where(mapped, block * block_size + cols % block_size, k_pool.shape[0] - 1)  # [B, span]
    k = k_pool[rows].transpose(1, 2)  # [B, nkv, span, hd]
    v = v_pool[rows].transpose(1, 2)

    if tree_mask is None:
        tree_mask = torch.ones(num_tokens, num_tokens, dtype=torch.bool, device=device).tril().expand(
            batch_size, num_tokens, num_tokens)
    j = cols[None, :] - prefix[:, None]  # [B, span] round entry index
    in_round = (j >= 0) & (j < num_tokens)
    # allowed[b, t, c] = tree_mask[b, t, j[b, c]] where c is a round entry.
    allowed = tree_mask.to(device).gather(2, j.clamp(0, num_tokens - 1)[:, None, :].expand(-1, num_tokens, -1))
    mask = (cols[None, None, :] < prefix[:, None, None]) | (in_round[:, None, :] & allowed)  # [B, T, span]
    return masked_attention(q, k, v, mask, scale)


def _block_n(head_dim: int) -> int:
    """Key chunk length: a function of head_dim alone, never of T or B (batch invariance)."""
    return 64 if head_dim <= 128 else 32


def _check_inputs(q, k_pool, v_pool, block_tables, prefix_lens, tree_mask, block_size) -> None:
    if not isinstance(q, torch.Tensor) or q.dim() != 4 or q.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"q must be a float16/bfloat16/float32 tensor [B, nh, T, hd], got {_describe(q)}")
    batch_size, num_heads, num_tokens, head_dim = q.shape
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 3 or pool.shape[2] != head_dim:
            raise ValueError(f"{name} must be a tensor [rows, nkv, hd] with hd = {head_dim}, got {_describe(pool)}")
        if pool.dtype != q.dtype or pool.device != q.device:
            raise ValueError(f"{name} must have q's dtype {q.dtype} and device {q.device}, got {_describe(pool)}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ in shape")
    if num_heads % k_pool.shape[1]:
        raise ValueError(f"q's {num_heads} heads are not a multiple of the pool's {k_pool.shape[1]} kv heads")
    if not _is_integer(block_tables) or block_tables.dim() != 2 or block_tables.shape[0] != batch_size \
            or block_tables.shape[1] < 1:
        raise ValueError(f"block_tables must be an integer tensor [B, max_blocks] with B = {batch_size}, "
                         f"got {_describe(block_tables)}")
    if not _is_integer(prefix_lens) or tuple(prefix_lens.shape) != (batch_size,):
        raise ValueError(f"prefix_lens must be an integer tensor [B] with B = {batch_size}, "
                         f"got {_describe(prefix_lens)}")
    if tree_mask is not None and (not isinstance(tree_mask, torch.Tensor) or tree_mask.dtype != torch.bool
                                  or tuple(tree_mask.shape) != (batch_size, num_tokens, num_tokens)):
        raise ValueError(f"tree_mask must be None or a bool tensor [B, T, T] = "
                         f"{[batch_size, num_tokens, num_tokens]}, got {_describe(tree_mask)}")
    for name, value in (("block_tables", block_tables), ("prefix_lens", prefix_lens), ("tree_mask", tree_mask)):
        if value is not None and value.device != q.device:
            raise ValueError(f"{name} is on {value.device}, q on {q.device}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")


def _is_integer(value: object) -> bool:
    return isinstance(value, torch.Tensor) and not (
        value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)


def _describe(value: object) -> str:
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype} device {value.device}"
    return type(value).__name__
