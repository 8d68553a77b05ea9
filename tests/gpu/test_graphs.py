"""CUDA graphs on the GPU (run with `python -m pytest -m gpu tests/gpu`): graphed verify steps and
draft chains against the same padded computation run eagerly (bit for bit: the same kernels at the
same shapes) and against the unpadded eager step (a few ulps in fp32, argmaxes equal), and greedy
speculative decoding with graphs on equals plain decoding on 24 prompts (fp32)."""

from __future__ import annotations

import logging

import pytest
import torch

from drafter.graphs import ChainGraphs
from drafter.loader import load_head
from drafter.proposers import DraftRequest, EagleProposer
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.modeling.llama import load_llama
from spectandem.modeling.ops import FUSED_OPS
from tests.e2e.conftest import PROMPT_TEXTS
from tests.verifier.random_trees import accepted_paths, random_trees
from verifier.graphs import VerifyGraphs
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

AUX = (2, 4, 5)
MAX_LEN = 512
# Unpadded eager vs padded graph, logits [B, N, V] float32: fp32 reductions in another order; bf16
# activations round at every layer, so a different summation order moves logits by bf16 ulps.
TOLERANCE = {torch.float32: dict(atol=1e-4, rtol=1e-5), torch.bfloat16: dict(atol=0.25, rtol=0.05)}


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5), (4, 16), (20, 5)])
def test_graphed_verify_equals_eager(dtype, b, n):
    model = load_llama(demo_paths("none")[0], dtype, "cuda")
    eager = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN)
    static = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN)
    static.graphs = VerifyGraphs(model, static.cache, graph=False)
    graphed = NativeRunner(model, AUX, max_slots=32, max_len=MAX_LEN, cuda_graphs=True)
    runners = (eager, static, graphed)
    g = torch.Generator().manual_seed(100 * b + n)
    slots = list(range(b))[::-1]
    prompts = [torch.randint(1, 4096, (5 + 7 * i,), generator=g).tolist() for i in range(b)]
    for r in runners:
        r.prefill(slots, prompts)
    cache_lens = [len(p) for p in prompts]
    for _ in range(3):  # later rounds replay graphs captured earlier, over the committed paths
        tokens, parents, valid = random_trees(g, b, n)
        (la, fa), (ls, fs), (lg, fg) = [r.verify(slots, cache_lens, tokens, parents, valid) for r in runners]
        assert torch.equal(lg, ls) and torch.equal(fg, fs), "graph replay differs from the same step run eagerly"
        torch.testing.assert_close(lg[valid], la[valid], **TOLERANCE[dtype])
        torch.testing.assert_close(fg[valid], fa[valid], **TOLERANCE[dtype])
        if dtype == torch.float32:
            assert torch.equal(lg[valid].argmax(-1), la[valid].argmax(-1))
        else:  # bf16 near-ties may flip; nearly all must agree
            assert (lg[valid].argmax(-1) == la[valid].argmax(-1)).float().mean() >= 0.9
        accepted = accepted_paths(parents, valid)
        for r in runners:
            r.commit(slots, cache_lens, accepted)
        cache_lens = [c + int((a >= 0).sum()) for c, a in zip(cache_lens, accepted)]
    assert graphed.graphs._captured, "nothing was captured"



