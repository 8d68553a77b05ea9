"""`python -m pytest -m gpu tests/gpu/test_rotary_write.py`: rotary_write_triton (the rotary
embedding and the paged K/V write in one launch, spectandem/kernels/rotary.py) against the
unfused code (rotary, then two index_puts), bit for bit: q's output and both whole pools, at the
8B shapes (32 q heads, 8 KV heads, head_dim 128) and the demo's, q/k/v as Attention makes them
(columns of one packed projection, transposed), with padding tokens of a graph bucket that all
write the one trash row. Then the whole fast-path forward: the 8B-shaped target's verify logits
and pools equal with the fused write and without."""

from __future__ import annotations

import pytest
import torch

from spectandem.kernels.rotary import rotary_write, rotary_write_ref, rotary_write_triton
from spectandem.modeling.layers import RopeSpec, Rotary
from tests.gpu.test_fused_kernels import (  # noqa: F401  (_cuda_and_triton: an autouse fixture, here too)
    DTYPE_IDS, DTYPES, _cuda_and_triton, _randn, assert_same)

pytestmark = pytest.mark.gpu


@torch.no_grad()
def check_rotary_write(device, dtype, b: int, t: int, heads: int, kv_heads: int, head_dim: int, seed: int,
                       exact: bool = True, trash_tokens: int = 0) -> None:
    """rotary_write_triton against rotary_write_ref on fresh pools of random contents; the last
    `trash_tokens` tokens of the last request all write the pools' row 0 (a padding bucket's
    trash row, whose contents nobody reads: compared everywhere else)."""
    gen = torch.Generator().manual_seed(seed)
    width = (heads + 2 * kv_heads) * head_dim
    packed = _randn(gen, b, t, width, dtype=dtype, device=device)
    q, k, v = packed.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(b, t, heads, head_dim).transpose(1, 2)
    k = k.view(b, t, kv_heads, head_dim).transpose(1, 2)
    v = v.view(b, t, kv_heads, head_dim).transpose(1, 2)
    positions = torch.randint(0, 8192, (b, t), generator=gen).to(device)
    cos, sin = Rotary(RopeSpec(head_dim=head_dim, theta=500000.0)).to(device).cos_sin(positions, dtype)
    num_rows = 4 * b * t + 8
    rows = (torch.randperm(num_rows - 1, generator=gen)[: b * t] + 1).view(b, t)
    if trash_tokens:
        rows[-1, t - trash_tokens:] = 0
    rows = rows.to(device)
    pools = [_randn(gen, num_rows, kv_heads, head_dim, dtype=dtype, device=device) for _ in range(2)]
    want_pools = [p.clone() for p in pools]
    got_q = rotary_write_triton(q, k, v, cos, sin, pools[0], pools[1], rows)
    want_q = rotary_write_ref(q, k, v, cos, sin, want_pools[0], want_pools[1], rows)
    what = f"rotary_write B={b} T={t} heads={heads}/{kv_heads} hd={head_dim} {dtype}"
    assert_same(got_q, want_q, f"{what}: q", exact)
    assert _strides(got_q) == _strides(want_q), f"{what}: q strides {got_q.stride()}, torch's {want_q.stride()}"
    keep = slice(1, None) if trash_tokens else slice(None)
    for name, got, want in zip("kv", pools, want_pools):
        assert_same(got[keep], want[keep], f"{what}: {name} pool", exact if name == "k" else True)
    moved = torch.zeros(num_rows, dtype=torch.bool)
    moved[rows.flatten().cpu()] = True
    assert torch.equal(pools[0][~moved.to(device)], want_pools[0][~moved.to(device)]), f"{what}: rows not written changed"


def _strides(x: torch.Tensor) -> tuple:
    """Strides of the dimensions longer than 1 (a size-1 dimension's stride addresses nothing)."""
    return tuple(s for n, s in zip(x.shape, x.stride()) if n > 1)


SHAPES = [(1, 1), (1, 16), (4, 5), (64, 1), (3, 7)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("b,t", SHAPES, ids=lambda x: str(x))
def test_rotary_write_8b_shapes(dtype, b, t):
    check_rotary_write("cuda", dtype, b, t, 32, 8, 128, seed=b * 100 + t)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_rotary_write_demo_shape_with_trash_row(dtype):
    check_rotary_write("cuda", dtype, 3, 6, 4, 2, 64, seed=7, trash_tokens=3)


def test_rotary_write_falls_back_where_it_cannot_write_in_place():
    """A pool of another dtype than k: `rotary_write` runs the torch code (which casts), the
    Triton form refuses with the layouts it needs."""
    gen = torch.Generator().manual_seed(0)
    q = _randn(gen, 1, 4, 3, 64, dtype=torch.bfloat16, device="cuda")
    k = _randn(gen, 1, 2, 3, 64, dtype=torch.bfloat16, device="cuda")
    v = _randn(gen, 1, 2, 3, 64, dtype=torch.bfloat16, device="cuda")
    cos, sin = Rotary(RopeSpec(head_dim=64, theta=10000.0)).to("cuda").cos_sin(torch.arange(3, device="cuda")[None],
                                                                                torch.bfloat16)
    rows = torch.tensor([[2, 0, 5]], device="cuda")
    pools = [torch.zeros(8, 2, 64, dtype=torch.float32, device="cuda") for _ in range(2)]
    want = [p.clone() for p in pools]
    assert torch.equal(rotary_write(q, k, v, cos, sin, *pools, rows), rotary_write_ref(q, k, v, cos, sin, *want, rows))
    assert torch.equal(pools[0], want[0]) and torch.equal(pools[1], want[1])
    with pytest.raises(ValueError, match="contiguous pools"):
        rotary_write_triton(q, k, v, cos, sin, *pools, rows)


@torch.no_grad()
def test_fast_path_verify_same_with_and_without_the_fused_write():
    """The fast-path runner (graphs off) on a tiny 8B-shaped bf16 target, a 16-node tree after a
    40-token prefix: logits and every layer's pools equal whether Attention takes
    PagedTreeBatch.attend_rotary (the fused write) or rotary then attend."""
    from benchmarks.bench.llama8b import TREE16_PARENTS, llama8b_spec, random_target
    from spectandem.kv_cache import PagedTreeBatch, _rotated_attend
    from verifier.runner import NativeRunner

    model = random_target(llama8b_spec("tiny"), "cuda", torch.bfloat16, 0)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.spec.vocab_size, (40,), generator=g).tolist()
    tokens = torch.randint(0, model.spec.vocab_size, (1, 16), generator=g)
    outs = []
    for fused_write in (True, False):
        saved = PagedTreeBatch.attend_rotary
        if not fused_write:   # the rotary kernel, then attend's own K/V write
            PagedTreeBatch.attend_rotary = _rotated_attend
        try:
            runner = NativeRunner(model, None, 1, 128, triton_attention=True)
            runner.prefill([0], [prompt])
            logits, _ = runner.verify([0], [40], tokens, torch.tensor([TREE16_PARENTS]), torch.ones(1, 16, dtype=torch.bool))
            outs.append((logits.clone(), [k.clone() for k in runner.cache.k], [v.clone() for v in runner.cache.v]))
        finally:
            if not fused_write:
                PagedTreeBatch.attend_rotary = saved
    assert torch.equal(outs[0][0], outs[1][0]), "verify logits differ with the fused K/V write"
    for layer, (a, b) in enumerate(zip(outs[0][1] + outs[0][2], outs[1][1] + outs[1][2])):
        assert torch.equal(a, b), f"pool {layer} differs with the fused K/V write"
