"""The graphs captured at start-up (NativeRunner.graph_shapes, verifier/graphs.py
verify_graph_shapes; NativeRunner.prefill_graph_shapes) are the ones `VerifyGraphs.run` and
`VerifyGraphs.prefill` ask for; on the CPU warm-up captures nothing."""

import pytest
import torch

from spectandem.config import SamplingParams
from spectandem.demo import demo_paths
from spectandem.messages import DraftTree
from verifier.engine import VerifierEngine
from verifier.graphs import VerifyGraphs, verify_graph_shapes
from verifier.runner import load_runner


class _Asked(Exception):
    pass


def test_shape_set_example():
    assert verify_graph_shapes(3, [5], 100, [None]) == [(r, 5, s, None) for r in (1, 2, 4) for s in (32, 64, 100)]
    assert verify_graph_shapes(3, [5], 100, [None], tree_attention=True) == [(r, 5, None, None) for r in (1, 2, 4)]


@pytest.mark.parametrize("feature_layers", [None, "final"])
def test_every_key_run_asks_for_is_warmed_up(feature_layers, monkeypatch):
    max_len, widths = 160, [1, 2, 3, 4, 5]
    runner, model = load_runner(demo_paths("eagle3")[0], feature_layers, 3, max_len)
    runner.graphs = VerifyGraphs(model, runner.cache, graph=False)
    runner.graphs.graph = True      # run takes the capture path; the capture is observed, not made
    asked = []

    def capture(self, rows, n, span, layers):
        asked.append((rows, n, span, layers))
        raise _Asked

    monkeypatch.setattr(VerifyGraphs, "_capture", capture)
    monkeypatch.setattr(VerifyGraphs, "_capture_prefill", capture)
    shapes = set(runner.graph_shapes(widths)) | set(runner.prefill_graph_shapes())
    engine = VerifierEngine(runner, 3, model.spec.vocab_size)
    for b in (1, 2, 3):
        for plen in (3, 9, 40, 150):
            ids = [f"r{i}" for i in range(b)]
            try:   # graphed prefills of short prompts
                engine.prefill(ids, [[1] * plen] * b, [SamplingParams()] * b, list(range(b)))
            except _Asked:
                for slot in range(3):
                    runner.release(slot)
                engine.free_slots = [2, 1, 0]
                runner.graphs.graph = False
                engine.prefill(ids, [[1] * plen] * b, [SamplingParams()] * b, list(range(b)))
                runner.graphs.graph = True
            for n in widths:
                if plen + 1 + n > max_len:
                    continue
                tree = DraftTree(request_ids=ids, committed_lens=[plen + 1] * b,
                                 token_ids=torch.ones(b, n, dtype=torch.long),
                                 parents=torch.arange(-1, n - 1).expand(b, n).clone(),
                                 node_valid=torch.ones(b, n, dtype=torch.bool), scores=torch.zeros(b, n))
                with pytest.raises(_Asked):
                    engine.verify(tree)
            for rid in ids:
                engine.release(rid)
    assert asked and set(asked) <= shapes, sorted(set(asked) - shapes)


def test_warm_up_on_the_cpu_captures_nothing():
    runner, model = load_runner(demo_paths("eagle3")[0], "final", 2, 64)
    runner.graphs = VerifyGraphs(model, runner.cache, graph=False)   # the CPU's static eager path
    lines = []
    runner.warm_up([1, 2, 3], lines.append)
    assert lines == [] and runner.graphs._captured == {}
