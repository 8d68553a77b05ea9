"""Graphs of two engines replayed at once (run with `python -m pytest -m gpu tests/gpu`): in
`serve --backend local` on one GPU the verifier's and the drafter's graphs replay on their own
streams at the same time. Captured into pools of their own, they are captured on streams of their
own (spectandem/cuda_graphs.py `_side_stream`), so their cuBLAS calls do not share a workspace:
replayed together, many times, each graph's GEMM gives exactly what it gives alone.

The negative control captures the same graphs on one shared stream, as `capture_graph` did when
it kept one capture stream per device: replayed at once, they give wrong results (on the H100,
dozens of the 300 replays of each differ), which shows the check can see the race."""

from __future__ import annotations

import threading

import pytest
import torch

from spectandem import cuda_graphs

pytestmark = pytest.mark.gpu

# A skinny GEMM with a long K (a decode-sized batch through a down projection): cuBLAS splits K
# over its workspace for it.
M, K, N = 8, 14336, 4096
REPLAYS = 300


def _gemm_graph(seed: int, device: torch.device, stream: torch.cuda.Stream | None = None):
    """A graph of one bf16 GEMM in a pool of its own, captured by `capture_graph` or, given
    `stream`, on that stream -> (graph, its output, the tensors it reads). The caller keeps those
    tensors alive: the graph holds their addresses, not them."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(M, K, device=device, dtype=torch.bfloat16, generator=g)
    w = torch.randn(K, N, device=device, dtype=torch.bfloat16, generator=g) / K ** 0.5
    out = torch.empty(M, N, device=device, dtype=torch.bfloat16)

    def body():
        torch.matmul(x, w, out=out)

    pool = torch.cuda.graph_pool_handle()
    if stream is None:
        return cuda_graphs.capture_graph(body, pool, device), out, (x, w)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        body()
    torch.cuda.synchronize()
    return graph, out, (x, w)


def _mismatches_replayed_at_once(graphs) -> list[int]:
    """Replays each graph REPLAYS times from a thread and stream of its own, all at once ->
    per graph, how many replays differed from its replay alone."""
    alone = []
    for graph, out, _ in graphs:
        graph.replay()
        torch.cuda.synchronize()
        alone.append(out.clone())
    device = alone[0].device
    streams = [torch.cuda.Stream(device) for _ in graphs]
    mismatches = [0] * len(graphs)
    errors: list[BaseException] = []

    def replay(i: int) -> None:   # one thread per engine, as the local backend runs them
        graph, out, _ = graphs[i]
        try:
            with torch.cuda.stream(streams[i]):
                for _ in range(REPLAYS):
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
    return mismatches


def test_two_pools_capture_on_two_streams():
    device = torch.device("cuda", torch.cuda.current_device())
    a, b = torch.cuda.graph_pool_handle(), torch.cuda.graph_pool_handle()
    assert cuda_graphs._side_stream(device, a) is not cuda_graphs._side_stream(device, b)
    assert cuda_graphs._side_stream(device, a) is cuda_graphs._side_stream(device, a)


def test_graphs_of_two_pools_replayed_at_once_give_what_they_give_alone():
    device = torch.device("cuda", torch.cuda.current_device())
    graphs = [_gemm_graph(0, device), _gemm_graph(1, device)]
    assert _mismatches_replayed_at_once(graphs) == [0, 0]


def test_negative_control_graphs_captured_on_one_stream_race():
    device = torch.device("cuda", torch.cuda.current_device())
    shared = torch.cuda.Stream(device)
    graphs = [_gemm_graph(0, device, shared), _gemm_graph(1, device, shared)]
    assert sum(_mismatches_replayed_at_once(graphs)) > 0
