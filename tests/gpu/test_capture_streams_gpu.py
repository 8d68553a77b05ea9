"""Graphs of two engines replayed at once (run with `python -m pytest -m gpu tests/gpu`): in
`serve --backend local` on one GPU the verifier's and the drafter's graphs replay on their own
streams at the same time. Captured into pools of their own, they are captured on streams of their
own (spectandem/cuda_graphs.py `_side_stream`), so their cuBLAS calls do not share a workspace:
replayed together, many times, each graph's GEMMs give exactly what they give alone."""

from __future__ import annotations

import threading

import pytest
import torch

from spectandem import cuda_graphs

pytestmark = pytest.mark.gpu


def _gemm_graph(m: int, k: int, n: int, device: torch.device, seed: int):
    """A graph of two bf16 GEMMs (a projection-sized one and a skinny one, shapes where cuBLAS
    may split K over a workspace) in a pool of its own -> (graph, its output)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16, generator=g)
    w1 = torch.randn(k, n, device=device, dtype=torch.bfloat16, generator=g) / k ** 0.5
    w2 = torch.randn(n, k, device=device, dtype=torch.bfloat16, generator=g) / n ** 0.5
    out = torch.empty(m, k, device=device, dtype=torch.bfloat16)

    def body():
        out.copy_(torch.relu(x @ w1) @ w2)

    return cuda_graphs.capture_graph(body, torch.cuda.graph_pool_handle(), device), out


def test_two_pools_capture_on_two_streams():
    device = torch.device("cuda", torch.cuda.current_device())
    a, b = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
    assert cuda_graphs._side_stream(device, a) is not cuda_graphs._side_stream(device, b)
    assert cuda_graphs._side_stream(device, a) is cuda_graphs._side_stream(device, a)


def test_graphs_of_two_pools_replayed_at_once_give_what_they_give_alone():
    device = torch.device("cuda", torch.cuda.current_device())
    graphs = [_gemm_graph(512, 4096, 14336, device, 0), _gemm_graph(256, 4096, 14336, device, 1)]
    alone = []
    for graph, out in graphs:
        graph.replay()
        torch.cuda.synchronize()
        alone.append(out.clone())
    streams = [torch.cuda.Stream(device) for _ in graphs]
    mismatches = [0, 0]
    errors: list[BaseException] = []

    def replay(i: int) -> None:   # one thread per engine, as the local backend runs them
        graph, out = graphs[i]
        try:
            with torch.cuda.stream(streams[i]):
                for _ in range(200):
                    graph.replay()
                    streams[i].synchronize()
                    mismatches[i] += not torch.equal(out, alone[i])
        except BaseException as exc:  # surfaced below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=replay, args=(i,)) for i in range(len(graphs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a replay did not finish within 120 s"
    assert errors == []
    assert mismatches == [0, 0]
