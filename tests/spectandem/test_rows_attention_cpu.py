"""The draft head's rows attention on the CPU. Always: the reference is the gather and
masked_attention (the head's CPU path), and the wrapper
sends CPU tensors there. Under Triton's interpreter (tests/interpreter.py) also the kernel's
checks of tests/gpu/test_rows_attention.py, in fp32, fp16 and bf16 (bf16 `tl.dot` through
tests/conftest.py's mend of the interpreter)."""

from __future__ import annotations

import pytest
import torch

from spectandem.kernels.rows_attention import rows_attention, rows_attention_ref
from spectandem.modeling.layers import masked_attention
from tests.gpu.test_rows_attention import check_dispatch_and_errors, check_matches_reference, make_inputs
from tests.interpreter import interpreter


def test_reference_is_the_gather_and_masked_attention():
    q, k, v, read_rows, mask = make_inputs("cpu", torch.float32, 2, 4, 2, 16, 3, 40, 0)
    k_all, v_all = k[read_rows].transpose(1, 2), v[read_rows].transpose(1, 2)
    expected = masked_attention(q, k_all, v_all, mask, 0.25)
    assert torch.equal(rows_attention_ref(q, k, v, read_rows, mask, 0.25), expected)
    assert torch.equal(rows_attention(q, k, v, read_rows, mask, 0.25), expected)
    # The control: another read order is another result.
    assert not torch.equal(rows_attention_ref(q, k, v, read_rows.flip(1), mask, 0.25), expected)


def test_reference_refuses_bad_inputs():
    q, k, v, read_rows, mask = make_inputs("cpu", torch.float32, 1, 4, 2, 16, 2, 20, 1)
    with pytest.raises(ValueError, match="mask must be a bool tensor \\[1, 2, 20\\]"):
        rows_attention_ref(q, k, v, read_rows, mask.int(), 0.25)
    with pytest.raises(ValueError, match="q must be a float16/bfloat16/float32 tensor"):
        rows_attention_ref(q[0], k, v, read_rows, mask, 0.25)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("b,nh,nkv,hd,tq,span", [(1, 4, 2, 32, 1, 1), (1, 4, 2, 32, 5, 150), (2, 2, 2, 16, 3, 70)])
def test_interpreted_matches_reference(dtype, b, nh, nkv, hd, tq, span):
    check_matches_reference("cpu", dtype, b, nh, nkv, hd, tq, span)


@interpreter
def test_interpreted_dispatch_and_errors():
    check_dispatch_and_errors("cpu")


@interpreter
def test_spans_past_the_lanes_wrap(monkeypatch):
    """Every span shares one compiled kernel (its segment is BLOCK_N, whatever the span), and a
    span of more chunks than lanes deals them round the 32 lanes: 2,100 entries are 33 chunks,
    lane 0 takes two. Against the reference either way."""
    import spectandem.kernels.rows_attention as ra

    lanes = []
    real = ra.split_lanes
    monkeypatch.setattr(ra, "split_lanes", lambda entries, split_len: lanes.append((real(entries, split_len),
                                                                                    split_len)) or lanes[-1][0])
    for span in (1, 70, 2100):
        q, k, v, read_rows, mask = make_inputs("cpu", torch.float32, 1, 4, 2, 16, 2, span, 0)
        got = ra.rows_attention_triton(q, k, v, read_rows, mask, 0.25)
        ref = rows_attention_ref(q, k, v, read_rows, mask, 0.25)
        rows = mask.any(-1)
        torch.testing.assert_close(got[rows], ref[rows], atol=2e-5, rtol=1e-5)
    assert lanes == [(1, 64), (2, 64), (32, 64)], lanes
