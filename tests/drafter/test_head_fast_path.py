"""The draft heads' fast path (DraftHead.with_ops(FUSED_OPS)) on the real demo heads, fp32 on the
CPU: q/k/v as one packed GEMM, fc, o and the LM head through fast_linear (F.linear off CUDA),
the rotary embedding over every row before the query rows are picked. Held to the torch code it
replaces: within fp32 ulps (the packed GEMM may sum in another order) with the same argmaxes,
for every row a query row (draft steps) and for a subset of query rows (catch-up); K/V written
alike; the checkpoint's names, shapes and values kept; switched off, the torch code bit for bit.
The GPU side (the skinny kernel at the head's shapes) is tests/gpu/test_skinny.py."""

import copy

import pytest
import torch

from spectandem.kv_cache import KVCache, PagedKVCache
from spectandem.modeling.ops import FUSED_OPS, HOST_OPS, TORCH_OPS
from tests.drafter.proposer_helpers import _gen


def _inputs(head, b=2, t=5):
    s = head.spec
    toks = torch.randint(0, s.vocab_size, (b, t), generator=_gen(11))
    hidden = torch.randn(b, t, s.feature_size, generator=_gen(12))
    base = torch.tensor([3, 0])[:b]
    positions = base[:, None] + torch.arange(t)
    return toks, hidden, positions


def _run(head, rows_subset: bool, paged: bool = False):
    """One head layer over fresh pairs at positions base.. on a cache with earlier entries.
    -> (hidden out, logits, the cache's K and V). `paged`: the proposer's PagedKVCache (whose
    batch has the fast path's write_rotary and attend_rows), else the contiguous KVCache."""
    s = head.spec
    toks, feats, positions = _inputs(head)
    b, t = toks.shape
    if paged:
        cache = PagedKVCache(1, 3, s.num_kv_heads, 16, s.head_dim, torch.float32, "cpu", num_blocks=8, block_size=4)
        for slot in (2, 0):
            cache.reserve(slot, 16)
    else:
        cache = KVCache(1, 3, s.num_kv_heads, 16, s.head_dim, torch.float32)
    prefix = torch.randn(cache.k[0].shape, generator=_gen(13))
    cache.k[0].copy_(prefix)
    cache.v[0].copy_(-prefix)
    span = int(positions.max()) + 1
    cols = torch.arange(span)
    if rows_subset:   # catch-up: only each request's last row (and one middle row) is a query row
        rows = torch.tensor([[1, t - 1]] * b)
    else:             # draft step: every row, in order
        rows = torch.arange(t).expand(b, t)
    qpos = positions.gather(1, rows)
    mask = cols[None, None] <= qpos[..., None]
    out = head.run(toks, head.project(feats), positions, cache.batch(torch.tensor([2, 0]), positions, span), mask,
                   rows)
    return out, head.logits(out), cache.k[0].clone(), cache.v[0].clone()


@torch.no_grad()
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("rows_subset", [False, True], ids=["every-row", "query-rows"])
def test_fast_path_matches_the_torch_code(head, rows_subset, paged, monkeypatch):
    fast = copy.deepcopy(head).with_ops(FUSED_OPS)
    attn = fast.layer.self_attn
    assert fast.ops is FUSED_OPS and attn.packed_weight is not None
    from spectandem.kernels import rows_attention
    calls = []
    monkeypatch.setattr(rows_attention, "rows_attention_ref",
                        lambda *a, ref=rows_attention.rows_attention_ref: calls.append(1) or ref(*a))
    ref, got = _run(head, rows_subset, paged), _run(fast, rows_subset, paged)
    assert len(calls) == paged, "the paged cache attends through rows_attention, in place"
    for name, r, g in zip(("hidden", "logits", "k", "v"), ref, got):
        assert r.shape == g.shape, name
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.equal(got[1].argmax(-1), ref[1].argmax(-1))


@torch.no_grad()
@pytest.mark.parametrize("paged", [False, True], ids=["contiguous", "paged"])
@pytest.mark.parametrize("rows_subset", [False, True], ids=["every-row", "query-rows"])
def test_the_cpu_path_matches_the_torch_code(head, rows_subset, paged):
    """HOST_OPS (EagleProposer's choice on the CPU): packed q/k/v and gate/up GEMMs, F.rms_norm,
    one scaled_dot_product_attention; held to the torch code within fp32 ulps, same argmaxes."""
    host = copy.deepcopy(head).with_ops(HOST_OPS)
    assert host.ops is HOST_OPS and host.layer.self_attn.packed_weight is not None
    assert host.layer.mlp.packed_weight is not None
    ref, got = _run(head, rows_subset, paged), _run(host, rows_subset, paged)
    for name, r, g in zip(("hidden", "logits", "k", "v"), ref, got):
        assert r.shape == g.shape, name
        torch.testing.assert_close(g, r, atol=1e-5, rtol=1e-5, msg=name)
    assert torch.equal(got[1].argmax(-1), ref[1].argmax(-1))


@torch.no_grad()
def test_the_proposer_drafts_with_the_cpu_path_on_the_cpu(head):
    from drafter.proposers import EagleProposer
    from spectandem.config import SpecConfig

    proposer = EagleProposer(head, SpecConfig(method="eagle3"), max_slots=2, max_len=64)
    assert proposer.head.ops is HOST_OPS and head.ops is TORCH_OPS, "a twin: the head given is unchanged"
    assert all(a is b for a, b in zip(proposer.head.parameters(), head.parameters())), "the same weights"


@torch.no_grad()
def test_packing_keeps_the_checkpoint_and_switching_off_is_the_torch_code(head):
    fast = copy.deepcopy(head)
    before = {k: v.clone() for k, v in fast.state_dict().items()}
    fast = fast.with_ops(FUSED_OPS)
    attn = fast.layer.self_attn
    after = fast.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[k], before[k]) for k in before)
    hd, nh, nkv = attn.head_dim, attn.num_heads, attn.num_kv_heads
    assert attn.packed_weight.shape == ((nh + 2 * nkv) * hd, attn.q_proj.in_features)
    assert attn.k_proj.weight.data_ptr() == attn.packed_weight[nh * hd:].data_ptr(), "children are views"
    fast = fast.with_ops(TORCH_OPS)
    assert fast.ops is TORCH_OPS and fast.layer.self_attn.packed_weight is not None, "still packed"
    for rows_subset in (False, True):
        ref, got = _run(head, rows_subset), _run(fast, rows_subset)
        assert all(torch.equal(r, g) for r, g in zip(ref, got))

