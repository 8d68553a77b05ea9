"""verifier.graphs on the CPU: the padded static-shape verify step (what a CUDA graph replays),
run eagerly, against `NativeRunner.verify`'s unpadded step on the demo target, over two rounds
with a commit between them; the buckets; the eager fallback past the largest batch bucket.

Padding rows and columns add exact zeros, but a wider reduction or another matmul kernel may sum
in another order, so logits agree to a few fp32 ulps (not bit for bit) and argmaxes exactly.
Without padding the step is the same computation, bit for bit."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectandem.modeling.llama import load_llama
from tests.verifier.random_trees import accepted_paths, random_trees
from spectandem.cuda_graphs import batch_bucket, span_bucket
from verifier.graphs import VerifyGraphs
from verifier.runner import PREFILL_NODE_BUCKETS, NativeRunner, load_runner, prefill_groups, prefill_nodes

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
AUX = (2, 4, 5)
MAX_LEN = 160
ULPS = dict(atol=5e-5, rtol=1e-5)   # fp32 logits of magnitude ~10, another summation order


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def model():
    return load_llama(DEMO)


def _runners(model, features, buckets=(1, 2, 4, 8)):
    """(eager runner, runner whose verify takes the static eager path), same weights."""
    eager = NativeRunner(model, features, max_slots=8, max_len=MAX_LEN)
    static = NativeRunner(model, features, max_slots=8, max_len=MAX_LEN)
    static.graphs = VerifyGraphs(model, static.cache, graph=False, batch_buckets=buckets)
    return eager, static


def _compare(a, b, valid):
    (la, fa), (lb, fb) = a, b
    assert la.shape == lb.shape
    torch.testing.assert_close(lb[valid], la[valid], **ULPS)
    assert torch.equal(lb[valid].argmax(-1), la[valid].argmax(-1))
    if fa is None:
        assert fb is None
    else:
        torch.testing.assert_close(fb[valid], fa[valid], **ULPS)


@pytest.mark.parametrize("features", [AUX, "final", None], ids=["aux", "final", "none"])
@pytest.mark.parametrize("b,n", [(1, 1), (3, 5), (4, 5), (2, 16), (5, 16)])
def test_static_verify_equals_dynamic(model, features, b, n):
    """B = 3 and 5 run in padded buckets (4, 8); spans pad to powers of two."""
    g = torch.Generator().manual_seed(100 * b + n)
    eager, static = _runners(model, features)
    slots = list(range(b))[::-1]
    prompts = [torch.randint(1, 4096, (4 + 9 * i,), generator=g).tolist() for i in range(b)]
    for r in (eager, static):
        r.prefill(slots, prompts)
    cache_lens = [len(p) for p in prompts]
    for _ in range(2):  # the second round reads the first's committed path
        tokens, parents, valid = random_trees(g, b, n)
        outs = [r.verify(slots, cache_lens, tokens, parents, valid) for r in (eager, static)]
        _compare(*outs, valid)
        accepted = accepted_paths(parents, valid)
        for r in (eager, static):
            r.commit(slots, cache_lens, accepted)
        cache_lens = [c + int((a >= 0).sum()) for c, a in zip(cache_lens, accepted)]


def test_unpadded_static_step_is_bit_identical(model):
    """B = 2 fills its bucket and span 16 + 16 = 32 is a bucket: no padding, the same bits."""
    g = torch.Generator().manual_seed(7)
    eager, static = _runners(model, AUX)
    prompts = [torch.randint(1, 4096, (16,), generator=g).tolist() for _ in range(2)]
    for r in (eager, static):
        r.prefill([0, 1], prompts)
    tokens, parents, valid = random_trees(g, 2, 16)
    (la, fa), (lb, fb) = [r.verify([0, 1], [16, 16], tokens, parents, valid) for r in (eager, static)]
    assert torch.equal(la, lb) and torch.equal(fa, fb)


def test_run_returns_the_argmax_of_its_logits(model):
    g = torch.Generator().manual_seed(3)
    _, static = _runners(model, None)
    static.prefill([0, 1, 2], [torch.randint(1, 4096, (9,), generator=g).tolist() for _ in range(3)])
    tokens, parents, valid = random_trees(g, 3, 5)
    for slot in range(3):
        static.cache.reserve(slot, 9 + 5)
    step = static.graphs.run([0, 1, 2], [9, 9, 9], tokens, parents, valid, None)
    assert step.logits.shape == (3, 5, model.spec.vocab_size) and step.features is None
    assert torch.equal(step.argmax, step.logits.argmax(-1))


def test_batches_past_the_largest_bucket_run_eagerly(model):
    """Bucket limit 2: a batch of 3 takes the eager path, bit for bit."""
    g = torch.Generator().manual_seed(5)
    eager, static = _runners(model, "final", buckets=(1, 2))
    prompts = [torch.randint(1, 4096, (6 + i,), generator=g).tolist() for i in range(3)]
    graphs, static.graphs = static.graphs, None   # the same eager prefill on both: the verify is compared
    for r in (eager, static):
        r.prefill([0, 1, 2], prompts)
    static.graphs = graphs
    tokens, parents, valid = random_trees(g, 3, 5)
    (la, fa), (lb, fb) = [r.verify([0, 1, 2], [6, 7, 8], tokens, parents, valid) for r in (eager, static)]
    assert torch.equal(la, lb) and torch.equal(fa, fb)
    assert not static.graphs.supports(3) and static.graphs.supports(2)


def test_buckets():
    assert [batch_bucket(b) for b in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert batch_bucket(65) is None
    assert [span_bucket(s, 300) for s in (1, 32, 33, 129, 256, 257, 300)] == [32, 32, 64, 256, 256, 300, 300]
    assert span_bucket(5, 20) == 20
    with pytest.raises(ValueError, match="span must be in"):
        span_bucket(301, 300)


def test_cuda_graphs_need_cuda_and_the_native_runner(model):
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        NativeRunner(model, None, max_slots=1, max_len=32, cuda_graphs=True)
    with pytest.raises(ValueError, match="need the native runner"):
        load_runner(DEMO, None, max_slots=1, max_len=32, force_hf=True, cuda_graphs=True)


@pytest.mark.parametrize("lens", [(1,), (8, 9), (40,), (64, 3, 30), (150, 2)], ids=["1", "8-9", "40", "64-3-30", "150-2"])
def test_prefill_through_the_verify_step_equals_eager(model, lens):
    """With graphs, short prompts prefill as one chain each through the verify step (here its
    static shape run eagerly): the last logits and every position's features as the eager
    prefill's; a batch whose padded chains pass GRAPHED_PREFILL_ROWS, or whose chain would pass
    the cache, prefills eagerly."""
    g = torch.Generator().manual_seed(sum(lens))
    eager, static = _runners(model, AUX)
    prompts = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in lens]
    slots = list(range(len(prompts)))
    (le, fe), (ls, fs) = eager.prefill(slots, prompts), static.prefill(slots, prompts)
    n = min(b for b in PREFILL_NODE_BUCKETS if b >= max(lens))
    assert static._graphed_prefill_nodes(prompts) == (0 if n > MAX_LEN else n)
    assert ls.shape == le.shape and [f.shape for f in fs] == [f.shape for f in fe]
    torch.testing.assert_close(ls, le, **ULPS)
    assert torch.equal(ls.argmax(-1), le.argmax(-1))
    for a, b in zip(fs, fe):
        torch.testing.assert_close(a, b, **ULPS)
    tokens, parents, valid = random_trees(g, len(prompts), 5)   # reads the prefill's K/V
    _compare(*[r.verify(slots, list(lens), tokens, parents, valid) for r in (eager, static)], valid)


def test_prefill_groups_pad_each_prompt_to_its_own_length():
    assert prefill_groups([100, 20, 300, 120], (1, 2, 4, 8)) == [[1], [0, 3], [2]]
    assert prefill_groups([600, 20, 700], (1, 2, 4, 8)) == [[1], [0, 2]]   # past GRAPHED_PREFILL_MAX: eager
    assert [len(g) for g in prefill_groups([130] * 40, (1, 2, 4, 8, 16, 32, 64))] == [8] * 5   # 8 x 192 rows
    # Chains of 1.5 times a power of two: 129 and 192 tokens share one group, 193 pads to 256.
    assert prefill_groups([129, 193, 192, 33], (1, 2, 4, 8)) == [[3], [0, 2], [1]]


def test_prefill_nodes_pad_by_at_most_half():
    assert [prefill_nodes(m) for m in (1, 8, 9, 33, 48, 49, 129, 192, 193, 385, 512)] == \
        [8, 8, 16, 48, 48, 64, 192, 192, 256, 512, 512]
    assert prefill_nodes(513) == 0   # past GRAPHED_PREFILL_MAX: eager
    assert all(b < 2 * a for a, b in zip(PREFILL_NODE_BUCKETS[2:], PREFILL_NODE_BUCKETS[3:]))
    assert all(prefill_nodes(m) <= 1.5 * m for m in range(32, 513))


def test_large_prefills_run_graphed_only_where_the_padding_is_small(model, monkeypatch):
    """Up to GRAPHED_PREFILL_FREE_ROWS padded rows a prefill is graphed whatever its padding;
    past it only where chains and batch bucket pad the prompts' tokens by at most
    PREFILL_PAD_SHARE, else eagerly (with the eager prefill's logits)."""
    import verifier.runner as runner_module

    assert runner_module.graphed_prefill_pays(1024, 8) and runner_module.graphed_prefill_pays(2048, 2048)
    assert not runner_module.graphed_prefill_pays(8 * 192, 8 * 133)   # 44% padding past 1024 rows
    assert runner_module.graphed_prefill_pays(8 * 192, 8 * 160)
    monkeypatch.setattr(runner_module, "GRAPHED_PREFILL_FREE_ROWS", 256)
    eager, static = _runners(model, AUX)
    g = torch.Generator().manual_seed(8)
    prompts = lambda b, m: [torch.randint(1, 4096, (m,), generator=g).tolist() for _ in range(b)]
    assert static._graphed_prefill_nodes(prompts(4, 40)) == 48     # 192 rows: free
    assert static._graphed_prefill_nodes(prompts(8, 45)) == 48     # 384 rows for 360 tokens
    assert static._graphed_prefill_nodes(prompts(8, 33)) == 0      # 384 rows for 264 tokens
    assert static._graphed_prefill_nodes(prompts(5, 48)) == 0      # a batch bucket of 8 for 5 prompts
    batch = prompts(8, 33)
    slots = list(range(8))
    (le, fe), (ls, fs) = eager.prefill(slots, batch), static.prefill(slots, batch)
    assert torch.equal(ls, le) and all(torch.equal(a, b) for a, b in zip(fs, fe))


def test_prefill_past_the_rows_limit_is_cut_into_groups_that_fit(model, monkeypatch):
    """Under a limit of 128 rows, three prompts that pad to 64 nodes prefill as a graphed group
    of two and one of one, with the eager prefill's logits and features."""
    import verifier.runner as runner_module

    monkeypatch.setattr(runner_module, "GRAPHED_PREFILL_ROWS", 128)
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in (64, 60, 50)]
    eager, static = _runners(model, AUX)
    assert prefill_groups([64, 60, 50], static.graphs.batch_buckets) == [[0, 1], [2]]
    assert static._graphed_prefill_nodes(prompts) == 0 and static._graphed_prefill_nodes(prompts[:2]) == 64
    (le, fe), (ls, fs) = eager.prefill([0, 1, 2], prompts), static.prefill([0, 1, 2], prompts)
    torch.testing.assert_close(ls, le, **ULPS)
    for a, b in zip(fs, fe):
        torch.testing.assert_close(a, b, **ULPS)


