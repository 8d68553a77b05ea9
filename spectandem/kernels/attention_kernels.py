"""The Triton kernels of the paged tree attention: the one-pass kernel, the split-KV kernel and
the combine of its lanes, around one chunk loop (`_attend_entries`). Their semantics, the
reduction order that makes them batch-invariant and when each runs are in
spectandem/kernels/attention.py, which launches them."""

from __future__ import annotations

from spectandem.kernels import HAVE_TRITON

if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile_step(
        q, k, v,  # q [BLOCK_M, BLOCK_D] one tile of query rows; k, v [BLOCK_N, BLOCK_D] a chunk of entries
        m_i, l_i, acc,  # the tile's running state
        n, b, prefix, span, tok, row_ok, mask_ptr, qk_scale, stride_mb, stride_mt,
    ):
        """One chunk of entries n into one tile's online softmax: (running max m in base 2, sum l
        of exp2(s - m), un-normalised accumulator acc), all fp32. Every tile of every kernel goes
        through these operations in this order, so a row's arithmetic is the same whichever tile,
        program or launch holds it."""
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
        return m_new, l_i, acc

    @triton.jit
    def _attend_entries(
        q_a, q_b,  # [BLOCK_M, BLOCK_D] the program's query tiles (q_b unused unless TILES == 2)
        lo, hi,  # logical entries [lo, hi) in chunks of BLOCK_N from lo
        m_a, l_a, acc_a, m_b, l_b, acc_b,  # the tiles' running state so far (`_empty_state` at first)
        b, kv_head, prefix, span, tok_a, row_ok_a, tok_b, row_ok_b, d, d_ok,
        k_ptr, v_ptr, tables_ptr, mask_ptr, qk_scale, max_blocks,
        stride_kr, stride_kh, stride_tb, stride_mb, stride_mt,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        TILES: tl.constexpr,  # 1 or 2 tiles of BLOCK_M rows, sharing each chunk's K/V load
    ):
        """Online softmax of one or two tiles of query rows over entries [lo, hi), from the state
        given: per tile (m, l, acc) as `_tile_step` keeps them; m = -inf, l = 0, acc = 0 where a
        row saw nothing. The tiles share the chunk loop and its loads of the block table, K and V.
        Both kernels run their chunks through here."""
        for start in range(lo, hi, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)  # logical entries
            page = n // PAGE
            block = tl.load(tables_ptr + b * stride_tb + page, mask=(n < span) & (page < max_blocks), other=-1)
            phys = block.to(tl.int64) * PAGE + n % PAGE
            kv_mask = (block >= 0)[:, None] & d_ok[None, :]
            kv_offs = phys[:, None] * stride_kr + kv_head * stride_kh + d[None, :]
            k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
            m_a, l_a, acc_a = _tile_step(q_a, k, v, m_a, l_a, acc_a, n, b, prefix, span, tok_a, row_ok_a,
                                         mask_ptr, qk_scale, stride_mb, stride_mt)
            if TILES == 2:
                m_b, l_b, acc_b = _tile_step(q_b, k, v, m_b, l_b, acc_b, n, b, prefix, span, tok_b, row_ok_b,
                                             mask_ptr, qk_scale, stride_mb, stride_mt)
        return m_a, l_a, acc_a, m_b, l_b, acc_b

    @triton.jit
    def _empty_state(BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
        """A tile's online-softmax state before any entry: m = -inf, l = 0, acc = 0."""
        return (tl.full([BLOCK_M], float("-inf"), tl.float32), tl.zeros([BLOCK_M], tl.float32),
                tl.zeros([BLOCK_M, BLOCK_D], tl.float32))

    @triton.jit
    def _query_tile(q_ptr, b, kv_head, row_block, num_rows, d, d_ok, stride_qb, stride_qh, stride_qt,
                    GROUP: tl.constexpr, BLOCK_M: tl.constexpr):
        """Row block `row_block` of (request b, kv head): its rows r, their tokens and heads, which
        of them exist, and their queries [BLOCK_M, BLOCK_D] (zeros where none). The GROUP query
        heads sharing a kv head are packed into the rows, so each K/V chunk is loaded once per kv
        head: row r is token r // GROUP of head kv_head * GROUP + r % GROUP."""
        r = row_block * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = r < num_rows
        q = tl.load(q_ptr + b * stride_qb + head[:, None] * stride_qh + tok[:, None] * stride_qt + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        return r, tok, head, row_ok, q

    @triton.jit
    def _store_tile(out_ptr, b, tok, head, row_ok, d, d_ok, l_i, acc, stride_ob, stride_ot, HEAD_DIM: tl.constexpr):
        """A tile's normalised output; rows that saw nothing (padding) get zeros (real rows always
        see themselves)."""
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + tok[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])

    @triton.jit
    def _store_partials(stats_ptr, acc_ptr, pid, split, r, row_ok, d, d_ok, m_i, l_i, acc, num_rows,
                        stride_sp, stride_ss, stride_ap, stride_as, stride_ar):
        """A tile's partials of lane `split`: m and l into stats, acc as it is."""
        stats = stats_ptr + pid.to(tl.int64) * stride_sp + split * stride_ss + r
        tl.store(stats, m_i, mask=row_ok)
        tl.store(stats + num_rows, l_i, mask=row_ok)
        tl.store(acc_ptr + pid.to(tl.int64) * stride_ap + split * stride_as + r[:, None] * stride_ar + d[None, :],
                 acc, mask=row_ok[:, None] & d_ok[None, :])

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
        TILES: tl.constexpr,  # row blocks per program: 1, or 2 (blocks 2p and 2p + 1)
    ):
        pid = tl.program_id(0)
        b = pid // NUM_KV_HEADS
        kv_head = pid % NUM_KV_HEADS
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        first = tl.program_id(1) * TILES
        # With one tile, tile b is tile a again and goes unused (TILES is a constant of the compile).
        r_a, tok_a, head_a, row_ok_a, q_a = _query_tile(q_ptr, b, kv_head, first, num_rows, d, d_ok,
                                                        stride_qb, stride_qh, stride_qt, GROUP, BLOCK_M)
        r_b, tok_b, head_b, row_ok_b, q_b = _query_tile(q_ptr, b, kv_head, first + TILES - 1, num_rows, d, d_ok,
                                                        stride_qb, stride_qh, stride_qt, GROUP, BLOCK_M)
        prefix = tl.load(prefix_ptr + b).to(tl.int32)
        span = prefix + num_tokens

        # Chunks start at entry 0 for every row: the fixed reduction order of the docstring.
        m_a, l_a, acc_a = _empty_state(BLOCK_M, BLOCK_D)
        m_b, l_b, acc_b = _empty_state(BLOCK_M, BLOCK_D)
        m_a, l_a, acc_a, m_b, l_b, acc_b = _attend_entries(
            q_a, q_b, 0, span, m_a, l_a, acc_a, m_b, l_b, acc_b, b, kv_head, prefix, span, tok_a, row_ok_a, tok_b,
            row_ok_b, d, d_ok, k_ptr, v_ptr, tables_ptr, mask_ptr, qk_scale, max_blocks,
            stride_kr, stride_kh, stride_tb, stride_mb, stride_mt,
            PAGE, BLOCK_M, BLOCK_N, BLOCK_D, TILES)
        _store_tile(out_ptr, b, tok_a, head_a, row_ok_a, d, d_ok, l_a, acc_a, stride_ob, stride_ot, HEAD_DIM)
        if TILES == 2:
            _store_tile(out_ptr, b, tok_b, head_b, row_ok_b, d, d_ok, l_b, acc_b, stride_ob, stride_ot, HEAD_DIM)

    # The stats' strides (multiples of T * GROUP) stay unspecialised, like the lengths.
    @triton.jit(do_not_specialize=["num_rows", "num_tokens", "max_blocks", "num_splits", "stride_sp", "stride_ss"])
    def _paged_tree_attention_split_kernel(
        q_ptr, k_ptr, v_ptr,  # q [B, nh, T, hd]; k, v [rows, nkv, hd]
        tables_ptr,  # [B, max_blocks] physical block ids, -1 where none
        prefix_ptr,  # [B] entries visible to every row
        mask_ptr,  # [B, T, T] uint8: the bool tree mask
        stats_ptr,  # [B * nkv, num_splits, 2, T * GROUP] fp32: m (base 2), then l, per (lane, row)
        acc_ptr,  # [B * nkv, num_splits, T * GROUP, hd] fp32: un-normalised accumulator per (lane, row)
        qk_scale,
        num_rows,  # T * GROUP
        num_tokens,  # T
        max_blocks,
        num_splits,
        stride_qb, stride_qh, stride_qt,
        stride_kr, stride_kh,
        stride_tb,
        stride_mb, stride_mt,
        stride_sp, stride_ss,  # stats: per (request, kv head), per lane (its l follows at + num_rows)
        stride_ap, stride_as, stride_ar,  # acc: per (request, kv head), per lane, per row
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        PAGE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        SPLIT: tl.constexpr,  # split_len: segment s holds logical entries [s * SPLIT, (s + 1) * SPLIT)
        TILES: tl.constexpr,  # row blocks per program, as in the one-pass kernel
    ):
        pid = tl.program_id(0)
        split = tl.program_id(2)  # the lane: segments split, split + num_splits, split + 2 * num_splits, ...
        b = pid // NUM_KV_HEADS
        prefix = tl.load(prefix_ptr + b).to(tl.int32)
        span = prefix + num_tokens
        lo = split * SPLIT
        # A lane whose first segment starts at or past the span holds nothing: the program writes
        # nothing and the combine, which reads lanes [0, cdiv(span, SPLIT)) only, never looks at its slot.
        if lo < span:
            kv_head = pid % NUM_KV_HEADS
            d = tl.arange(0, BLOCK_D)
            d_ok = d < HEAD_DIM
            first = tl.program_id(1) * TILES
            r_a, tok_a, head_a, row_ok_a, q_a = _query_tile(q_ptr, b, kv_head, first, num_rows, d, d_ok,
                                                            stride_qb, stride_qh, stride_qt, GROUP, BLOCK_M)
            r_b, tok_b, head_b, row_ok_b, q_b = _query_tile(q_ptr, b, kv_head, first + TILES - 1, num_rows, d,
                                                            d_ok, stride_qb, stride_qh, stride_qt, GROUP, BLOCK_M)
            m_a, l_a, acc_a = _empty_state(BLOCK_M, BLOCK_D)
            m_b, l_b, acc_b = _empty_state(BLOCK_M, BLOCK_D)
            # The lane's segments in increasing order, one running state over all of them.
            for seg in range(lo, span, num_splits * SPLIT):
                m_a, l_a, acc_a, m_b, l_b, acc_b = _attend_entries(
                    q_a, q_b, seg, tl.minimum(seg + SPLIT, span), m_a, l_a, acc_a, m_b, l_b, acc_b, b, kv_head,
                    prefix, span, tok_a, row_ok_a, tok_b, row_ok_b, d, d_ok, k_ptr, v_ptr, tables_ptr, mask_ptr,
                    qk_scale, max_blocks, stride_kr, stride_kh, stride_tb, stride_mb, stride_mt, PAGE, BLOCK_M,
                    BLOCK_N, BLOCK_D, TILES)
            _store_partials(stats_ptr, acc_ptr, pid, split, r_a, row_ok_a, d, d_ok, m_a, l_a, acc_a, num_rows,
                            stride_sp, stride_ss, stride_ap, stride_as, stride_ar)
            if TILES == 2:
                _store_partials(stats_ptr, acc_ptr, pid, split, r_b, row_ok_b, d, d_ok, m_b, l_b, acc_b, num_rows,
                                stride_sp, stride_ss, stride_ap, stride_as, stride_ar)

    @triton.jit(do_not_specialize=["num_rows", "num_tokens", "num_splits", "stride_sp", "stride_ss"])
    def _combine_splits_kernel(
        prefix_ptr,  # [B]
        stats_ptr,  # [B * nkv, num_splits, 2, T * GROUP] fp32 (m, l)
        acc_ptr,  # [B * nkv, num_splits, T * GROUP, hd] fp32
        out_ptr,  # [B, T, nh * hd]
        num_rows,
        num_tokens,
        num_splits,
        stride_sp, stride_ss,
        stride_ap, stride_as, stride_ar,
        stride_ob, stride_ot,
        NUM_KV_HEADS: tl.constexpr,
        GROUP: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        BLOCK_D: tl.constexpr,
        BLOCK_M: tl.constexpr,
        SPLIT: tl.constexpr,
    ):
        pid = tl.program_id(0)
        b = pid // NUM_KV_HEADS
        kv_head = pid % NUM_KV_HEADS
        r = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        tok = r // GROUP
        head = kv_head * GROUP + r % GROUP
        row_ok = r < num_rows
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        span = tl.load(prefix_ptr + b).to(tl.int32) + num_tokens
        # The lanes the split kernel wrote: those whose first segment starts inside the span.
        num_live = tl.minimum(tl.cdiv(span, SPLIT), num_splits)
        stats = stats_ptr + pid.to(tl.int64) * stride_sp + r
        accs = acc_ptr + pid.to(tl.int64) * stride_ap + r[:, None] * stride_ar + d[None, :]

        # Lanes in the fixed order 0, 1, ...: the global max first, then the rescaled sums. A lane a
        # row cannot see (m = -inf, l = 0, acc = 0) adds exact zeros.
        m_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for split in range(0, num_live):
            m_max = tl.maximum(m_max, tl.load(stats + split * stride_ss, mask=row_ok, other=float("-inf")))
        m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for split in range(0, num_live):
            m_s = tl.load(stats + split * stride_ss, mask=row_ok, other=float("-inf"))
            l_s = tl.load(stats + split * stride_ss + num_rows, mask=row_ok, other=0.0)
            acc_s = tl.load(accs + split * stride_as, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
            w = tl.exp2(m_s - m_safe)
            l_sum += w * l_s
            acc += w[:, None] * acc_s

        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(out_ptr + b * stride_ob + tok[:, None] * stride_ot + head[:, None] * HEAD_DIM + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
