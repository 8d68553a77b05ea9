"""The skinny GEMM (spectandem/kernels/skinny.py) on the GPU: within what cuBLAS's own bf16 result
is of an fp32 reference, on every 8B shape it serves (the target's and its EAGLE-3 head's) and
every row count 1..16; a row's result
does not depend on the other rows (bit for bit); the bias; the fallback to F.linear (exactly) for
shapes, dtypes and row counts it does not serve; bad inputs refused; the 8B-shaped head's fast path
runs every projection through it, close to the torch code."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectandem.kernels.skinny import MAX_ROWS, SKINNY_SHAPES, skinny_linear, skinny_linear_triton

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


@pytest.mark.parametrize("shape", list(SKINNY_SHAPES))
def test_close_to_fp32_as_cublas_is(shape):
    n, k = shape
    g = torch.Generator(device="cuda").manual_seed(n + k)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(MAX_ROWS, k, device="cuda", generator=g).to(torch.bfloat16)
    ref = x.float() @ w.float().t()
    full = skinny_linear(x, w, None)
    for m in (1, 2, 5, 16):
        got = skinny_linear(x[:m], w, None)
        assert got.shape == (m, n) and got.dtype == torch.bfloat16
        err = (got.float() - ref[:m]).abs().max().item()
        err_cublas = (F.linear(x[:m], w).float() - ref[:m]).abs().max().item()
        assert err <= 1.5 * err_cublas + 1e-3, (m, err, err_cublas)
        assert torch.equal(got, full[:m])                     # rows do not interact
    for i in range(3):
        assert torch.equal(skinny_linear(x[i: i + 1], w, None), full[i: i + 1])


def test_bias_and_leading_dims():
    n, k = 4096, 4096
    g = torch.Generator(device="cuda").manual_seed(1)
    w = (torch.randn(n, k, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    b = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
    x = torch.randn(1, 3, k, device="cuda", generator=g).to(torch.bfloat16)
    got = skinny_linear(x, w, b)
    assert got.shape == (1, 3, n)
    ref = x.float() @ w.float().t() + b.float()
    assert (got.float() - ref).abs().max().item() <= 1.5 * (F.linear(x, w, b).float() - ref).abs().max().item() + 1e-2


def test_falls_back_to_cublas_exactly_where_it_does_not_serve():
    g = torch.Generator(device="cuda").manual_seed(2)
    w = (torch.randn(4096, 4096, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    other = (torch.randn(1000, 4096, device="cuda", generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(MAX_ROWS + 1, 4096, device="cuda", generator=g).to(torch.bfloat16)
    assert torch.equal(skinny_linear(x, w, None), F.linear(x, w))                  # 17 rows
    assert torch.equal(skinny_linear(x[:1], other, None), F.linear(x[:1], other))  # a shape not measured
    assert torch.equal(skinny_linear(x[:1].float(), w.float(), None), F.linear(x[:1].float(), w.float()))  # fp32


def test_bad_inputs_are_refused():
    w = torch.zeros(4096, 4096, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="1 to 16 rows, got \\(17, 4096\\)"):
        skinny_linear_triton(torch.zeros(17, 4096, device="cuda", dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="CUDA bf16 or fp16 of one dtype"):
        skinny_linear_triton(torch.zeros(1, 4096, device="cuda"), w)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        skinny_linear_triton(torch.zeros(1, 4096, device="cuda", dtype=torch.bfloat16), w.t())



@torch.no_grad()
@pytest.mark.parametrize("query_rows", [False, True], ids=["every-row", "query-rows"])
def test_eagle3_head_fast_path_at_the_8b_shape(monkeypatch, query_rows):
    """The 8B-shaped EAGLE-3 head (bf16, random weights) on its fast path (FUSED_OPS) over
    the paged cache: every projection goes through the kernel (q/k/v packed, fc, o, gate/up, down,
    the draft LM head), the attention through rows_attention, and the output and the K written are
    within what bf16 GEMMs of another order give of the torch code's."""
    from types import SimpleNamespace

    from spectandem import kernels
    from benchmarks.bench.llama8b import SHAPES, llama8b_spec, random_eagle3_head
    from spectandem.kernels import skinny
    from spectandem.kernels import rows_attention
    from spectandem.kv_cache import PagedKVCache

    spec = llama8b_spec("full")
    g = torch.Generator(device="cuda").manual_seed(3)
    embed = torch.randn(spec.vocab_size, spec.hidden_size, device="cuda", generator=g).to(torch.bfloat16)
    target = SimpleNamespace(spec=spec, model=SimpleNamespace(embed_tokens=SimpleNamespace(weight=embed)))
    head = random_eagle3_head(target, SHAPES["full"]["draft_vocab_size"], "cuda", torch.bfloat16, 0)
    s = head.spec
    b, t = 1, 5
    toks = torch.randint(0, s.vocab_size, (b, t), device="cuda", generator=g)
    feats = torch.randn(b, t, s.feature_size, device="cuda", generator=g).to(torch.bfloat16)
    positions = 40 + torch.arange(t, device="cuda")[None]
    rows = torch.tensor([[1, t - 1]], device="cuda") if query_rows else torch.arange(t, device="cuda")[None]
    mask = torch.arange(45, device="cuda")[None, None] <= positions.gather(1, rows)[..., None]

    def run():   # the proposer's paged cache: the fast path writes and attends in place
        cache = PagedKVCache(1, 1, s.num_kv_heads, 64, s.head_dim, torch.bfloat16, "cuda", num_blocks=4, block_size=16)
        cache.reserve(0, 64)
        out = head.run(toks, head.project(feats), positions, cache.batch(torch.tensor([0], device="cuda"), positions, 45),
                       mask, rows)
        return head.logits(out), cache.k[0].clone()

    ref_logits, ref_k = run()
    shapes = []
    kernel = skinny.skinny_linear_triton
    monkeypatch.setattr(skinny, "skinny_linear_triton",
                        lambda x, w, b=None, config=None: shapes.append(tuple(w.shape)) or kernel(x, w, b, config))
    attended = []
    attend = rows_attention.rows_attention_triton
    monkeypatch.setattr(rows_attention, "rows_attention_triton", lambda *a: attended.append(1) or attend(*a))
    from spectandem.modeling.ops import FUSED_OPS

    head = head.with_ops(FUSED_OPS)
    logits, k = run()
    assert kernels.HAVE_TRITON and attended == [1]
    assert set(shapes) == {(6144, 8192), (4096, 12288), (32000, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    torch.testing.assert_close(k, ref_k, atol=0.05, rtol=0.02)
    torch.testing.assert_close(logits, ref_logits, atol=0.25, rtol=0.05)