def test_prefill_whose_padding_the_pool_cannot_hold_runs_eagerly(model):
    """A pool of 5 blocks of 16 holds a 65-token prompt but not its 96-node padded chain: that
    prefill runs eagerly, with the eager prefill's logits and features, and leaves the prompt's
    blocks alone held; with room for the chain the graphed prefill returns the padding's blocks."""
    g = torch.Generator().manual_seed(6)
    prompt = torch.randint(1, 4096, (65,), generator=g).tolist()
    eager = NativeRunner(model, AUX, max_slots=2, max_len=MAX_LEN, kv_blocks=5)
    static = NativeRunner(model, AUX, max_slots=2, max_len=MAX_LEN, kv_blocks=5)
    static.graphs = VerifyGraphs(model, static.cache, graph=False)
    assert static._graphed_prefill_nodes([prompt]) == 96 and not static._padding_fits([0], 96)
    (le, fe), (ls, fs) = eager.prefill([0], [prompt]), static.prefill([0], [prompt])
    assert torch.equal(ls, le) and torch.equal(fs[0], fe[0])
    assert static.cache.blocks.num_used == 5
    roomy = NativeRunner(model, AUX, max_slots=2, max_len=MAX_LEN, kv_blocks=8)
    roomy.graphs = VerifyGraphs(model, roomy.cache, graph=False)
    (lr, fr) = roomy.prefill([0], [prompt])
    torch.testing.assert_close(lr, le, **ULPS)
    assert roomy.cache.blocks.num_used == 5


