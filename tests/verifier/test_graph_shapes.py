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


@pytest.mark.parametrize("max_slots", [3, 40])
def test_every_mixed_step_after_warm_up_takes_a_warmed_graph(max_slots, monkeypatch):
    """Verifies and plain decodes that carry prompts (verify_and_prefill, decode_greedy) take only
    graphs warm-up captured (NativeRunner.mixed_graph_shapes); a step past them leaves its prompts
    to a prefill of their own instead of capturing while serving. A wide tree gets no graphs past
    the batch buckets (MIXED_GRAPH_TOKENS)."""
    from verifier import runner as runner_module

    monkeypatch.setattr(runner_module, "MIXED_GRAPH_TOKENS", 400)
    max_len, widths = 512, [1, 2, 5, 9]
    runner, model = load_runner(demo_paths("eagle3")[0], "final", max_slots + 8, max_len)
    runner.max_slots = max_slots      # the pool has room for the prompts' slots past max_slots
    runner.graphs = VerifyGraphs(model, runner.cache, graph=False, mixed_buckets=runner_module.MIXED_ROW_BUCKETS)
    shapes = set(runner.graph_shapes(widths))
    assert any(k[0] > 64 and k[1] == 1 for k in shapes) and not any(k[0] > 64 and k[1] == 9 for k in shapes)
    runner.graphs.graph = runner.graphs.warmed = True
    asked = []

    def capture(self, rows, n, span, layers):
        asked.append((rows, n, span, layers))
        raise _Asked

    monkeypatch.setattr(VerifyGraphs, "_capture", capture)
    g = torch.Generator().manual_seed(1)
    for b, n, lens in ((max_slots, 1, [133, 100]), (max_slots, 5, [133, 60]), (max_slots, 9, [200]),
                       (2, 9, [133]), (max_slots, 2, [90])):
        slots = list(range(b))
        for s in slots:
            runner.cache.reserve(s, 20)
        prompts = [torch.randint(1, 100, (m,), generator=g).tolist() for m in lens]
        with pytest.raises(_Asked):
            runner.verify_and_prefill(slots, [20] * b, torch.ones(b, n, dtype=torch.long),
                                      torch.arange(-1, n - 1).expand(b, n).clone(), torch.ones(b, n, dtype=torch.bool),
                                      list(range(b, b + len(lens))), prompts)
        for s in range(max_slots + 8):
            runner.release(s)
    assert asked and set(asked) <= shapes, sorted(set(asked) - shapes)


def test_warm_up_on_the_cpu_captures_nothing():
    runner, model = load_runner(demo_paths("eagle3")[0], "final", 2, 64)
    runner.graphs = VerifyGraphs(model, runner.cache, graph=False)   # the CPU's static eager path
    lines = []
    runner.warm_up([1, 2, 3], lines.append)
    assert lines == [] and runner.graphs._captured == {}
