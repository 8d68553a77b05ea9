"""The drafter's CUDA graphs captured at start-up (EagleProposer.graph_shapes / warm_up; the
families' catch_up_graph_shapes, chain_graph_shapes, ahead_graph_shapes) are the ones the
proposer asks for while serving; warm-up reports its progress and captures nothing on the CPU;
a capture after warm-up logs a warning naming its key (the drafter's families and VerifyGraphs).

The demo pair drives the real engines (draft, draft ahead, verify, extend; greedy and sampled
requests; capped draft depths) with graph families that take their capture path, where the
capture is recorded, not made, and the call then runs the same padded computation eagerly."""

from __future__ import annotations

import logging

import pytest
import torch

from drafter.ahead_chains import ahead_graph_shapes
from drafter.catchup_graphs import CatchUpGraphs, catch_up_graph_shapes
from drafter.graphs import ChainGraphs, chain_graph_shapes
from drafter.proposers import EagleProposer
from router.local import LocalSpeculator
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from tests.e2e.conftest import PROMPT_TEXTS

MAX_LEN = 256


class _Asked(Exception):
    pass


def test_shape_set_examples():
    cfg = SpecConfig(method="eagle3", num_steps=2, topk=1, num_draft_tokens=3)
    assert chain_graph_shapes(cfg, 1, 32, pair_buckets=(1, 2)) == [(1, 32, 2, 0), (1, 32, 2, 1), (1, 32, 2, 2)]
    assert chain_graph_shapes(SpecConfig(method="eagle3", topk=2), 4, 256) == []
    assert catch_up_graph_shapes(1, 100, pair_buckets=(1, 64)) == [
        (1, 1, 32), (1, 1, 64), (1, 1, 100), (1, 64, 32), (1, 64, 64), (1, 64, 100)]
    # Prefill pair buckets only where rows * Tc <= PREFILL_PAIR_ROWS; spans only those a catch-up reaches.
    assert {(r, p) for r, p, _ in catch_up_graph_shapes(64, 4096)} >= {(64, 32), (4, 512)}
    assert not {(r, p) for r, p, _ in catch_up_graph_shapes(64, 4096)} & {(64, 64), (8, 512)}
    assert {s for _, p, s in catch_up_graph_shapes(1, 4096) if p == 512} == {512, 1024, 2048, 4096}
    one = SpecConfig(method="eagle3", num_steps=1, topk=1, ahead_width=1)
    assert ahead_graph_shapes(one, 1, 64, pair_buckets=(1,)) == [
        (1, 32, 1, 1, 1, 0), (1, 64, 1, 1, 1, 0), (1, 32, 1, 1, 1, 1), (1, 64, 1, 1, 1, 1)]
    assert ahead_graph_shapes(SpecConfig(method="eagle3", topk=1, ahead_width=0), 4, 256) == []


def _ask(asked, graphs):
    def graph_of(key):
        asked.append((type(graphs).__name__, key))
        raise _Asked
    return graph_of


def _eager_when_asked(graphs, call):
    def wrapped(*args, **kwargs):
        try:
            return call(*args, **kwargs)
        except _Asked:
            graphs.graph = False
            try:
                return call(*args, **kwargs)
            finally:
                graphs.graph = True
    return wrapped


def _recording(proposer: EagleProposer, asked: list) -> None:
    """The proposer's graph families (built on the CPU's static eager path) take their capture
    path; each capture asked for is recorded (family, key) and the call runs eagerly instead."""
    proposer.catch_up_graphs = CatchUpGraphs(proposer.head, proposer.cache, graph=False)
    proposer.chain = ChainGraphs(proposer.head, proposer.cache, graph=False)
    for graphs, method in ((proposer.catch_up_graphs, "run"), (proposer.chain, "_run"),
                           (proposer.ahead_graphs, "_run")):
        if graphs is not None:
            graphs.graph = True
            graphs._graph_of = _ask(asked, graphs)
            setattr(graphs, method, _eager_when_asked(graphs, getattr(graphs, method)))


