"""Mixed prefill through CUDA graphs (run with `python -m pytest -m gpu tests/gpu`): a verify or
plain decode step that carries new prompts (NativeRunner.verify_and_prefill, decode_greedy's
prompts), replayed from the graphs warm-up captured (MIXED_ROW_BUCKETS past the batch buckets),
against a prefill of their own then the step, fp32 and the Triton tree attention; no graph is
captured while serving."""

from __future__ import annotations

import logging

import pytest
import torch

from spectandem.demo import demo_paths
from spectandem.modeling.llama import load_llama
from tests.verifier.random_trees import random_trees
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

AUX = (2, 4, 5)
MAX_LEN = 512
TOL = dict(atol=2e-4, rtol=1e-4)


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


def _runners(max_slots: int, widths: list[int]):
    model = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    mixed = NativeRunner(model, AUX, max_slots=max_slots, max_len=MAX_LEN, cuda_graphs=True, triton_attention=True)
    mixed.warm_up(widths)
    apart = NativeRunner(model, AUX, max_slots=max_slots, max_len=MAX_LEN, cuda_graphs=True, triton_attention=True)
    return mixed, apart


@pytest.mark.parametrize("b,n,plens", [(3, 5, (133,)), (8, 5, (40, 90, 61)), (16, 1, (133, 20)), (2, 1, (250,))])
def test_graphed_mixed_verify_equals_prefill_then_verify(b, n, plens, caplog):
    mixed, apart = _runners(24, list(range(1, 6)))
    g = torch.Generator().manual_seed(b * 100 + n)
    slots = list(range(b))
    running = [torch.randint(1, 4096, (7 + 5 * i,), generator=g).tolist() for i in range(b)]
    for r in (mixed, apart):
        r.prefill(slots, running)
    lens = [len(p) for p in running]
    new = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in plens]
    new_slots = list(range(b, b + len(new)))
    tokens, parents, valid = random_trees(g, b, n)
    captured = len(mixed.graphs._captured)
    caplog.set_level(logging.WARNING, logger="spectandem.graphs")
    logits, feats, k, first, per = mixed.verify_and_prefill(slots, lens, tokens, parents, valid, new_slots, new)
    assert k == len(new)
    assert len(mixed.graphs._captured) == captured and not caplog.records, "a mixed step was not warmed up"
    ref_first, ref_per = apart.prefill(new_slots, new)
    ref_logits, ref_feats = apart.verify(slots, lens, tokens, parents, valid)
    torch.testing.assert_close(logits[valid], ref_logits[valid], **TOL)
    torch.testing.assert_close(first, ref_first, **TOL)
    assert torch.equal(first.argmax(-1), ref_first.argmax(-1))
    for got, want in zip(per, ref_per):
        torch.testing.assert_close(got, want, **TOL)
    step = random_trees(g, len(new), 3)
    nxt = [r.verify(new_slots, list(plens), *step)[0] for r in (mixed, apart)]
    torch.testing.assert_close(nxt[0][step[2]], nxt[1][step[2]], **TOL)


def test_graphed_mixed_decode_equals_prefill_then_decode():
    mixed, apart = _runners(64, [1, 5])
    g = torch.Generator().manual_seed(3)
    b = 40
    running = [torch.randint(1, 4096, (9 + i,), generator=g).tolist() for i in range(b)]
    for r in (mixed, apart):
        r.prefill(list(range(b)), running)
    lens, last = [len(p) for p in running], [p[-1] for p in running]
    new = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in (133, 60)]
    tokens, feats, k, first, per = mixed.decode_greedy(list(range(b)), lens, last, 4, True, [b, b + 1], new)
    ref_first, ref_per = apart.prefill([b, b + 1], new)
    ref_tokens, ref_feats = apart.decode_greedy(list(range(b)), lens, last, 4, True)
    assert k == 2 and torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(feats, ref_feats, **TOL)
    assert torch.equal(first.argmax(-1), ref_first.argmax(-1))
    for got, want in zip(per, ref_per):
        torch.testing.assert_close(got, want, **TOL)