def test_row_buckets_share_their_output_buffers():
    """The verify graphs of one width share output buffers across row buckets (views of the largest
    that warm-up captures): each replay's results, copied out, stay what they were after the other
    bucket's replay overwrote the buffers, and equal the same step run eagerly at its bucket."""
    model = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    static = NativeRunner(model, AUX, max_slots=24, max_len=MAX_LEN, triton_attention=True)
    static.graphs = VerifyGraphs(static.model, static.cache, graph=False, tree_attention=True)
    graphed = NativeRunner(model, AUX, max_slots=24, max_len=MAX_LEN, cuda_graphs=True, triton_attention=True)
    graphed.graphs.warm_up([(8, 5, None, AUX), (16, 5, None, AUX)])
    small, large = graphed.graphs._outputs[(8, 5, AUX)], graphed.graphs._outputs[(16, 5, AUX)]
    assert small.logits.data_ptr() == large.logits.data_ptr() and small.features.data_ptr() == large.features.data_ptr()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(1, 4096, (6 + i,), generator=g).tolist() for i in range(14)]
    slots = list(range(14))
    for r in (static, graphed):
        r.prefill(slots, prompts)
    lens = [len(p) for p in prompts]
    got, want = [], []
    for b in (6, 14, 6):   # buckets 8, 16, 8: each replay overwrites the rows the other wrote
        tokens, parents, valid = random_trees(g, b, 5)
        for r, out in ((static, want), (graphed, got)):
            out.append(r.verify(slots[:b], lens[:b], tokens, parents, valid))
    for (lg, fg), (ls, fs) in zip(got, want):   # read after all three replays
        assert torch.equal(lg, ls) and torch.equal(fg, fs)
    assert not torch.equal(got[0][0][:, 0], got[1][0][:6, 0]), "the two steps' trees were the same"


def test_a_capture_after_warm_up_is_logged(caplog):
    """Once warm-up has run, a verify of a shape it did not capture is captured on first use and
    logged as a warning naming the shape; replays of captured shapes log nothing."""
    model = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    runner = NativeRunner(model, AUX, max_slots=8, max_len=MAX_LEN, cuda_graphs=True)
    g = torch.Generator().manual_seed(7)
    slots = [0, 1, 2]
    prompts = [torch.randint(1, 4096, (9 + i,), generator=g).tolist() for i in range(3)]
    runner.prefill(slots, prompts)
    lens = [len(p) for p in prompts]
    caplog.set_level(logging.WARNING, logger="spectandem.graphs")
    tokens, parents, valid = random_trees(g, 1, 5)
    runner.verify(slots[:1], lens[:1], tokens, parents, valid)        # before warm-up: not logged
    assert not caplog.records
    runner.graphs.warm_up([])
    runner.verify(slots[:1], lens[:1], tokens, parents, valid)        # a replay
    assert not caplog.records
    tokens, parents, valid = random_trees(g, 3, 5)
    runner.verify(slots, lens, tokens, parents, valid)                # batch bucket 4: not captured
    assert len(caplog.records) == 1
    assert "while serving" in caplog.records[0].getMessage() and "(4, 5," in caplog.records[0].getMessage()

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [(1,), (8, 9), (64, 3, 30), (65, 2), (300, 7)],
                         ids=["1", "8-9", "64-3-30", "65-2", "300-7"])
def test_graphed_prefill_equals_eager(dtype, lens):
    """With CUDA graphs, prompts of at most GRAPHED_PREFILL_MAX tokens prefill as a chain each
    through a prefill graph of the verify forward: the last logits and every position's features
    as the eager prefill's, and a verify after it (reading the prefill's K/V) as well. Each case is
    one that `packed_prefill_plan` leaves to the graphs (prompts of 300, 7 and 130 tokens, for
    one, now prefill packed in one forward: `test_packed_prefill_equals_eager`)."""
    from verifier.runner import packed_prefill_plan, prefill_groups

    model = load_llama(demo_paths("none")[0], dtype, "cuda")
    eager = NativeRunner(model, AUX, max_slots=8, max_len=MAX_LEN)
    graphed = NativeRunner(model, AUX, max_slots=8, max_len=MAX_LEN, cuda_graphs=True, triton_attention=True)
    buckets = graphed.graphs.batch_buckets
    assert packed_prefill_plan(list(lens), prefill_groups(list(lens), buckets), buckets, MAX_LEN) is None
    g = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in lens]
    slots = list(range(len(prompts)))
    _same_prefill(eager.prefill(slots, prompts), graphed.prefill(slots, prompts), dtype)
    assert graphed.graphs._prefills and not graphed.graphs._captured   # a prefill graph, no verify step
    _same_verify(eager, graphed, slots, lens, g, dtype)