def _serve(spec: LocalSpeculator, batch: int, sampled: list[bool], rounds: int, first: int) -> None:
    """`batch` requests (prompts of 6 to about 130 tokens; sampled ones at temperature 1) through
    `rounds` rounds of draft (every third at depth 2, every third caught up first), draft ahead,
    verify and extend."""
    v, d = spec.verifier, spec.drafter
    rids = [f"r{first + i}" for i in range(batch)]
    prompts = [(spec.tokenizer.encode(PROMPT_TEXTS[(first + i) % len(PROMPT_TEXTS)]).ids * 40)[: 6 + 41 * i]
               for i in range(batch)]
    params = [SamplingParams(max_tokens=200, temperature=1.0 if s else 0.0, seed=7) for s in sampled]
    firsts = v.prefill(rids, prompts, params, [first + i for i in range(batch)])
    for rid, p, f, sp in zip(rids, prompts, firsts, params):
        d.add(rid, p, f.first_token_id, sp, 7, f.features)
    for k in range(rounds):
        if k % 3 == 1:   # catch-ups run before the draft (as draft ahead's flush does): chains start caught up
            d.flush_deferred(rids)
        tree = d.draft(rids, [2] * batch if k % 3 == 2 else None)
        d.draft_ahead(rids)
        d.extend(v.verify(tree))
    for rid in rids:
        v.release(rid)
        d.remove(rid)


@pytest.mark.parametrize("tree", [dict(num_steps=4, topk=1, num_draft_tokens=5, ahead_width=3),
                                  dict(num_steps=3, topk=2, num_draft_tokens=6, ahead_width=2)])
def test_every_key_the_proposer_asks_for_is_warmed_up(tree):
    t, dr = demo_paths("eagle3")
    spec = LocalSpeculator(t, dr, SpecConfig(method="eagle3", **tree), max_slots=4, max_len=MAX_LEN)
    proposer = spec.drafter.proposer
    asked: list[tuple[str, tuple]] = []
    _recording(proposer, asked)
    shapes = {type(g).__name__: set(keys) for g, keys in proposer.graph_shapes()}
    first = 0
    for batch, sampled in ((1, [False]), (4, [False] * 4), (3, [False, True, False]), (2, [True, True])):
        _serve(spec, batch, sampled, 5, first)
        first += batch
    missing = sorted({(name, key) for name, key in asked if key not in shapes[name]})
    assert not missing, missing
    by_family = {name: {key for n, key in asked if n == name} for name, _ in asked}
    assert {r for r, _, _ in by_family["CatchUpGraphs"]} >= {1, 2, 4}
    if tree["topk"] == 1:   # chains with and without a catch-up inside, several batches, a prefill's pairs
        chain, ahead = by_family["ChainGraphs"], by_family["AheadChainGraphs"]
        assert {k[3] > 0 for k in chain} == {True, False} and {k[0] for k in chain} >= {1, 4}
        assert any(k[3] > 16 for k in chain) and {k[2] for k in chain} == {2, 4}
        assert {k[-1] > 0 for k in ahead} == {True, False} and {k[0] for k in ahead} >= {1, 4}
    else:   # trees: neither chains nor chain draft ahead, in the set or asked for
        assert not shapes.get("ChainGraphs") and not shapes.get("AheadChainGraphs")
        assert set(by_family) == {"CatchUpGraphs"}


