"""The channel's shared parts: the message header, references, addresses and the two-rank group."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

# What the engine entry points put in their environment (python -m verifier / drafter, the Ray
# actors' runtime_env): a failed operation of the channel's NCCL group aborts the group only.
NCCL_ERROR_HANDLING = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "2"}

log = logging.getLogger("spectandem.channel")

HEADER_LEN = 256
MAX_ITEMS = 64           # per message, and as many shapes as the header holds: 3-D items fit 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool)
# Idle receivers wait on their posted header recv: a group timeout would fire on an idle
# channel, so the groups get none in practice; liveness comes from send_timeout_s.
_GROUP_TIMEOUT = timedelta(days=30)
_CLOSE = -1
NO_SLOT = -1             # header[4]: the payload follows over the group, not in a ring slot
SHAPES_AT = 5            # header[SHAPES_AT:]: the items' shapes


class FeatureChannelError(RuntimeError):
    """Features that did not come (late, dropped, a broken channel, a bad reference)."""


@dataclass(frozen=True)
class ChannelRef:
    """Item `index` of channel message `seq`: a request's features, sent drafter-ward directly."""

    seq: int
    index: int


def parse_address(address: str) -> tuple[str, int]:
    """"tcp://HOST:PORT" -> (HOST, PORT); the verifier listens there for the rendezvous."""
    url = urlparse(address)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(f"feature channel address must be tcp://HOST:PORT, got {address!r}")
    return url.hostname, url.port


def _device(device: str | torch.device) -> torch.device:
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"the feature channel runs between CPU or CUDA engines, not {dev.type!r}")
    return dev


