"""The fused rotary + paged K/V write (spectandem/kernels/rotary.py) on the CPU.

Always run: off CUDA `rotary_write` is the torch code, and the demo target with its fused kernels
on verifies through the paged-tree path (PagedTreeBatch.attend_rotary) bit for bit as the model
without them (rotary, then the index_puts), logits, features and every pool.

Through Triton's interpreter (tests/interpreter.py; skipped where triton is missing): the GPU
test's kernel check at small sizes, fp32 bit for bit, bf16 within the interpreter's truncating casts.
"""

from __future__ import annotations


import pytest
import torch

from spectandem.demo import demo_paths
from spectandem.modeling.llama import load_llama
from spectandem.modeling.ops import FUSED_OPS
from tests.gpu.test_rotary_write import check_rotary_write
from tests.interpreter import interpreter
from verifier.runner import NativeRunner


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,t,trash", [(1, 1, 0), (2, 5, 0), (3, 4, 2)])
def test_interpreted_rotary_write(dtype, b, t, trash):
    check_rotary_write("cpu", dtype, b, t, 4, 2, 16, seed=b + t, exact=dtype == torch.float32, trash_tokens=trash)


@torch.no_grad()
def test_fused_tree_path_on_cpu_writes_what_the_unfused_path_writes():
    models = [load_llama(demo_paths("none")[0], torch.float32, "cpu") for _ in range(2)]
    models[0] = models[0].with_ops(FUSED_OPS)
    runners = []
    for m in models:
        r = NativeRunner(m, (2, 4, 5), max_slots=4, max_len=128)
        r.triton_attention = True   # the paged-tree path, on its torch reference here
        r.prefill([1, 0], [[5, 9, 200, 31, 7], [11, 3]])
        runners.append(r)
    tokens = torch.tensor([[4, 8, 15, 16], [23, 42, 7, -1]])
    parents = torch.tensor([[-1, 0, 0, 1], [-1, 0, 1, -1]])
    (lf, ff), (lp, fp) = (r.verify([1, 0], [5, 2], tokens, parents, tokens >= 0) for r in runners)
    assert torch.equal(lf, lp) and torch.equal(ff, fp)
    fused, plain = runners
    for layer in range(len(plain.cache.k)):
        assert torch.equal(fused.cache.k[layer], plain.cache.k[layer]), f"layer {layer}: K pool differs"
        assert torch.equal(fused.cache.v[layer], plain.cache.v[layer]), f"layer {layer}: V pool differs"


def test_the_fused_path_goes_through_attend_rotary(monkeypatch):
    """The wiring: with fused kernels on, the tree path's attention calls attend_rotary once a layer."""
    from spectandem.kv_cache import PagedTreeBatch

    calls = []
    real = PagedTreeBatch.attend_rotary

    def counting(self, layer, *args):
        calls.append(layer)
        return real(self, layer, *args)
    monkeypatch.setattr(PagedTreeBatch, "attend_rotary", counting)
    model = load_llama(demo_paths("none")[0], torch.float32, "cpu").with_ops(FUSED_OPS)
    runner = NativeRunner(model, None, max_slots=1, max_len=64)
    runner.triton_attention = True
    runner.prefill([0], [[5, 9, 200]])
    runner.verify([0], [3], torch.tensor([[4, 8]]), torch.tensor([[-1, 0]]), torch.ones(1, 2, dtype=torch.bool))
    assert calls == list(range(model.spec.num_layers))
