"""Batch-invariant kernels: a row's result does not depend on the other rows of the forward.

Why. Greedy speculation is lossless only if the verifier's logits for a token equal the logits
plain decoding computes for it. cuBLAS and torch's reductions pick kernels (tile shapes, split-K,
split reductions) from the problem size, so the same row verified inside a tree of T nodes and
decoded alone (T = 1) is summed in different orders and rounds differently in bf16. Here every
reduction has one order, fixed by the weights' shapes and the model config only:

    bi_linear     x @ W.T (+ bias): tiles BLOCK_M x BLOCK_N x BLOCK_K and num_warps chosen from
                  (N, K) alone, never from M; no split-K; fp32 accumulation in K order.
    bi_rmsnorm    one program per row, fixed chunks over the hidden size.
    bi_attention  each query row reduces over its OWN logical key sequence, below.

Logical keys of a query row (bi_attention). Row t of request b sees, in this order:

    logical 0 .. prefix_lens[b, t] - 1      cache entries 0.. of request b, physical row
                                            `block_tables[b, i // block_size] * block_size +
                                            i % block_size` (PagedKVCache's layout)
    then path_rows[b, t, 0 .. path_lens[b, t] - 1]
                                            physical rows of the row's tree path: the root first,
                                            then each ancestor by depth, the row's own node last

Example (block_size 4, table [7, 2], prefix 5, tree parents [-1, 0, 0, 1] written at rows
[40, 41, 42, 43]): node 3's keys are rows [28, 29, 30, 31, 8] (entries 0..4), then [40, 41, 43]
(root, node 1, itself): 8 logical keys, node 2 is not among them.

A plain decode row (T = 1: prefix = committed entries, path = itself) has exactly the logical
sequence the same token has as an accepted node of a speculative round (the round's prefix, then
its ancestors, which are the tokens decoded in between). The softmax runs online in fp32 over
chunks of BLOCK_N logical keys from logical 0; keys past the row's length get probability exactly
0 (their K/V load as zeros), so they are no-ops. So the token's attention output is bit-for-bit the
same whether decoded alone, verified in a chain or a branching tree, at any batch size, wherever its
context sits in the pool; with bi_linear and bi_rmsnorm the whole forward row is. Prefill uses
prefix_lens[b, t] = t + 1 and no path: the same sequence again.

Every public function has three forms, as in the rest of spectandem.kernels: `<name>_triton` (the
kernel behind a validating wrapper), `<name>_ref` (torch, any device: the same math, without the
invariance) and `<name>` (the kernel for CUDA tensors when Triton is installed, the reference
otherwise). Hazards: Triton specialises integer arguments (== 1, divisible by 16) into separate
compiled kernels, so every argument that varies with B or T is `do_not_specialize`; one compiled
kernel per weight shape is what makes rows agree bit for bit.

Speed: bi_linear is written for decode (weight-bandwidth-bound, BLOCK_M 16) and re-reads the
weights per 16 rows in prefill; bi_attention runs one program per (query row, kv head). Measured
speed on the H200 is TBD.
"""

from __future__ import annotations

import math

import torch