def test_prefill_chain_longer_than_the_cache_runs_eagerly(model):
    """A 20-token prompt pads to a 32-node chain: with a 24-entry cache it prefills eagerly."""
    eager = NativeRunner(model, AUX, max_slots=2, max_len=24)
    static = NativeRunner(model, AUX, max_slots=2, max_len=24)
    static.graphs = VerifyGraphs(model, static.cache, graph=False)
    prompt = torch.randint(1, 4096, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    assert static._graphed_prefill_nodes([prompt]) == 0
    (le, _), (ls, _) = eager.prefill([0], [prompt]), static.prefill([0], [prompt])
    assert torch.equal(ls, le)


@pytest.mark.parametrize("features", [AUX, "final", None], ids=["aux", "final", "none"])
@pytest.mark.parametrize("lens", [(1,), (8, 9), (64, 3, 30), (150, 2, 40, 17)],
                         ids=["1", "8-9", "64-3-30", "150-2-40-17"])
def test_packed_prefill_equals_eager(model, features, lens):
    """Prompts back to back in one forward (NativeRunner._prefill_packed): the last logits, every
    position's features and the K/V a verify then reads as the eager prefill's, each slot holding
    the blocks of its own prompt."""
    g = torch.Generator().manual_seed(sum(lens) + 1)
    eager, packed = _runners(model, features)
    prompts = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in lens]
    slots = [3, 0, 5, 1][: len(prompts)]
    (le, fe), (lp, fp) = eager.prefill(slots, prompts), packed._prefill_packed(slots, prompts)
    assert lp.shape == le.shape
    torch.testing.assert_close(lp, le, **ULPS)
    assert torch.equal(lp.argmax(-1), le.argmax(-1))
    if features is None:
        assert fp is None and fe is None
    else:
        assert [f.shape for f in fp] == [f.shape for f in fe]
        for a, b in zip(fp, fe):
            torch.testing.assert_close(a, b, **ULPS)
    assert packed.cache.blocks.num_used == eager.cache.blocks.num_used
    tokens, parents, valid = random_trees(g, len(prompts), 5)   # reads the prefill's K/V
    _compare(*[r.verify(slots, list(lens), tokens, parents, valid) for r in (eager, packed)], valid)


