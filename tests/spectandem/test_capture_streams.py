"""Capture streams (spectandem/cuda_graphs.py `_side_stream`): one per (device, graph pool).
Graphs captured on one stream share its cuBLAS workspace, so the verifier's and the drafter's
graphs, replayed at once on their own streams in one process, must not be captured on one
stream; the captures into one pool share a stream so that the pool's freed blocks are reused.
The streams are stand-ins here (no GPU): the test checks which captures share one."""

from __future__ import annotations

import torch

from spectandem import cuda_graphs


class _Stream:
    def __init__(self, device):
        self.device = device


def test_one_capture_stream_per_device_and_pool(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "_SIDE_STREAMS", {})
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    verifier_pool, drafter_pool = (1, 0), (2, 0)   # torch.cuda.graph_pool_handle() values
    v = cuda_graphs._side_stream(torch.device("cuda:0"), verifier_pool)
    d = cuda_graphs._side_stream(torch.device("cuda:0"), drafter_pool)
    assert v is not d                                                      # engines apart
    assert cuda_graphs._side_stream(torch.device("cuda:0"), verifier_pool) is v   # one pool: one stream
    assert cuda_graphs._side_stream(torch.device("cuda"), verifier_pool) is v     # "cuda" is the current device
    other = cuda_graphs._side_stream(torch.device("cuda:1"), verifier_pool)
    assert other is not v and other.device == torch.device("cuda:1")