def test_warm_up_captures_the_start_up_set_and_reports_progress(monkeypatch):
    t, dr = demo_paths("eagle3")
    spec = LocalSpeculator(t, dr, SpecConfig(method="eagle3", num_steps=3, topk=1, num_draft_tokens=4, ahead_width=2),
                           max_slots=2, max_len=64)
    proposer = spec.drafter.proposer
    _recording(proposer, [])
    captured = []

    def capture(self, key):   # recorded, not made (no CUDA here)
        captured.append((type(self).__name__, key))
        self._captured[key] = None

    for cls in (CatchUpGraphs, ChainGraphs, type(proposer.ahead_graphs)):
        monkeypatch.setattr(cls, "_capture", capture)
    lines = []
    proposer.warm_up(lines.append)
    expected = [(type(g).__name__, key) for g, keys in proposer.graph_shapes() for key in keys]
    assert captured == expected and len(expected) > 20
    n = len(expected)
    assert lines[-1] == f"capturing CUDA graphs: {n}/{n}" and lines[0] == f"capturing CUDA graphs: 10/{n}"
    assert all(g.warmed for g, _ in proposer.graph_shapes())
    lines.clear()
    proposer.warm_up(lines.append)   # everything is captured already
    assert lines == [] and len(captured) == n


def test_warm_up_on_the_cpu_captures_nothing():
    t, dr = demo_paths("eagle3")
    spec = LocalSpeculator(t, dr, SpecConfig(method="eagle3", topk=1, ahead_width=2), max_slots=2, max_len=64)
    proposer = spec.drafter.proposer
    assert proposer.chain is None and proposer.catch_up_graphs is None and not proposer.ahead_graphs.graph
    lines = []
    proposer.warm_up(lines.append)
    assert lines == [] and proposer.ahead_graphs._captured == {} and proposer.graph_shapes() == []


@pytest.mark.parametrize("warmed", [True, False])
def test_a_capture_after_warm_up_logs_a_warning_naming_its_key(warmed, caplog):
    t, dr = demo_paths("eagle3")
    spec = LocalSpeculator(t, dr, SpecConfig(method="eagle3", topk=1), max_slots=2, max_len=64)
    proposer = spec.drafter.proposer
    graphs = ChainGraphs(proposer.head, proposer.cache, graph=False)
    graphs.warmed = warmed
    made = []
    graphs._capture = lambda key: (made.append(key), graphs._captured.setdefault(key, "graph"))
    with caplog.at_level(logging.WARNING, logger="spectandem.drafter"):
        assert graphs._graph_of((2, 64, 4, 0)) == "graph"
        assert graphs._graph_of((2, 64, 4, 0)) == "graph"   # captured once, warned once
    assert made == [(2, 64, 4, 0)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == (["drafter: ChainGraphs captured a CUDA graph while serving, key (2, 64, 4, 0) "
                         "(not in the start-up set)"] if warmed else [])


@pytest.mark.parametrize("warmed", [True, False])
def test_a_verify_capture_after_warm_up_logs_a_warning_naming_its_key(warmed, caplog, monkeypatch):
    from spectandem.messages import DraftTree
    from verifier.engine import VerifierEngine
    from verifier.graphs import VerifyGraphs
    from verifier.runner import load_runner

    runner, model = load_runner(demo_paths("eagle3")[0], None, 2, 64)
    runner.graphs = VerifyGraphs(model, runner.cache, graph=False)
    runner.graphs.warm_up([])   # nothing to capture; warm-up is over
    runner.graphs.warmed = warmed
    engine = VerifierEngine(runner, 2, model.spec.vocab_size)
    engine.prefill(["a"], [[1, 2, 3]], [SamplingParams()], [0])
    runner.graphs.graph = True  # run takes the capture path; the capture is observed, not made

    def capture(self, rows, n, span, layers):
        raise RuntimeError("captured")

    monkeypatch.setattr(VerifyGraphs, "_capture", capture)
    tree = DraftTree(request_ids=["a"], committed_lens=[4], token_ids=torch.ones(1, 3, dtype=torch.long),
                     parents=torch.tensor([[-1, 0, 1]]), node_valid=torch.ones(1, 3, dtype=torch.bool),
                     scores=torch.zeros(1, 3))
    with caplog.at_level(logging.WARNING, logger="spectandem.verifier"), pytest.raises(RuntimeError, match="captured"):
        engine.verify(tree)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == (["verifier: VerifyGraphs captured a CUDA graph while serving, key (1, 3, 32, None) "
                         "(not in the start-up set)"] if warmed else [])