from spectandem.checks import describe_placed
from spectandem.kernels import HAVE_TRITON
from spectandem.kernels.attention import check_query_and_pools
from spectandem.tree import node_depths

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK_M = 16     # bi_linear rows per program: the smallest tl.dot tile, for any M
_NUM_WARPS = 4

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit(do_not_specialize=["num_rows"])
    def _bi_linear_kernel(
        x_ptr,  # [M, K]
        w_ptr,  # [N, K]
        bias_ptr,  # [N] (unused without HAS_BIAS)
        out_ptr,  # [M, N]
        num_rows,  # M
        N: tl.constexpr, K: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # Grid (M tiles, N tiles): consecutive programs share a weight tile, which stays in L2.
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < num_rows, rn < N
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):  # K in order, one accumulator: the fixed reduction
            kk = k0 + rk
            a = tl.load(x_ptr + rm.to(tl.int64)[:, None] * K + kk[None, :],
                        mask=m_ok[:, None] & (kk < K)[None, :], other=0.0)
            w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :],
                        mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
            acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & n_ok[None, :])

    @triton.jit
    def _bi_rmsnorm_kernel(
        x_ptr,  # [M, H]
        w_ptr,  # [H]
        out_ptr,  # [M, H]
        eps,
        H: tl.constexpr, BLOCK_H: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK_H)
        sq = tl.zeros([BLOCK_H], tl.float32)
        for h0 in range(0, H, BLOCK_H):
            x = tl.load(x_ptr + row * H + h0 + cols, mask=h0 + cols < H, other=0.0).to(tl.float32)
            sq += x * x
        inv = tl.rsqrt(tl.sum(sq, 0) / H + eps)
        for h0 in range(0, H, BLOCK_H):
            ok = h0 + cols < H
            x = tl.load(x_ptr + row * H + h0 + cols, mask=ok, other=0.0).to(tl.float32)
            # RMSNorm rounds the normalised row to x's dtype before scaling by the weight.
            y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + h0 + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + h0 + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit(do_not_specialize=["num_tokens", "max_blocks", "max_path"])
    def _bi_attention_kernel(
        q_ptr,  # [B * T, nh, hd] contiguous
        k_ptr, v_ptr,  # [rows, nkv, hd]
        tables_ptr,  # [B, max_blocks]
        prefix_ptr,  # [B * T]
        path_ptr,  # [B * T, max_path]
        path_len_ptr,  # [B * T]
        out_ptr,  # [B * T, nh * hd]
        qk_scale,  # scale * log2(e): the softmax runs in base 2
        num_tokens, max_blocks, max_path,
        stride_kr, stride_kh,
        NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)  # query row b * T + t
        kv_head = tl.program_id(1)
        b = r // num_tokens
        # The GROUP query heads of this kv head are the rows of one tile: each K/V chunk loads once.
        g = tl.arange(0, BLOCK_G)
        head = kv_head * GROUP + g
        d = tl.arange(0, BLOCK_D)
        qd_ok = (g < GROUP)[:, None] & (d < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + r * NUM_HEADS * HEAD_DIM + head[:, None] * HEAD_DIM + d[None, :], mask=qd_ok, other=0.0)
        prefix = tl.load(prefix_ptr + r).to(tl.int32)
        length = prefix + tl.load(path_len_ptr + r).to(tl.int32)

        m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_G], tl.float32)
        acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
        for start in range(0, length, BLOCK_N):  # from logical 0 for every row: the fixed order
            n = start + tl.arange(0, BLOCK_N)
            visible = n < length
            in_prefix = n < prefix
            page = n // PAGE
            block = tl.load(tables_ptr + b * max_blocks + page, mask=in_prefix & (page < max_blocks), other=-1)
            path_row = tl.load(path_ptr + r * max_path + (n - prefix), mask=visible & ~in_prefix, other=-1)
            phys = tl.where(in_prefix, block.to(tl.int64) * PAGE + n % PAGE, path_row.to(tl.int64))
            mapped = visible & tl.where(in_prefix, block >= 0, path_row >= 0)
            offs = phys[:, None] * stride_kr + kv_head * stride_kh + d[None, :]
            kv_ok = mapped[:, None] & (d < HEAD_DIM)[None, :]
            k = tl.load(k_ptr + offs, mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + offs, mask=kv_ok, other=0.0).to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
            s = tl.where(visible[None, :], s, float("-inf"))
            # Every chunk holds a visible key (start < length), so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # a row with no keys (padding): zeros
        tl.store(out_ptr + r * NUM_HEADS * HEAD_DIM + head[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=qd_ok)


# ----------------------------------------------------------------------------------------------
# Linear


def linear_config(n: int, k: int) -> dict:
    """bi_linear's tiles from the weight shape alone (never M: batch invariance)."""
    return dict(BLOCK_M=_BLOCK_M, BLOCK_N=32 if n < 8192 else 64,
                BLOCK_K=min(128, max(16, 1 << (k - 1).bit_length())), num_warps=_NUM_WARPS, num_stages=3)


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K], weight [N, K], bias [N] or None -> [..., N] in x's dtype."""
    if x.is_cuda and HAVE_TRITON:
        return bi_linear_triton(x, weight, bias)
    return bi_linear_ref(x, weight, bias)


def bi_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if not HAVE_TRITON:
        raise RuntimeError("bi_linear_triton needs the triton package")
    _check_linear(x, weight, bias)
    n, k = weight.shape
    x2 = x.reshape(-1, k).contiguous()
    out = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        cfg = linear_config(n, k)
        grid = (triton.cdiv(x2.shape[0], cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]))
        _bi_linear_kernel[grid](x2, weight.contiguous(), weight if bias is None else bias.contiguous(), out,
                                x2.shape[0], N=n, K=k, HAS_BIAS=bias is not None, **cfg)
    return out.view(*x.shape[:-1], n)


def bi_linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 accumulation, rounded once to x's dtype (as the kernel; torch picks its own order)."""
    _check_linear(x, weight, bias)
    out = x.float() @ weight.float().T
    return (out if bias is None else out + bias.float()).to(x.dtype)


def _check_linear(x, weight, bias) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor [..., K], got {describe_placed(x)}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(f"weight must be a tensor [N, K] with K = {x.shape[-1]}, got {describe_placed(weight)}")
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (t.dtype != x.dtype or t.device != x.device):
            raise ValueError(f"{name} must have x's dtype {x.dtype} and device {x.device}, got {describe_placed(t)}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be a tensor [N] with N = {weight.shape[0]}, got {describe_placed(bias)}")