def test_packed_prefill_plan_packs_where_the_groups_cost_more():
    """Prompts of many padded lengths, more than a graphed group takes, or whose padding costs more
    than a packed forward, go packed in runs of about even shares of at most PACKED_PREFILL_TOKENS
    tokens; a few short prompts, or one group that runs graphed with little padding, stay in their
    groups."""
    from verifier.runner import PACKED_PREFILL_TOKENS, packed_prefill_plan

    buckets = (1, 2, 4, 8, 16, 32, 64)
    plan = lambda lens, max_len=2048: packed_prefill_plan(lens, prefill_groups(lens, buckets), buckets, max_len)
    wave = [248, 226, 42, 162, 135, 244, 154, 181, 87, 67, 32, 47, 85, 110, 218, 249]
    assert len(prefill_groups(wave, buckets)) == 6 and plan(wave) == [list(range(16))]
    assert plan([248, 226, 42, 162, 135, 244]) == [list(range(6))]
    runs = plan([133] * 64)
    assert [len(r) for r in runs] == [22, 22, 20] and [i for r in runs for i in r] == list(range(64))
    assert all(133 * len(r) <= PACKED_PREFILL_TOKENS for r in runs)
    assert plan([32, 48]) is None             # two small graphed prefills cost less than one eager forward
    assert plan([130] * 8) == [list(range(8))]   # 1,040 tokens packed, not one graphed group of 8 x 192
    assert plan([100] * 3) is None            # one graphed group of 4 x 128: less than a packed forward's launches
    assert plan([60] * 8) is None             # one graphed group of 8 x 64
    assert plan([5000, 5000], max_len=8192) is None   # past the runs' limit each: one eager forward each either way


def test_prompts_of_several_groups_prefill_packed(model, monkeypatch):
    """Through `prefill`: prompts whose groups cost more run packed (no prefill graph used), with
    the eager prefill's logits and features, in the order given."""
    import verifier.runner as runner_module

    monkeypatch.setattr(runner_module, "GRAPHED_PREFILL_FREE_ROWS", 64)
    monkeypatch.setattr(runner_module, "PREFILL_GRAPH_ROWS", 64)
    g = torch.Generator().manual_seed(11)
    lens = [40, 7, 100, 18, 60]
    prompts = [torch.randint(1, 4096, (m,), generator=g).tolist() for m in lens]
    eager, static = _runners(model, AUX)
    groups = prefill_groups(lens, static.graphs.batch_buckets)
    assert len(groups) == 5
    assert runner_module.packed_prefill_plan(lens, groups, static.graphs.batch_buckets, MAX_LEN) == [[0, 1, 2, 3, 4]]
    slots = [4, 2, 0, 1, 3]
    (le, fe), (ls, fs) = eager.prefill(slots, prompts), static.prefill(slots, prompts)
    assert not static.graphs._prefills
    torch.testing.assert_close(ls, le, **ULPS)
    for a, b in zip(fs, fe):
        torch.testing.assert_close(a, b, **ULPS)