class _Group:
    """The two ranks' groups: gloo for headers, and payloads by the first of these that comes
    up: a PayloadRing when both ends are on one device (one GPU, or the host between CPU engines:
    ring.py), NCCL between two GPUs, gloo (through host memory) otherwise and for messages larger
    than a ring slot. Built outside torch.distributed's global state, so nothing else in the
    process (a default group, another channel) is touched. `ring`: (slots, slot_bytes) the
    verifier (rank 0) offers; None or 0 slots: no ring."""

    def __init__(self, address: str, rank: int, device: torch.device, timeout_s: float,
                 ring: tuple[int, int] | None = None):
        host, port = parse_address(address)
        self.rank, self.peer, self.device = rank, 1 - rank, device
        self.store = dist.TCPStore(host, port, 2, rank == 0, timedelta(seconds=timeout_s), wait_for_workers=False)
        # Both sides must move payloads the same way: a CUDA verifier with a CPU drafter would hang.
        self.store.set(f"device-{rank}", device.type)
        peer_type = self.store.get(f"device-{self.peer}").decode()
        if peer_type != device.type:
            raise FeatureChannelError(f"this {'verifier' if rank == 0 else 'drafter'} is on {device.type}, its peer "
                                      f"on {peer_type}: the channel needs both on CUDA or both on CPU")
        opts = dist.ProcessGroupGloo._Options()
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        opts._timeout = _GROUP_TIMEOUT
        self.gloo = dist.ProcessGroupGloo(dist.PrefixStore("gloo", self.store), rank, 2, opts)
        same_device = device.type == "cpu" or self._same_gpu()
        self.ring = self._share_ring(ring if same_device else None)
        self.nccl = self._nccl() if device.type == "cuda" and not same_device else None
        self.stream = torch.cuda.Stream(device) if self.nccl is not None else None
        if same_device and device.type == "cuda" and self.ring is None:
            log.warning("feature channel: both engines are on one GPU without a payload ring; features go "
                        "through host memory")

    @property
    def transport(self) -> str:
        if self.ring is not None:
            return "CUDA IPC ring" if self.device.type == "cuda" else "shared-memory ring"
        return "NCCL" if self.nccl is not None else "gloo"

    def _same_gpu(self) -> bool:
        """Both ends on one GPU (NCCL refuses two ranks there)."""
        uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", "")) or f"pid-{os.getpid()}"
        self.store.set(f"gpu-{self.rank}", uuid)
        return self.store.get(f"gpu-{self.peer}").decode() == uuid

    def _share_ring(self, ring: tuple[int, int] | None):
        """The verifier creates the ring and publishes it; the drafter maps it and says whether it
        could. -> this end's PayloadRing, or None (either end could not: payloads by the group)."""
        from spectandem.channel.ring import PayloadRing, RingSpec

        if self.rank == 0:
            mine = PayloadRing.create(self.device, *ring) if ring and ring[0] > 0 else None
            try:
                self.store.set("ring", mine.export() if mine is not None else b"")
                ok = self.store.get("ring-ok") == b"1"
            except BaseException:
                if mine is not None:
                    mine.close()
                raise
            if mine is not None:
                mine.unlink()      # both ends have it mapped: the name is no longer needed
                if not ok:
                    mine.close()
            return mine if ok else None
        spec = self.store.get("ring")
        mine = None
        if spec:
            try:
                mine = PayloadRing.attach(RingSpec.from_bytes(spec), self.device)
            except Exception as exc:
                log.warning("feature channel: cannot map the verifier's payload ring (%s: %s); payloads go "
                            "through the group", type(exc).__name__, exc)
        self.store.set("ring-ok", b"1" if mine is not None else b"0")
        return mine

    def _nccl(self):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _GROUP_TIMEOUT
        # Hazard: by default NCCL's watchdog takes the whole process down when an operation of
        # the group fails (a dead peer). Torch takes the remedy only from the environment, so the
        # engine entry points set NCCL_ERROR_HANDLING (CleanUpOnly: the group aborts, the process
        # stays up) before anything starts.
        return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), self.rank, 2, opts)

    # gloo waits are untimed: a timed wait returned milliseconds late. The sender watches for a
    # wait that lasts too long instead (FeatureSender._check_stuck).

    def send_header(self, values: list[int]) -> None:
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[:len(values)] = torch.tensor(values, dtype=torch.int64)
        self.gloo.send([header], self.peer, 0).wait()

    def recv_header(self) -> list[int]:
        header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.gloo.recv([header], self.peer, 0).wait()
        return header.tolist()

    def send_payload(self, payload: torch.Tensor):
        """-> the NCCL work still in flight (None over gloo: done when this returns)."""
        if self.nccl is None:
            self.gloo.send([payload.cpu()], self.peer, 0).wait()
            return None
        return self.nccl.send([payload], self.peer, 0)

    def recv_payload(self, payload: torch.Tensor) -> None:
        """Returns once `payload` holds the bytes (on the GPU: without spinning a CPU core)."""
        if self.nccl is None:
            host = payload if payload.device.type == "cpu" else torch.empty(payload.shape, dtype=payload.dtype)
            self.gloo.recv([host], self.peer, 0).wait()
            if host is not payload:
                payload.copy_(host)
            return
        self.nccl.recv([payload], self.peer, 0).wait()     # this thread's stream waits for it
        done = torch.cuda.Event(blocking=True)
        done.record()
        done.synchronize()

    def abort(self) -> None:
        """Ends the groups' pending operations (a dead peer's send kernel, a posted recv). The
        ring stays mapped: a receiver thread may still be copying out of it."""
        for pg in (self.nccl, self.gloo):
            stop = getattr(pg, "abort", None) if pg is not None else None
            if stop is not None:
                try:
                    stop()
                except Exception as exc:  # already torn down: nothing left to end
                    log.debug("feature channel: abort: %s", exc)


def header_shapes(header: list[int]) -> list[tuple[int, ...]]:
    """The items' shapes a header names."""
    num_items, ndim = header[1], header[2]
    return [tuple(header[SHAPES_AT + i * ndim:SHAPES_AT + (i + 1) * ndim]) for i in range(num_items)]


def _header(seq: int, items: list[torch.Tensor], slot: int = NO_SLOT) -> list[int]:
    ndim = items[0].dim() if items else 0
    return ([seq, len(items), ndim, _DTYPES.index(items[0].dtype) if items else 0, slot]
            + [d for t in items for d in t.shape])