# ----------------------------------------------------------------------------------------------
# RMSNorm


def bi_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., H], weight [H] -> [..., H], spectandem.modeling.layers.RMSNorm's semantics."""
    if x.is_cuda and HAVE_TRITON:
        return bi_rmsnorm_triton(x, weight, eps)
    return bi_rmsnorm_ref(x, weight, eps)


def bi_rmsnorm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not HAVE_TRITON:
        raise RuntimeError("bi_rmsnorm_triton needs the triton package")
    _check_rmsnorm(x, weight)
    h = x.shape[-1]
    x2 = x.reshape(-1, h).contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    if x2.shape[0]:
        _bi_rmsnorm_kernel[(x2.shape[0],)](x2, weight.contiguous(), out, float(eps), H=h,
                                           BLOCK_H=min(4096, triton.next_power_of_2(h)), num_warps=_NUM_WARPS)
    return out.view(x.shape)


def bi_rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm.forward: statistics in fp32, the row rounded to x's dtype, then times the weight."""
    _check_rmsnorm(x, weight)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _check_rmsnorm(x, weight) -> None:
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or x.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"x must be a float16/bfloat16/float32 tensor [..., H], got {describe_placed(x)}")
    if not isinstance(weight, torch.Tensor) or tuple(weight.shape) != (x.shape[-1],) \
            or weight.dtype not in _FLOAT_DTYPES or weight.device != x.device:
        raise ValueError(f"weight must be a float tensor [{x.shape[-1]}] on {x.device}, got {describe_placed(weight)}")


# ----------------------------------------------------------------------------------------------
# Attention


def bi_attention(
    q: torch.Tensor,  # [B, nh, T, hd] rotated queries
    k_pool: torch.Tensor,  # [rows, nkv, hd]
    v_pool: torch.Tensor,  # [rows, nkv, hd]
    block_tables: torch.Tensor,  # [B, max_blocks] physical block ids, -1 where none
    prefix_lens: torch.Tensor,  # [B, T] cache entries row t reads through its table
    path_rows: torch.Tensor,  # [B, T, D >= 1] physical rows of row t's path, root first, -1 padded
    path_lens: torch.Tensor,  # [B, T] entries of path_rows[b, t] in use
    scale: float,
    block_size: int,
) -> torch.Tensor:  # [B, T, nh * hd]
    """The kernel for CUDA tensors when Triton is installed, the torch reference otherwise."""
    args = (q, k_pool, v_pool, block_tables, prefix_lens, path_rows, path_lens, scale, block_size)
    return bi_attention_triton(*args) if q.is_cuda and HAVE_TRITON else bi_attention_ref(*args)


def bi_attention_triton(q, k_pool, v_pool, block_tables, prefix_lens, path_rows, path_lens, scale: float,
                        block_size: int) -> torch.Tensor:
    """Validates the inputs and launches one program per (query row, kv head); arguments as
    `bi_attention`, semantics in the module docstring."""
    if not HAVE_TRITON:
        raise RuntimeError("bi_attention_triton needs the triton package")
    _check_attention(q, k_pool, v_pool, block_tables, prefix_lens, path_rows, path_lens, block_size)
    if k_pool.stride(-1) != 1 or k_pool.stride() != v_pool.stride():
        raise ValueError(f"k_pool and v_pool must share strides, contiguous in hd; got {k_pool.stride()} "
                         f"and {v_pool.stride()}")
    b, nh, t, hd = q.shape
    nkv = k_pool.shape[1]
    out = torch.empty(b, t, nh * hd, dtype=q.dtype, device=q.device)
    if b * t == 0:
        return out
    # One integer dtype and contiguous rows: one compiled kernel whatever the caller passes.
    ints = [a.to(torch.int32).contiguous() for a in (block_tables, prefix_lens, path_rows, path_lens)]
    block_d = max(16, triton.next_power_of_2(hd))
    _bi_attention_kernel[(b * t, nkv)](
        q.transpose(1, 2).contiguous(), k_pool, v_pool, *ints, out,
        scale * math.log2(math.e), t, block_tables.shape[1], path_rows.shape[2],
        k_pool.stride(0), k_pool.stride(1),
        NUM_HEADS=nh, GROUP=nh // nkv, BLOCK_G=max(16, triton.next_power_of_2(nh // nkv)),
        HEAD_DIM=hd, BLOCK_D=block_d, PAGE=block_size, BLOCK_N=attention_block_n(hd),
        num_warps=_NUM_WARPS,
    )
    return out