def _same_prefill(eager, other, dtype) -> None:
    """Two prefills' (logits, features) equal within the dtype's tolerance, argmaxes equal in fp32."""
    (le, fe), (lo, fo) = eager, other
    assert lo.shape == le.shape and [f.shape for f in fo] == [f.shape for f in fe]
    torch.testing.assert_close(lo, le, **TOLERANCE[dtype])
    for a, b in zip(fo, fe):
        torch.testing.assert_close(a, b, **TOLERANCE[dtype])
    if dtype == torch.float32:
        assert torch.equal(lo.argmax(-1), le.argmax(-1))


def _same_verify(eager, other, slots, lens, g, dtype) -> None:
    """A verify of random trees after the prefills (reading their K/V): the same logits on both."""
    tokens, parents, valid = random_trees(g, len(slots), 5)
    (la, _), (lv, _) = [r.verify(slots, list(lens), tokens, parents, valid) for r in (eager, other)]
    torch.testing.assert_close(lv[valid], la[valid], **TOLERANCE[dtype])
    if dtype == torch.float32:
        assert torch.equal(lv[valid].argmax(-1), la[valid].argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("lens", [(1, 9), (64, 3, 30, 200), (248, 226, 42, 162, 135, 244, 154, 181)],
                         ids=["1-9", "64-3-30-200", "wave-8"])
def test_packed_prefill_equals_eager(dtype, lens):
    """Prompts back to back in one forward on the fast path (fused ops, NativeRunner._prefill_packed):
    the last logits and every position's features as the eager prefill's, and a verify after it
    (reading the prefill's K/V) as well; `prefill` takes it for the prompts of four groups or more
    (64-3-30-200: four graphed prefills cost more than one packed forward) and the wave of 8."""
    from verifier.runner import packed_prefill_plan, prefill_groups

    model = load_llama(demo_paths("none")[0], dtype, "cuda")
    eager = NativeRunner(model, AUX, max_slots=8, max_len=MAX_LEN)
    packed = NativeRunner(model, AUX, max_slots=8, max_len=MAX_LEN, cuda_graphs=True, triton_attention=True)
    g = torch.Generator().manual_seed(sum(lens))
    prompts = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in lens]
    slots = list(range(len(prompts)))[::-1]
    _same_prefill(eager.prefill(slots, prompts), packed._prefill_packed(slots, prompts), dtype)
    _same_verify(eager, packed, slots, lens, g, dtype)
    buckets = packed.graphs.batch_buckets
    assert (packed_prefill_plan(list(lens), prefill_groups(list(lens), buckets), buckets, MAX_LEN) is not None) == \
        (len(lens) >= 4)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("b", [1, 3])
def test_graphed_chain_equals_eager(kind, b):
    target = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    # The fused head for every proposer: the graphed one takes it (cuda_graphs), and each
    # comparison is of the same kernels.
    head = load_head(demo_paths(kind)[1], target, kind=kind, dtype=torch.float32, device="cuda").with_ops(FUSED_OPS)
    cfg = SpecConfig(method=kind, num_steps=5, topk=1, num_draft_tokens=5)
    eager = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    static = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    static.chain = ChainGraphs(head, static.cache, graph=False)
    graphed = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN, cuda_graphs=True)
    g = torch.Generator().manual_seed(b)
    reqs = [DraftRequest(f"r{i}", torch.randint(1, 4096, (4 + 13 * i,), generator=g).tolist(), SamplingParams(), 0,
                         False) for i in range(b)]
    new = [r.committed_len - 1 for r in reqs]
    for _ in range(3):
        feats = [torch.randn(n, head.spec.feature_size, generator=g).cuda() for n in new]
        for p in (eager, static, graphed):
            p.catch_up(reqs, new, feats)
        a, s, gr = [p.propose(reqs) for p in (eager, static, graphed)]
        assert torch.equal(gr.token_ids, s.token_ids) and torch.equal(gr.token_ids, a.token_ids)
        assert torch.equal(gr.parents, a.parents) and torch.equal(gr.scores, a.scores)
        new = [1 + i % 3 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
    assert graphed.chain._captured, "nothing was captured"


@pytest.fixture(scope="module")
def plain():
    spec = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=32, max_len=MAX_LEN,
                           device="cuda")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS]
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    return prompts, [o.token_ids for o in outs]


