"""What every CUDA graph of the engines shares: the batch and span buckets that make shapes
static, and the capture.

A step over B rows runs as Bc >= B rows (`BATCH_BUCKETS`); one that reads up to `span` cache
entries runs over S >= span columns (`span_bucket`: a power of two, at most the cache's max_len).
The verify step (verifier/graphs.py) and the head's catch-ups and chains (drafter/graphs.py,
drafter/catchup_graphs.py, drafter/ahead_chains.py) capture one graph per such shape; the
hazards of replaying them are in verifier/graphs.py's docstring.

Start-up captures every shape serving is expected to meet; a shape it did not cover is captured
on first use, and the batch that met it waits for the capture. `captured_while_serving` logs each
such capture as a warning, so that a stall of that kind shows in the server's log.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

import torch

log = logging.getLogger("spectandem.graphs")

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MIN_SPAN = 32


def batch_bucket(batch: int, buckets: tuple[int, ...] = BATCH_BUCKETS) -> int | None:
    """The smallest bucket holding `batch` rows; None past the largest (run eagerly)."""
    return next((b for b in buckets if b >= batch), None)


def span_bucket(span: int, max_len: int) -> int:
    """Cache columns a step of `span` entries runs over: the next power of two (at least
    MIN_SPAN), capped at max_len. Example: max_len 300 -> 5 -> 32, 33 -> 64, 257 -> 300."""
    if not 1 <= span <= max_len:
        raise ValueError(f"span must be in [1, {max_len}] (the cache's max_len), got {span}")
    return min(max(MIN_SPAN, 1 << (span - 1).bit_length()), max_len)


def captured_while_serving(family: str, key: tuple) -> None:
    """Logs the capture of `family`'s graph of shape `key` after its warm-up: a shape the warm-up
    did not cover, met while serving (its batch waits for the capture)."""
    log.warning("%s: capturing the CUDA graph of shape %s while serving (start-up did not capture it); "
                "its batch waits for the capture", family, key)


_CAPTURE_LOCK = threading.Lock()
_SIDE_STREAMS: dict = {}   # (device, graph pool) -> the stream every capture into that pool runs on


def _side_stream(device: torch.device, pool) -> "torch.cuda.Stream":
    """One capture stream per (device, graph pool). Per pool, not per capture: the caching
    allocator reuses a freed block only on the stream it was freed on, so captures on a new
    stream each would each grow the pool (1,608 drafter graphs of the 8B-shaped head took 9.6
    GiB that way). Per pool, not per device: a captured cuBLAS call keeps the workspace of its
    capture stream (PyTorch keys cuBLAS workspaces by stream), so graphs captured on one stream
    share one workspace, and two of them replayed at once on two streams (the verifier's and
    the drafter's graphs of `serve --backend local` on one GPU) would both write it. Each
    engine's graphs live in pools of their own and replay on that engine's stream, one at a
    time. A new stream first hands back the blocks the earlier streams' warm-ups left cached
    (empty_cache): the new one could not reuse them."""
    key = torch.device(device)
    if key.index is None:
        key = torch.device(key.type, torch.cuda.current_device())
    if (key, pool) not in _SIDE_STREAMS:
        torch.cuda.empty_cache()
        _SIDE_STREAMS[key, pool] = torch.cuda.Stream(key)
    return _SIDE_STREAMS[key, pool]


def capture_graph(fn: Callable[[], None], pool, device: torch.device, warmup: int = 2) -> "torch.cuda.CUDAGraph":
    """Captures `fn` (which must only write buffers allocated outside `pool`). The warm-up runs
    on a side stream first, so lazy initialisation (cuBLAS handles, workspaces) happens outside
    the capture.

    The capture runs on that side stream, made on `device` once per pool (`_side_stream`):
    torch.cuda.graph's default capture stream is one per process, made on whichever device
    captured first, so a drafter capturing on cuda:1 after a verifier on cuda:0 would capture
    nothing (seen on the H200), and its graphs would share one cuBLAS workspace. Captures are
    serialized across the process's threads (the two engines of `serve --backend local`)."""
    with _CAPTURE_LOCK, torch.cuda.device(device), torch.no_grad():
        side = _side_stream(device, pool)
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(warmup):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: the other engine of this process may launch work from its own thread
        # while this one captures (the router runs drafter and verifier calls concurrently).
        with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
            fn()
    graph.device = torch.device(device)   # which device replays it (benchmarks/profile_router.py)
    return graph
