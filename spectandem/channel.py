"""A direct verifier -> drafter channel for target features, so a round's features never cross
the router (issue 5): a dedicated two-rank torch.distributed group between the two engines of
one node, the verifier rank 0 (sender), the drafter rank 1 (receiver).

    verifier: send([f_0, f_1]) -> [ChannelRef(7, 0), ChannelRef(7, 1)]     (returns at once)
                 | queue
                 v sender thread ---- header (gloo, CPU) ----------> receiver thread
                                 ---- payload (NCCL GPU->GPU, or gloo) --^     | mailbox {7: ...}
    router:   passes the ChannelRefs on, where the tensors went before           v
    drafter:  take(ChannelRef(7, 1)) -> f_1 (or FeatureChannelError: resync the request)

Glossary:
- message: one verifier call's features (a prefill's or a verify's; a call of more than
  MAX_ITEMS requests is split into several), a header and a payload, numbered by `seq` from 1.
- header: int64[HEADER_LEN] = [seq, num_items, ndim, dtype code, shape of item 0, shape of
  item 1, ...], zero-padded. num_items = -1 closes the channel. Two float32 items [3, 8] and
  [1, 8] as message 7: [7, 2, 2, 0, 3, 8, 1, 8, 0, ...].
- payload: uint8[nbytes], the items' bytes back to back, row-major. Above: 128 bytes, item 0 =
  payload[0:96].view(float32).view(3, 8), item 1 = payload[96:128].view(float32).view(1, 8).
- ChannelRef(seq, index): what the verifier returns in place of a tensor; opaque to the router.

Why headers go over gloo even between GPUs: a receiver that kept an NCCL recv posted while idle
would keep a kernel pending on the drafter's GPU, and any device-wide synchronize (CUDA graph
capture does one) would wait for the verifier's next message. So the receiver blocks on a CPU
socket and posts the NCCL recv of a payload only once its header says it is in flight.

Failure model: drafter failures never harm the verifier. `send` never blocks (a queue and a
thread); when the peer is gone, a send fails or is still not taken after `send_timeout_s` (seen
by the next `send` or `ready`), the sender logs once, aborts its group (ending any pending
kernel), drops what is queued and says `ready` False from then on: the verifier then returns
the tensors inline, as without a channel.
The receiver keeps at most `capacity` messages (and about `max_bytes`), dropping the oldest
with a log line; `take` of a dropped or late message raises FeatureChannelError, and the
drafter reports that request as unknown so the router resyncs it through the verifier's
ordinary Features call. A restarted drafter does not rejoin (the verifier's sender breaks).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from datetime import timedelta
from urllib.parse import urlparse

import torch
import torch.distributed as dist

log = logging.getLogger("spectandem.channel")

HEADER_LEN = 256
MAX_ITEMS = 64           # per message, and as many shapes as the header holds: 3-D items fit 64
_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32, torch.uint8,
           torch.bool)
# Idle receivers wait on their posted header recv: a group timeout would fire on an idle
# channel, so the groups get none in practice; liveness comes from send_timeout_s.
_GROUP_TIMEOUT = timedelta(days=30)
_CLOSE = -1


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
    """The two ranks' groups: gloo for headers (and payloads between CPU engines, or through
    host memory when both engines share one GPU), NCCL for payloads between two GPUs. Built
    outside torch.distributed's global state, so nothing else in the process (a default group,
    another channel) is touched."""

    def __init__(self, address: str, rank: int, device: torch.device, timeout_s: float):
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
        self.nccl = self._nccl() if device.type == "cuda" and not self._same_gpu() else None
        self.stream = torch.cuda.Stream(device) if self.nccl is not None else None

    def _same_gpu(self) -> bool:
        """Both ends on one GPU (NCCL refuses two ranks there): payloads then go through host
        memory over gloo."""
        uuid = str(getattr(torch.cuda.get_device_properties(self.device), "uuid", "")) or f"pid-{os.getpid()}"
        self.store.set(f"gpu-{self.rank}", uuid)
        same = self.store.get(f"gpu-{self.peer}").decode() == uuid
        if same:
            log.warning("feature channel: both engines are on GPU %s; features go through host memory", uuid)
        return same

    def _nccl(self):
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = _GROUP_TIMEOUT
        # Hazard: by default NCCL's watchdog takes the whole process down when an operation of
        # the group fails (a dead peer). CleanUpOnly (2) aborts the group and leaves the process
        # up; ProcessGroupNCCL reads the setting once, here, so it is set for this group only.
        previous = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING")
        os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
        try:
            return dist.ProcessGroupNCCL(dist.PrefixStore("nccl", self.store), self.rank, 2, opts)
        finally:
            if previous is None:
                del os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
            else:
                os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = previous

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
        """Ends the groups' pending operations (a dead peer's send kernel, a posted recv)."""
        for pg in (self.nccl, self.gloo):
            stop = getattr(pg, "abort", None) if pg is not None else None
            if stop is not None:
                try:
                    stop()
                except Exception as exc:  # already torn down: nothing left to end
                    log.debug("feature channel: abort: %s", exc)


def _header(seq: int, items: list[torch.Tensor]) -> list[int]:
    ndim = items[0].dim() if items else 0
    return [seq, len(items), ndim, _DTYPES.index(items[0].dtype) if items else 0] + [d for t in items for d in t.shape]


# ----------------------------------------------------------------------------------------------
# Sender (the verifier)


@dataclass
class _Outgoing:
    header: list[int]                  # [seq, num_items, ndim, dtype code, shapes...]
    payload: torch.Tensor              # [nbytes] uint8, a snapshot of the items
    ready: "torch.cuda.Event | None"   # recorded on the verifier's stream after the snapshot


class FeatureSender:
    """The verifier's end. `send` is called from the serving thread and never blocks."""

    def __init__(self, address: str, device: str | torch.device, *, connect_timeout_s: float = 600.0,
                 send_timeout_s: float = 5.0, max_queued: int = 256):
        parse_address(address)
        if send_timeout_s <= 0 or max_queued < 1:
            raise ValueError(f"send_timeout_s must be > 0 and max_queued >= 1, got {send_timeout_s}, {max_queued}")
        self.address, self.device = address, _device(device)
        self.connect_timeout_s, self.send_timeout_s, self.max_queued = connect_timeout_s, send_timeout_s, max_queued
        self.state = "connecting"        # -> "up" -> "broken" | "closed"
        self.messages_sent = 0
        self._seq = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._group: _Group | None = None
        self._in_flight: list[tuple[float, object, torch.Tensor]] = []  # NCCL: (posted at, work, payload)
        self._blocked_since: float | None = None   # the thread is in a gloo wait since then
        self._thread = threading.Thread(target=self._run, name="feature-sender", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        self._check_stuck()
        return self.state == "up"

    def send(self, features: list[torch.Tensor | None]) -> list[ChannelRef | None] | None:
        """Queues the non-None tensors (all of one dtype and rank) and returns their refs (None
        stays None); None when the channel is not up: the caller returns the tensors inline."""
        present = [i for i, f in enumerate(features) if f is not None]
        if not self.ready:
            return None
        if not present:
            return [None] * len(features)
        items = [features[i] for i in present]
        if len({(t.dtype, t.dim()) for t in items}) != 1:
            raise ValueError(f"channel items must share dtype and rank, got {[(t.dtype, t.dim()) for t in items]}")
        if items[0].dtype not in _DTYPES:
            raise ValueError(f"dtype {items[0].dtype} cannot cross the feature channel; supported: {_DTYPES}")
        if self._queue.qsize() >= self.max_queued:
            return None           # back-pressure: these go inline
        per_message = min(MAX_ITEMS, (HEADER_LEN - 4) // max(items[0].dim(), 1))
        if per_message < 1:
            raise ValueError(f"{items[0].dim()}-D items do not fit the channel's header of {HEADER_LEN}")
        refs: list[ChannelRef | None] = [None] * len(features)
        for start in range(0, len(items), per_message):
            chunk = items[start:start + per_message]
            with self._lock:
                self._seq += 1
                seq = self._seq
            # A snapshot, taken in the serving thread's stream order: the items may be views of
            # buffers the next forward overwrites (CUDA graph outputs).
            payload = torch.cat([t.detach().reshape(-1) for t in chunk]).to(self.device).view(torch.uint8)
            ready = None
            if self.device.type == "cuda":
                ready = torch.cuda.Event()
                ready.record(torch.cuda.current_stream(self.device))
            self._queue.put(_Outgoing(_header(seq, chunk), payload, ready))
            for j in range(len(chunk)):
                refs[present[start + j]] = ChannelRef(seq, j)
        return refs

    def close(self) -> None:
        """Tells the receiver the channel ends (when up), stops the thread and ends the groups
        (without waiting on the peer)."""
        self._queue.put(None)
        self._thread.join(self.send_timeout_s + 1)
        if self.state != "broken":
            self.state = "closed"
        if self._group is not None and not self._thread.is_alive():
            self._group.abort()

    def _check_stuck(self) -> None:
        """From the caller's thread: a send the peer has not taken for send_timeout_s breaks the
        channel (a drafter alive but no longer receiving)."""
        since = self._blocked_since
        if since is not None and self.state == "up" and time.monotonic() - since > self.send_timeout_s:
            self._break(f"a send was not taken within {self.send_timeout_s} s")

    def _run(self) -> None:
        try:
            self._group = _Group(self.address, 0, self.device, self.connect_timeout_s)
            self._post(_Outgoing(_header(0, [torch.zeros(1, dtype=torch.int64)]), torch.zeros(8, dtype=torch.uint8),
                                 None))
            self._drain(wait=True, timeout_s=self.connect_timeout_s)
        except Exception as exc:
            self._break(f"could not connect to the drafter at {self.address}: {exc}")
            return
        self.state = "up"
        log.info("feature channel to the drafter up at %s (%s)", self.address,
                 "NCCL" if self._group.nccl is not None else "gloo")
        while True:
            try:
                msg = self._queue.get(timeout=0.05)
            except queue.Empty:
                msg = False       # a tick: check what is in flight
            if msg is None:
                break
            if self.state != "up":
                self._in_flight.clear()
                continue          # broken: drop
            try:
                if msg:
                    self._post(msg)
                self._drain(wait=False, timeout_s=self.send_timeout_s)
            except Exception as exc:
                self._break(f"sending failed: {type(exc).__name__}: {exc}")
        if self.state == "up":
            try:
                self._blocked_since = time.monotonic()
                self._group.send_header([0, _CLOSE])
                self._drain(wait=True, timeout_s=self.send_timeout_s)
            except Exception as exc:
                log.debug("feature channel: close: %s", exc)

    def _post(self, msg: _Outgoing) -> None:
        group = self._group
        self._blocked_since = time.monotonic()
        if group.stream is None:
            if msg.ready is not None:   # a CUDA payload staged through host memory
                msg.ready.synchronize()
            group.send_header(msg.header)
            if msg.payload.numel():
                group.send_payload(msg.payload)
        else:
            with torch.cuda.device(self.device), torch.cuda.stream(group.stream):
                if msg.ready is not None:
                    group.stream.wait_event(msg.ready)
                payload = msg.payload.to(self.device)
                # The header first: the receiver posts the payload's recv only once told, and the
                # first NCCL send blocks in the communicator's set-up until the receiver's recv joins.
                group.send_header(msg.header)
                if payload.numel():
                    work = group.send_payload(payload)   # the first one sets up the communicator
                    self._in_flight.append((time.monotonic(), work, payload))
        self._blocked_since = None
        self.messages_sent += msg.header[0] > 0

    def _drain(self, wait: bool, timeout_s: float) -> None:
        """Forgets completed NCCL sends; raises when the oldest is late (the peer is gone)."""
        while self._in_flight:
            posted, work, _ = self._in_flight[0]
            if work.is_completed():
                self._in_flight.pop(0)
                continue
            if time.monotonic() - posted > timeout_s:
                raise FeatureChannelError(f"a send did not complete within {timeout_s} s")
            if not wait:
                return
            time.sleep(0.001)

    def _break(self, why: str) -> None:
        with self._lock:
            if self.state in ("broken", "closed"):
                return
            self.state = "broken"
        log.warning("feature channel to the drafter broken (%s): features go through the router from now on", why)
        if self._group is not None:
            self._group.abort()


# ----------------------------------------------------------------------------------------------
# Receiver (the drafter)


@dataclass
class _Message:
    payload: torch.Tensor              # [nbytes] uint8
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    taken: set = field(default_factory=set)

    def item(self, index: int) -> torch.Tensor:
        size = torch.empty((), dtype=self.dtype).element_size()
        start = sum(math.prod(s) for s in self.shapes[:index]) * size
        shape = self.shapes[index]
        return self.payload[start:start + math.prod(shape) * size].view(self.dtype).view(shape)


class FeatureReceiver:
    """The drafter's end: a thread receives messages in order into a bounded mailbox; `take`
    hands out one request's features."""

    def __init__(self, address: str, device: str | torch.device, *, connect_timeout_s: float = 600.0,
                 take_timeout_s: float = 5.0, capacity: int = 32, max_bytes: int = 1 << 30):
        parse_address(address)
        if capacity < 1 or take_timeout_s < 0:
            raise ValueError(f"capacity must be >= 1 and take_timeout_s >= 0, got {capacity}, {take_timeout_s}")
        self.address, self.device = address, _device(device)
        self.connect_timeout_s, self.take_timeout_s = connect_timeout_s, take_timeout_s
        self.capacity, self.max_bytes = capacity, max_bytes
        self.state = "connecting"        # -> "up" -> "broken" | "closed"
        self.dropped = 0                 # messages evicted before every item was taken
        self._mail: OrderedDict[int, _Message] = OrderedDict()
        self._bytes = 0
        self._last_seq = 0
        self._cond = threading.Condition()
        self._group: _Group | None = None
        self._thread = threading.Thread(target=self._run, name="feature-receiver", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "up"

    def take(self, ref: ChannelRef, timeout_s: float | None = None) -> torch.Tensor:
        """The features behind `ref` (a view of the message's payload, on this side's device);
        waits up to `timeout_s` (default take_timeout_s) for a message not yet here."""
        deadline = time.monotonic() + (self.take_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while True:
                msg = self._mail.get(ref.seq)
                if msg is not None:
                    return self._hand_out(ref, msg)
                if ref.seq <= self._last_seq:
                    raise FeatureChannelError(f"features of channel message {ref.seq} were dropped (the mailbox "
                                              f"holds {self.capacity} messages) or already taken")
                if self.state in ("broken", "closed"):
                    raise FeatureChannelError(f"the feature channel is {self.state}; message {ref.seq} never came")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FeatureChannelError(f"features of channel message {ref.seq} did not arrive within "
                                              f"{self.take_timeout_s if timeout_s is None else timeout_s} s")
                self._cond.wait(remaining)

    def close(self) -> None:
        """Stops taking messages. The thread ends with the next header (or the process): gloo
        cannot always interrupt a posted recv; the verifier's sender then breaks on its payload."""
        with self._cond:
            if self.state != "broken":
                self.state = "closed"
            self._cond.notify_all()
        if self._thread.is_alive() and self._group is not None:
            self._group.abort()
        self._thread.join(0.5)

    def _hand_out(self, ref: ChannelRef, msg: _Message) -> torch.Tensor:
        if not 0 <= ref.index < len(msg.shapes):
            raise FeatureChannelError(f"channel message {ref.seq} has {len(msg.shapes)} items, not {ref.index + 1}")
        if ref.index in msg.taken:
            raise FeatureChannelError(f"item {ref.index} of channel message {ref.seq} was already taken")
        out = msg.item(ref.index)
        if out.is_cuda:
            # The payload was allocated on the receiver's stream: keep its memory from being
            # reused there while the taker's stream still reads it.
            out.record_stream(torch.cuda.current_stream(out.device))
        msg.taken.add(ref.index)
        if len(msg.taken) == len(msg.shapes):
            del self._mail[ref.seq]
            self._bytes -= msg.payload.numel()
        return out

    def _run(self) -> None:
        try:
            self._group = _Group(self.address, 1, self.device, self.connect_timeout_s)
            if self._group.stream is not None:
                torch.cuda.set_device(self.device)
            stream = self._group.stream
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                while True:
                    header = self._group.recv_header()
                    seq, num_items, ndim, code = header[:4]
                    if num_items == _CLOSE or self.state == "closed":
                        break
                    shapes = [tuple(header[4 + i * ndim:4 + (i + 1) * ndim]) for i in range(num_items)]
                    dtype = _DTYPES[code]
                    nbytes = sum(math.prod(s) for s in shapes) * torch.empty((), dtype=dtype).element_size()
                    payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                    if nbytes:
                        self._group.recv_payload(payload)
                    if seq == 0:   # the handshake
                        self._set_state("up")
                        log.info("feature channel from the verifier up at %s", self.address)
                        continue
                    self._store(seq, _Message(payload, shapes, dtype))
            self._set_state("closed")
        except Exception as exc:
            if self.state != "closed":
                log.warning("feature channel from the verifier broken (%s: %s): features of later rounds are "
                            "resynced through the router", type(exc).__name__, exc)
            self._set_state("broken")

    def _set_state(self, state: str) -> None:
        with self._cond:
            if self.state not in ("broken", "closed"):
                self.state = state
            self._cond.notify_all()

    def _store(self, seq: int, msg: _Message) -> None:
        with self._cond:
            self._mail[seq] = msg
            self._bytes += msg.payload.numel()
            self._last_seq = seq
            # Bounded: the oldest go first, the newest message always stays.
            while len(self._mail) > self.capacity or (self._bytes > self.max_bytes and len(self._mail) > 1):
                old_seq, old = self._mail.popitem(last=False)
                self._bytes -= old.payload.numel()
                self.dropped += 1
                # Items of requests that finished in their round are never taken: routine.
                level = logging.INFO if not old.taken else logging.DEBUG
                log.log(level, "feature mailbox full: dropped message %d (%d of %d items untaken)", old_seq,
                        len(old.shapes) - len(old.taken), len(old.shapes))
            self._cond.notify_all()