CONFIGS = [
    ("none", dict()),
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=5, topk=4, num_draft_tokens=16)),
    ("eagle", dict(num_steps=4, topk=1, num_draft_tokens=5)),
]


@pytest.mark.parametrize("method,tree", CONFIGS, ids=[f"{m}-{t.get('topk', 0)}" for m, t in CONFIGS])
def test_greedy_with_cuda_graphs_equals_plain(plain, method, tree):
    prompts, expected = plain
    spec = LocalSpeculator(*demo_paths(method), SpecConfig(method=method, **tree), max_slots=32, max_len=MAX_LEN,
                           device="cuda", cuda_graphs=True)
    outs = spec.generate(prompts, [SamplingParams(max_tokens=48)] * len(prompts))
    mismatched = [i for i, (o, e) in enumerate(zip(outs, expected)) if o.token_ids != e]
    assert not mismatched, f"prompts {mismatched} differ from plain decoding"
    assert spec.verifier.runner.graphs._captured
    if method != "none":
        assert sum(o.stats.accepted_tokens for o in outs) > 0


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("b", [1, 3])
def test_graphed_ahead_chains_equal_eager(kind, b):
    """Chain draft ahead (drafter/ahead_chains.py): the CUDA graph gives the eager pass's outcome
    caches (outcomes and next chains), round after round, fp32."""
    target = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    # The fused head for every proposer: the graphed one takes it (cuda_graphs), and each
    # comparison is of the same kernels.
    head = load_head(demo_paths(kind)[1], target, kind=kind, dtype=torch.float32, device="cuda").with_ops(FUSED_OPS)
    cfg = SpecConfig(method=kind, num_steps=4, topk=1, num_draft_tokens=5, ahead_width=5)
    eager = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN)
    graphed = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN, cuda_graphs=True)
    g = torch.Generator().manual_seed(10 + b)
    reqs = [DraftRequest(f"r{i}", torch.randint(1, 4096, (4 + 13 * i,), generator=g).tolist(), SamplingParams(), 0,
                         False) for i in range(b)]
    new = [r.committed_len - 1 for r in reqs]
    for _ in range(3):
        feats = [torch.randn(n, head.spec.feature_size, generator=g).cuda() for n in new]
        for p in (eager, graphed):
            p.catch_up(reqs, new, feats)
        chains = [p.propose(reqs).token_ids.tolist() for p in (eager, graphed)]
        assert chains[0] == chains[1]
        caches = [p.ahead_chains(reqs, chains[0], 5) for p in (eager, graphed)]
        rows = [[{k: t.token_ids[r].tolist() for k, (t, r) in c.items()} for c in cs] for cs in caches]
        assert rows[0] == rows[1] and all(len(c) == 5 for c in rows[0])
        new = [1 + i % 3 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
    assert graphed.ahead_graphs._captured and not eager.ahead_graphs._captured


def _three_proposers(kind, b, seed, eager_chains):
    """The demo head (fp32) behind three proposers, eager, graphed and eager for the two passes
    (with `eager_chains` the eager ones draft chains through ChainGraphs run eagerly), with b
    requests caught up on random features -> (eager, graphed, split, requests, head, generator)."""
    target = load_llama(demo_paths("none")[0], torch.float32, "cuda")
    # The fused head for every proposer: the graphed one takes it (cuda_graphs), and each
    # comparison is of the same kernels.
    head = load_head(demo_paths(kind)[1], target, kind=kind, dtype=torch.float32, device="cuda").with_ops(FUSED_OPS)
    cfg = SpecConfig(method=kind, num_steps=4, topk=1, num_draft_tokens=5, ahead_width=5)
    eager, split = (EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN) for _ in range(2))
    if eager_chains:
        for p in (eager, split):
            p.chain = ChainGraphs(head, p.cache, graph=False)
    graphed = EagleProposer(head, cfg, max_slots=8, max_len=MAX_LEN, cuda_graphs=True)
    g = torch.Generator().manual_seed(seed)
    reqs = [DraftRequest(f"r{i}", torch.randint(1, 4096, (4 + 13 * i,), generator=g).tolist(), SamplingParams(), 0,
                         False) for i in range(b)]
    new = [r.committed_len - 1 for r in reqs]
    feats = [torch.randn(n, head.spec.feature_size, generator=g).cuda() for n in new]
    for p in (eager, split, graphed):
        p.catch_up(reqs, new, feats)
    return eager, graphed, split, reqs, head, g


