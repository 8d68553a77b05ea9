"""The Triton kernels behind spectandem/kernels/fused.py (RMSNorm with and without the residual
add, rotary, the SiLU products). What each must reproduce bit for bit, and how, is in that
module's docstring; this one only holds the kernels, which it launches."""

from __future__ import annotations

from spectandem.kernels import HAVE_TRITON, interpreted

if HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _load_row(x_row, delta_row, cols, H: tl.constexpr, ADD: tl.constexpr):
        """Columns `cols` of one row in fp32: x's, or x + delta rounded to x's dtype (torch's add)."""
        ok = cols < H
        x = tl.load(x_row + cols, mask=ok, other=0.0)
        if ADD:
            delta = tl.load(delta_row + cols, mask=ok, other=0.0)
            x = (x.to(tl.float32) + delta.to(tl.float32)).to(x_row.dtype.element_ty)
        return x.to(tl.float32)  # masked columns are +0.0: a no-op on a sum of squares

    @triton.jit
    def _square(x_row, delta_row, cols, H: tl.constexpr, ADD: tl.constexpr):
        x = _load_row(x_row, delta_row, cols, H, ADD)
        return x * x

    @triton.jit
    def _accumulate(x_row, delta_row, cols, a0, a1, a2, a3, H: tl.constexpr, ACC_STRIDE: tl.constexpr,
                    ADD: tl.constexpr):
        """One step of the four accumulators: each adds the square of its own column."""
        a0 = a0 + _square(x_row, delta_row, cols, H, ADD)
        a1 = a1 + _square(x_row, delta_row, cols + ACC_STRIDE, H, ADD)
        a2 = a2 + _square(x_row, delta_row, cols + 2 * ACC_STRIDE, H, ADD)
        a3 = a3 + _square(x_row, delta_row, cols + 3 * ACC_STRIDE, H, ADD)
        return a0, a1, a2, a3

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr,  # rows of H, H contiguous: row r at (r // inner) * stride_outer + (r % inner) * stride_inner
        delta_ptr,  # ADD: [M, H] contiguous, added to x (then contiguous too); otherwise unused
        sum_ptr,  # ADD: [M, H] contiguous, receives x + delta; otherwise unused
        w_ptr,  # [H]
        out_ptr,  # [M, H] contiguous
        eps,  # fp32, as torch rounds the Python float
        mean_factor,  # fp32: ATen's float(M) / float(M * H)
        inner, stride_outer, stride_inner,
        H: tl.constexpr, LANES: tl.constexpr, LANE_STRIDE: tl.constexpr, ACC_STRIDE: tl.constexpr,
        HALVINGS: tl.constexpr, PAIRINGS: tl.constexpr, BLOCK_H: tl.constexpr, ADD: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + (row // inner) * stride_outer + (row % inner) * stride_inner
        delta_row = delta_ptr + row * H
        # Lane w's accumulator j at step s reads element s * 4 * LANES + w * LANE_STRIDE + j * ACC_STRIDE:
        # vectorized (4, 1): vector s * LANES + w, position j; otherwise (1, LANES): step 4 s + j.
        first = tl.arange(0, LANES) * LANE_STRIDE
        a0 = tl.zeros([LANES], tl.float32)
        a1 = tl.zeros([LANES], tl.float32)
        a2 = tl.zeros([LANES], tl.float32)
        a3 = tl.zeros([LANES], tl.float32)
        # In ATen's step order: each accumulator sums sequentially. Unrolled (at most 63 steps:
        # reduction_layout), so that every load is issued before the sums wait on the first: with
        # 32 lanes a row (16 rows or more) a 4096 row is 32 steps, latency-bound as a loop.
        for start in tl.static_range(0, H, 4 * LANES):
            a0, a1, a2, a3 = _accumulate(x_row, delta_row, start + first, a0, a1, a2, a3, H, ACC_STRIDE, ADD)
        total = ((a0 + a1) + a2) + a3
        # A sum over an axis of 2 is one addition, so these replay block_x_reduce's tree exactly.
        for i in tl.static_range(HALVINGS):  # shared memory: lane w += lane w + half
            total = tl.sum(tl.reshape(total, [2, LANES >> (i + 1)]), axis=0)
        for i in tl.static_range(PAIRINGS):  # warp shuffles: lane w += lane w + 1, w + 2, ...
            total = tl.sum(tl.reshape(total, [(LANES >> HALVINGS) >> (i + 1), 2]), axis=1)
        mean = tl.sum(total, axis=0) * mean_factor
        if INTERPRETED:  # the interpreter has no libdevice
            inv = tl.rsqrt(mean + eps)
        else:
            inv = libdevice.rsqrt(mean + eps)
        for start in range(0, H, BLOCK_H):
            cols = start + tl.arange(0, BLOCK_H)
            ok = cols < H
            # The sum is recomputed (the same bits) rather than read back: other threads stored it.
            x = _load_row(x_row, delta_row, cols, H, ADD)
            if ADD:
                tl.store(sum_ptr + row * H + cols, x.to(sum_ptr.dtype.element_ty), mask=ok)
            # RMSNorm rounds the normalised row to x's dtype before the weight's product.
            y = (x * inv).to(x_ptr.dtype.element_ty).to(tl.float32)
            w = tl.load(w_ptr + cols, mask=ok, other=0.0).to(tl.float32)
            tl.store(out_ptr + row * H + cols, (w * y).to(out_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _rotate_heads(
        x_ptr,  # head 0 of one token, [heads, hd] at stride_h
        out_ptr,
        stride_h, out_stride_h,
        cos1, cos2, sin1, sin2,  # [BLOCK_HALF] fp32: the two halves of the token's tables
        NUM_HEADS: tl.constexpr, BLOCK_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_HALF: tl.constexpr,
    ):
        h = tl.arange(0, BLOCK_HEADS)[:, None]
        d = tl.arange(0, BLOCK_HALF)[None, :]
        ok = (h < NUM_HEADS) & (d < HALF)
        x1 = tl.load(x_ptr + h * stride_h + d, mask=ok, other=0.0).to(tl.float32)
        x2 = tl.load(x_ptr + h * stride_h + HALF + d, mask=ok, other=0.0).to(tl.float32)
        dt = out_ptr.dtype.element_ty
        # x * cos + rotate_half(x) * sin with rotate_half(x) = cat(-x2, x1); each product rounded to
        # x's dtype before the sum, as torch's kernels round (a no-op in fp32).
        lo = (x1 * cos1[None, :]).to(dt).to(tl.float32) + ((x2 * -1.0) * sin1[None, :]).to(dt).to(tl.float32)
        hi = (x2 * cos2[None, :]).to(dt).to(tl.float32) + (x1 * sin2[None, :]).to(dt).to(tl.float32)
        tl.store(out_ptr + h * out_stride_h + d, lo.to(dt), mask=ok)
        tl.store(out_ptr + h * out_stride_h + HALF + d, hi.to(dt), mask=ok)

    @triton.jit(do_not_specialize=["num_tokens"])
    def _rotary_kernel(
        q_ptr,  # [B, nh, T, hd], hd contiguous
        k_ptr,  # [B, nkv, T, hd], hd contiguous
        cos_ptr, sin_ptr,  # [B, T, hd] contiguous
        q_out_ptr,  # as q
        k_out_ptr,  # as k; WRITE: the K pool [rows, nkv, hd] contiguous
        num_tokens,  # T
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, soq_b, soq_h, soq_t, sok_b, sok_h, sok_t,
        rows_ptr,  # WRITE: [B * T] int64, the pool row of token b * T + t; otherwise unused
        v_ptr,  # WRITE: [B, nkv, T, hd], hd contiguous, copied to the V pool's row; otherwise unused
        v_pool_ptr,  # WRITE: the V pool [rows, nkv, hd] contiguous; otherwise unused
        sv_b, sv_h, sv_t,
        NUM_Q: tl.constexpr, NUM_K: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
        HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, WRITE: tl.constexpr,
    ):
        r = tl.program_id(0).to(tl.int64)  # token b * T + t: every head of q and k, one table row
        b = r // num_tokens
        t = r % num_tokens
        d = tl.arange(0, BLOCK_HALF)
        d_ok = d < HALF
        table = r * 2 * HALF
        cos1 = tl.load(cos_ptr + table + d, mask=d_ok, other=0.0).to(tl.float32)
        cos2 = tl.load(cos_ptr + table + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        sin1 = tl.load(sin_ptr + table + d, mask=d_ok, other=0.0).to(tl.float32)
        sin2 = tl.load(sin_ptr + table + HALF + d, mask=d_ok, other=0.0).to(tl.float32)
        _rotate_heads(q_ptr + b * sq_b + t * sq_t, q_out_ptr + b * soq_b + t * soq_t, sq_h, soq_h,
                      cos1, cos2, sin1, sin2, NUM_Q, BLOCK_Q, HALF, BLOCK_HALF)
        if WRITE:  # k rotated into the pool's row, v copied into the other pool's: no index_put
            pool_row = tl.load(rows_ptr + r) * (NUM_K * 2 * HALF)
            _rotate_heads(k_ptr + b * sk_b + t * sk_t, k_out_ptr + pool_row, sk_h, 2 * HALF,
                          cos1, cos2, sin1, sin2, NUM_K, BLOCK_K, HALF, BLOCK_HALF)
            h = tl.arange(0, BLOCK_K)[:, None]
            dd = tl.arange(0, 2 * BLOCK_HALF)[None, :]
            ok = (h < NUM_K) & (dd < 2 * HALF)
            v = tl.load(v_ptr + b * sv_b + t * sv_t + h * sv_h + dd, mask=ok, other=0.0)
            tl.store(v_pool_ptr + pool_row + h * (2 * HALF) + dd, v, mask=ok)
        else:
            _rotate_heads(k_ptr + b * sk_b + t * sk_t, k_out_ptr + b * sok_b + t * sok_t, sk_h, sok_h,
                          cos1, cos2, sin1, sin2, NUM_K, BLOCK_K, HALF, BLOCK_HALF)

    @triton.jit
    def _silu_times(gate, up, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
        """F.silu(gate) * up from fp32 loads of dtype values, rounded to dtype."""
        if INTERPRETED:  # the interpreter has no libdevice
            e = tl.exp(gate * -1.0)
        else:
            e = libdevice.exp(gate * -1.0)
        # ATen's silu: x / (1 + exp(-x)) in fp32, rounded to the dtype; then the product, rounded.
        act = tl.div_rn(gate, 1.0 + e).to(dtype).to(tl.float32)
        return (act * up).to(dtype)

    @triton.jit(do_not_specialize=["numel"])
    def _silu_mul_kernel(
        gate_ptr, up_ptr, out_ptr,  # [numel] contiguous, one dtype
        numel,
        BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < numel
        g = tl.load(gate_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(up_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, _silu_times(g, u, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)

    @triton.jit
    def _silu_mul_packed_kernel(
        gate_up_ptr,  # [M, 2 * I] contiguous: gate then up
        out_ptr,  # [M, I] contiguous
        inter,  # I
        BLOCK: tl.constexpr, INTERPRETED: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = cols < inter
        gate_row = gate_up_ptr + row * 2 * inter
        g = tl.load(gate_row + cols, mask=ok, other=0.0).to(tl.float32)
        u = tl.load(gate_row + inter + cols, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * inter + cols, _silu_times(g, u, out_ptr.dtype.element_ty, INTERPRETED), mask=ok)

    _INTERPRETED = interpreted(_silu_mul_kernel)

