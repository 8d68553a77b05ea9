"""On the GPU: the fused round as one CUDA graph (verifier/fused.py FusedGraphStep) gives the
tokens of the same round run eagerly, and greedy fused speculation through LocalSpeculator with
graphs equals plain decoding with graphs on 24 prompts (fp32), EAGLE-3 and EAGLE-1."""

from __future__ import annotations

import pytest
import torch

from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from verifier.fused import FusedGraphStep
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS

pytestmark = pytest.mark.gpu
FUSED = dict(num_steps=1, topk=1, num_draft_tokens=2, fused=True)


def _spec(method, **kw):
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")
    t, d = demo_paths(method)
    return LocalSpeculator(t, d, SpecConfig(method=method, **kw), max_slots=32, max_len=512, device="cuda",
                           cuda_graphs=True)


@pytest.fixture(scope="module")
def plain():
    spec = _spec("none")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    return prompts, [c.token_ids for c in spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))]


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_fused_graph_equals_plain(plain, method):
    prompts, expected = plain
    spec = _spec(method, **FUSED)
    assert spec._fused_graph is not None
    got = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    bad = [i for i, (g, e) in enumerate(zip(got, expected)) if g.token_ids != e]
    assert not bad, f"prompts {bad} differ from plain decoding"
    assert spec._fused_graph._captured, "no graph was captured"
    assert sum(c.stats.accepted_tokens for c in got) > 0


def test_graph_replay_equals_the_eager_static_round():
    spec = _spec("eagle3", **FUSED)
    other = _spec("eagle3", **FUSED)
    eager = FusedGraphStep(other.verifier, other.drafter, graph=False)
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:5]]
    sp = SamplingParams(max_tokens=64)
    trees = []
    for s in (spec, other):
        ids = [f"r{i}" for i in range(5)]
        for out, p in zip(s.verifier.prefill(ids, prompts, [sp] * 5, list(range(5))), prompts):
            s.drafter.add(out.request_id, p, out.first_token_id, sp, 1, out.features)
        trees.append(s.drafter.draft(ids))
    ta, tb = trees
    for _ in range(10):
        outs_a, ta = spec._fused_graph(ta)
        outs_b, tb = eager(tb)
        assert [o.token_ids for o in outs_a] == [o.token_ids for o in outs_b]
        assert torch.equal(ta.token_ids, tb.token_ids)