def _assert_head_states(eager, graphed, split, reqs):
    """The same head-cache lengths; the last hidden and logits as the eager pass's: the graph's
    to a few ulps (the same kernels), the two passes' up to summation order."""
    for r in reqs:
        rid = r.request_id
        assert eager.cache_len[rid] == graphed.cache_len[rid] == split.cache_len[rid]
        for p, tol in ((graphed, dict(atol=1e-5, rtol=1e-5)), (split, TOLERANCE[torch.float32])):
            torch.testing.assert_close(p.last_hidden[rid], eager.last_hidden[rid], **tol)
            torch.testing.assert_close(p.last_logits[rid], eager.last_logits[rid], **tol)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("b", [1, 3])
def test_graphed_catch_up_inside_ahead_equals_eager(kind, b):
    """A deferred catch-up inside the chain draft ahead (`EagleProposer.catch_up_ahead_chains`):
    the CUDA graph gives the same pass run eagerly, and the catch-up then the chain pass (the
    outcome caches; the catch-up's hidden and logits up to summation order), round after round,
    fp32, with 1 to 4 new pairs per request."""
    eager, graphed, split, reqs, head, g = _three_proposers(kind, b, seed=20 + b, eager_chains=False)
    for k in range(4):
        chains = torch.randint(1, 4096, (b, 4), generator=g).tolist()
        new = [1 + (i + k) % 4 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
        feats = [torch.randn(n, head.spec.feature_size, generator=g).cuda() for n in new]
        caches = [p.catch_up_ahead_chains(reqs, new, feats, chains, 5) for p in (eager, graphed)]
        split.catch_up(reqs, new, feats)
        caches.append(split.ahead_chains(reqs, chains, 5))
        rows = [[{key: t.token_ids[r].tolist() for key, (t, r) in c.items()} for c in cs] for cs in caches]
        assert rows[0] == rows[1] == rows[2] and all(len(c) == 5 for c in rows[0])
        _assert_head_states(eager, graphed, split, reqs)
    assert any(key[-1] > 0 for key in graphed.ahead_graphs._captured)


@pytest.mark.parametrize("kind", ["eagle3", "eagle"])
@pytest.mark.parametrize("b", [1, 3])
def test_graphed_catch_up_inside_chain_equals_eager(kind, b):
    """A verdict's catch-up inside the next draft (`EagleProposer.catch_up_propose`): the CUDA
    graph gives the same pass run eagerly, and the catch-up then the chain (the chains, token for
    token; the catch-up's hidden and logits up to summation order), round after round, fp32,
    with 1 to 4 new pairs per request."""
    eager, graphed, split, reqs, head, g = _three_proposers(kind, b, seed=30 + b, eager_chains=True)
    for k in range(4):
        new = [1 + (i + k) % 4 for i in range(b)]
        for r, n in zip(reqs, new):
            r.token_ids.extend(torch.randint(1, 4096, (n,), generator=g).tolist())
        feats = [torch.randn(n, head.spec.feature_size, generator=g).cuda() for n in new]
        trees = [p.catch_up_propose(reqs, new, feats) for p in (eager, graphed)]
        split.catch_up(reqs, new, feats)
        trees.append(split.propose(reqs))
        chains = [t.token_ids.tolist() for t in trees]
        assert chains[0] == chains[1] == chains[2]
        _assert_head_states(eager, graphed, split, reqs)
    assert any(key[-1] > 0 for key in graphed.chain._captured)
