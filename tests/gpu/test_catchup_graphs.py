"""CUDA graphs for the EAGLE head's catch-up on the GPU (run with `python -m pytest -m gpu
tests/gpu/test_catchup_graphs.py`):

- the graphed catch-up equals the same padded catch-up run eagerly (CatchUpGraphs(graph=False))
  bit for bit: the same kernels at the same shapes; and the unpadded eager catch-up to a few ulps
  (fp32), over a prefill (graphed in a prefill's pair bucket, or eager past them) and rounds of
  1..5 new pairs, with equal next drafts;
- end to end in fp32 with cuda_graphs and triton_attention: greedy EAGLE-3 chain and tree
  speculation equal plain decoding with the same flags on 8 prompts, with catch-ups replayed
  (the chain's inside its draft graphs, the prompt's in the first)."""

from __future__ import annotations

import pytest
import torch

from drafter.catchup_graphs import CatchUpGraphs
from drafter.loader import load_head
from drafter.proposers import DraftRequest, EagleProposer
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.modeling.llama import load_llama
from spectandem.modeling.ops import FUSED_OPS
from tests.e2e.conftest import PROMPT_TEXTS

pytestmark = pytest.mark.gpu

MAX_LEN = 512
# Unpadded eager vs padded graph, fp32: reductions in another order (other matmul shapes, a wider span).
ULPS = dict(atol=1e-4, rtol=1e-5)


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


def _committed(p: EagleProposer, reqs) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V of every request's committed entries, [sum of cache_len, nkv, hd] each."""
    rows = torch.cat([p.cache.rows(torch.tensor([p.slots.of[r.request_id]], device="cuda"),
                                   torch.arange(p.cache_len[r.request_id], device="cuda")[None])[0] for r in reqs])
    return p.cache.k[0][rows], p.cache.v[0][rows]


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("b", [1, 3, 20])
def test_graphed_catch_up_equals_eager(kind, b):
    target = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    # The fused head for every proposer: the graphed one takes it (cuda_graphs), and each
    # comparison is of the same kernels.
    head = load_head(demo_paths(kind)[1], target, kind=kind, dtype=torch.float32, device="cuda").with_ops(FUSED_OPS)
    cfg = SpecConfig(method=kind, num_steps=4, topk=1, num_draft_tokens=5)
    eager = EagleProposer(head, cfg, max_slots=32, max_len=MAX_LEN)
    static = EagleProposer(head, cfg, max_slots=32, max_len=MAX_LEN)
    static.catch_up_graphs = CatchUpGraphs(head, static.cache, graph=False)
    graphed = EagleProposer(head, cfg, max_slots=32, max_len=MAX_LEN, cuda_graphs=True)
    proposers = (eager, static, graphed)
    g = torch.Generator().manual_seed(b)
    reqs = [DraftRequest(f"r{i}", torch.randint(1, 4096, (4 + 13 * i,), generator=g).tolist(), SamplingParams(), 0,
                         False) for i in range(b)]
    # Prefills: b = 1: 3 pairs, b = 3: up to 29 (a prefill's pair bucket): graphed; b = 20: up to
    # 250 pairs at 32 rows, past PREFILL_PAIR_ROWS: eager.
    new = [r.committed_len - 1 for r in reqs]
    for k in range(4):
        feats = [torch.randn(n, head.spec.feature_size, generator=g).cuda() for n in new]
        for p in proposers:
            p.catch_up(reqs, new, feats)
        for r in reqs:
            rid = r.request_id
            assert torch.equal(graphed.last_hidden[rid], static.last_hidden[rid])
            assert torch.equal(graphed.last_logits[rid], static.last_logits[rid])
            torch.testing.assert_close(graphed.last_hidden[rid], eager.last_hidden[rid], **ULPS)
            torch.testing.assert_close(graphed.last_logits[rid], eager.last_logits[rid], **ULPS)
        (ke, ve), (ks, vs), (kg, vg) = [_committed(p, reqs) for p in proposers]
        assert torch.equal(kg, ks) and torch.equal(vg, vs), "graph replay differs from the same catch-up run eagerly"
        torch.testing.assert_close(kg, ke, **ULPS)
        torch.testing.assert_close(vg, ve, **ULPS)
        a, s, gr = [p.propose(reqs) for p in proposers]
        assert torch.equal(gr.token_ids, a.token_ids) and torch.equal(s.token_ids, a.token_ids)
        new = [1 + (i + k) % 5 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
    assert graphed.catch_up_graphs._captured, "nothing was captured"


def _speculator(method: str, **tree) -> LocalSpeculator:
    return LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=32, max_len=MAX_LEN,
                           device="cuda", cuda_graphs=True, triton_attention=True)


@pytest.fixture(scope="module")
def plain():
    spec = _speculator("none")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:8]]
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    return prompts, [o.token_ids for o in outs]


CONFIGS = [
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
]


@pytest.mark.parametrize("method,tree", CONFIGS, ids=["eagle3-chain", "eagle3-tree"])
def test_greedy_with_catch_up_graphs_equals_plain(plain, method, tree):
    prompts, expected = plain
    spec = _speculator(method, **tree)
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected)) if o.token_ids != e]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    proposer = spec.drafter.proposer
    if tree["topk"] == 1:   # every catch-up, the prompt's too, runs inside the next chain's graph
        assert any(key[3] > 0 for key in proposer.chain._captured), "no catch-up replayed inside a chain graph"
    else:
        assert proposer.catch_up_graphs._captured, "no catch-up replayed a graph"
    assert sum(o.stats.accepted_tokens for o in outs) > 0