def bi_attention_ref(q, k_pool, v_pool, block_tables, prefix_lens, path_rows, path_lens, scale: float,
                     block_size: int) -> torch.Tensor:
    """The same math in torch (fp32 scores, softmax and P @ V): each row's logical keys gathered
    into [B, T, L, nkv, hd] with L the longest row's length, the rest masked out."""
    _check_attention(q, k_pool, v_pool, block_tables, prefix_lens, path_rows, path_lens, block_size)
    b, nh, t, hd = q.shape
    nkv = k_pool.shape[1]
    prefix = prefix_lens.long()
    length = prefix + path_lens.long()                                              # [B, T]
    span = max(int(length.max()), 1) if b * t else 1
    j = torch.arange(span, device=q.device)                                         # [L] logical keys
    page = j // block_size
    block = block_tables.long()[:, page.clamp(max=block_tables.shape[1] - 1)]      # [B, L]
    table_rows = torch.where((block >= 0) & (page < block_tables.shape[1]), block * block_size + j % block_size, -1)
    in_prefix = j < prefix[..., None]                                               # [B, T, L]
    along = (j - prefix[..., None]).clamp(0, path_rows.shape[2] - 1)
    phys = torch.where(in_prefix, table_rows[:, None, :], path_rows.long().gather(2, along))
    visible = j < length[..., None]
    mapped = (visible & (phys >= 0))[..., None, None]
    k = torch.where(mapped, k_pool[phys.clamp(min=0)].float(), 0.0)                # [B, T, L, nkv, hd]
    v = torch.where(mapped, v_pool[phys.clamp(min=0)].float(), 0.0)
    qg = q.float().transpose(1, 2).reshape(b, t, nkv, nh // nkv, hd)              # head = kv * G + g
    s = torch.einsum("btkgd,btlkd->btkgl", qg, k) * scale
    s = s.masked_fill(~visible[:, :, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)  # a row with no keys: zeros, as the kernel
    return torch.einsum("btkgl,btlkd->btkgd", p, v).reshape(b, t, nh * hd).to(q.dtype)


def attention_block_n(head_dim: int) -> int:
    """Logical keys per chunk: from head_dim alone (about 4096 fp32 V values per program)."""
    return min(64, max(16, 4096 // max(16, 1 << (head_dim - 1).bit_length())))


def tree_paths(parents: torch.Tensor, node_valid: torch.Tensor,
               node_rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The `path_rows, path_lens` of bi_attention for tree nodes.

    parents [B, N] (parents precede children, -1 for the root and padding), node_valid [B, N],
    node_rows [B, N] physical row of each node -> path_rows [B, N, D] (root first, node last, -1
    padded; D = deepest node + 1), path_lens [B, N]. Invalid nodes' path is themselves.
    Example: parents [-1, 0, 0, 1], node_rows [40, 41, 42, 43] -> path_rows [[40, -1, -1],
    [40, 41, -1], [40, 42, -1], [40, 41, 43]], path_lens [1, 2, 2, 3].
    """
    b, n = parents.shape
    depth = node_depths(parents, node_valid)                                        # [B, N]
    nodes = torch.full((b, n, int(depth.max()) + 1 if n else 1), -1, dtype=torch.long, device=parents.device)
    rows = torch.arange(b, device=parents.device)
    # Parents precede children: one pass in node order copies complete parent paths.
    for i in range(n):
        p = parents[:, i]
        if i:
            inherit = (node_valid[:, i] & (p >= 0))[:, None]
            nodes[:, i] = torch.where(inherit, nodes[rows, p.clamp(min=0)], -1)
        nodes[rows, i, depth[:, i]] = i
    path_rows = torch.where(nodes >= 0, node_rows.long().gather(1, nodes.clamp(min=0).flatten(1)).view_as(nodes), -1)
    return path_rows, depth + 1


def _check_attention(q, k_pool, v_pool, block_tables, prefix_lens, path_rows, path_lens, block_size) -> None:
    check_query_and_pools(q, k_pool, v_pool)
    b, _, t, _ = q.shape
    expected = {"block_tables": (b, None), "prefix_lens": (b, t), "path_rows": (b, t, None),
                "path_lens": (b, t)}
    for name, value in zip(expected, (block_tables, prefix_lens, path_rows, path_lens)):
        shape = expected[name]
        ok = isinstance(value, torch.Tensor) and not (value.dtype.is_floating_point or value.dtype == torch.bool) \
            and value.dim() == len(shape) and all(v >= 1 if s is None else s == v for s, v in zip(shape, value.shape))
        if not ok or value.device != q.device:
            dims = ", ".join("n >= 1" if s is None else str(s) for s in shape)
            raise ValueError(f"{name} must be an integer tensor [{dims}] on {q.device}, got {describe_placed(value)}")
    if not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
