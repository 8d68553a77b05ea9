"""The draft head's attention over rows of the paged pool (spectandem/kernels/rows_attention.py)
on the GPU, against its torch reference (the gather and masked_attention, the head's path off the
fast path): fp32 and bf16, grouped-query heads, one to several query rows, spans of one to many segments,
rows that see nothing (zeros), a row's result independent of the other rows (bit for bit), bad
inputs refused. The checks take a device, so tests/spectandem/test_rows_attention_cpu.py runs them
through Triton's interpreter too."""

from __future__ import annotations

import pytest
import torch

from spectandem.kernels.rows_attention import rows_attention, rows_attention_ref, rows_attention_triton

pytestmark = pytest.mark.gpu

TOLERANCE = {torch.float32: dict(atol=2e-5, rtol=1e-5), torch.float16: dict(atol=2e-3, rtol=2e-3),
             torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


def make_inputs(device, dtype, b, nh, nkv, hd, tq, span, seed):
    """Random q, pools of 2 * span + 7 rows, read_rows a random injection per request, and a mask
    where query row 0 of request 0 sees nothing (padding) and every other row sees a random half
    of the entries plus the last."""
    g = torch.Generator().manual_seed(seed)
    num_rows = 2 * span + 7
    q = torch.randn(b, nh, tq, hd, generator=g)
    k = torch.randn(num_rows, nkv, hd, generator=g)
    v = torch.randn(num_rows, nkv, hd, generator=g)
    read_rows = torch.stack([torch.randperm(num_rows, generator=g)[:span] for _ in range(b)])
    mask = torch.rand(b, tq, span, generator=g) < 0.5
    mask[..., -1] = True
    mask[0, 0] = False
    to = lambda x: x.to(device=device, dtype=dtype)
    return to(q), to(k), to(v), read_rows.to(device), mask.to(device)


def check_matches_reference(device, dtype, b, nh, nkv, hd, tq, span, seed=0):
    q, k, v, read_rows, mask = make_inputs(device, dtype, b, nh, nkv, hd, tq, span, seed)
    scale = hd ** -0.5
    got = rows_attention_triton(q, k, v, read_rows, mask, scale)
    ref = rows_attention_ref(q.float(), k.float(), v.float(), read_rows, mask, scale)   # fp32 truth
    assert got.shape == (b, tq, nh * hd) and got.dtype == dtype
    seen = mask.any(-1)                                                                   # [B, Tq]
    torch.testing.assert_close(got.float()[seen], ref[seen], **TOLERANCE[dtype])
    assert torch.equal(got[0, 0], torch.zeros_like(got[0, 0])), "a row that sees nothing gets zeros"
    # A row's result does not depend on the others: the last query row alone, bit for bit (under
    # Triton's interpreter with its tl.dot a row at a time, tests/conftest.py).
    alone = rows_attention_triton(q[:, :, -1:].contiguous(), k, v, read_rows, mask[:, -1:].contiguous(), scale)
    assert torch.equal(alone[:, 0], got[:, -1])


def check_dispatch_and_errors(device):
    q, k, v, read_rows, mask = make_inputs(device, torch.float32, 1, 4, 2, 16, 2, 20, 1)
    seen = mask.any(-1)   # row 0 sees nothing: zeros from the kernel, the reference's finite garbage
    torch.testing.assert_close(rows_attention(q, k, v, read_rows, mask, 0.25)[seen],
                               rows_attention_ref(q, k, v, read_rows, mask, 0.25)[seen], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="mask must be a bool tensor \\[1, 2, 20\\]"):
        rows_attention_triton(q, k, v, read_rows, mask[:, :1], 0.25)
    with pytest.raises(ValueError, match="read_rows must be an integer tensor \\[B, span\\] with B = 1"):
        rows_attention_triton(q, k, v, read_rows.float(), mask, 0.25)
    with pytest.raises(ValueError, match="k_pool must be a tensor \\[rows, nkv, 16\\]"):
        rows_attention_triton(q, k[..., :8], v, read_rows, mask, 0.25)
    with pytest.raises(ValueError, match="must agree, with q's 4 heads a multiple of their kv heads"):
        rows_attention_triton(q, k[:, :1].expand(-1, 3, -1), v[:, :1].expand(-1, 3, -1), read_rows, mask, 0.25)


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,nh,nkv,hd,tq,span", [
    (1, 32, 8, 128, 1, 1),       # the 8B head: one entry
    (1, 32, 8, 128, 1, 333),     # a chain step at context 333 (6 segments)
    (1, 32, 8, 128, 5, 3000),    # five fork rows at context 3000 (24 segments)
    (3, 4, 2, 64, 7, 150),       # a batch of three, seven query rows
], ids=["one-entry", "chain-step", "forks-long", "batch"])
def test_matches_reference(dtype, b, nh, nkv, hd, tq, span):
    check_matches_reference("cuda", dtype, b, nh, nkv, hd, tq, span)


def test_dispatch_and_errors():
    check_dispatch_and_errors("cuda")
