"""The verifier's end of the feature channel (spectandem/channel/__init__.py)."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import torch

from spectandem.channel.wire import (_CLOSE, _DTYPES, HEADER_LEN, MAX_ITEMS, SHAPES_AT, ChannelRef,
                                     FeatureChannelError, _device, _Group, _header, header_shapes, parse_address)

log = logging.getLogger("spectandem.channel")

PLACED_KEPT = 256   # ring placements the sender remembers (`placement`)

# ----------------------------------------------------------------------------------------------
# Sender (the verifier)


@dataclass
class _Outgoing:
    header: list[int]                  # [seq, num_items, ndim, dtype code, ring slot, shapes...]
    payload: torch.Tensor | None       # [nbytes] uint8, a snapshot of the items (None: in a ring slot)
    ready: "torch.cuda.Event | None"   # recorded on the verifier's stream after the snapshot
    for_ring: bool = False             # the snapshot goes into the next ring slot freed (FeatureSender._to_ring)


class FeatureSender:
    """The verifier's end. `send` is called from the serving thread and never blocks.

    ring_slots, slot_bytes: the payload ring offered when both ends are on one device (ring.py;
    0 slots: none). A message that fits a slot goes there: into a free one at once, or, where
    every slot is still unread (a round carrying many new prompts' features), as a snapshot on
    its device that this end's thread writes into the next slot the drafter frees. Only a
    message larger than a slot goes over the group (through host memory on one device)."""

    def __init__(self, address: str, device: str | torch.device, *, connect_timeout_s: float = 600.0,
                 send_timeout_s: float = 5.0, max_queued: int = 256, ring_slots: int = 4,
                 slot_bytes: int = 16 << 20, later: Callable[[Callable[[], None]], None] | None = None):
        parse_address(address)
        if send_timeout_s <= 0 or max_queued < 1:
            raise ValueError(f"send_timeout_s must be > 0 and max_queued >= 1, got {send_timeout_s}, {max_queued}")
        if ring_slots < 0 or slot_bytes < 1:
            raise ValueError(f"ring_slots must be >= 0 and slot_bytes >= 1, got {ring_slots}, {slot_bytes}")
        self.ring_slots, self.slot_bytes = ring_slots, slot_bytes
        self.later = later
        self.address, self.device = address, _device(device)
        self.connect_timeout_s, self.send_timeout_s, self.max_queued = connect_timeout_s, send_timeout_s, max_queued
        self.state = "connecting"        # -> "up" -> "broken" | "closed"
        self.messages_sent = 0
        # Messages written into a ring slot, and those that went over the group (larger than a
        # slot): the verifier's info reports both.
        self.ring_messages = self.group_messages = 0
        self._ring_waiting = 0           # snapshots queued for a ring slot: later messages queue behind them
        self._ring_stream = None         # this end's thread's stream for their writes (CUDA)
        self._seq = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._group: _Group | None = None
        self._in_flight: list[tuple[float, object, torch.Tensor]] = []  # NCCL: (posted at, work, payload)
        self._blocked_since: float | None = None   # the thread is in a gloo wait since then
        # Where the last ring messages lie (seq -> slot, dtype code, item shapes), for `placement`.
        self._placed: OrderedDict[int, tuple[int, int, list[tuple[int, ...]]]] = OrderedDict()
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
        per_message = min(MAX_ITEMS, (HEADER_LEN - SHAPES_AT) // max(items[0].dim(), 1))
        if per_message < 1:
            raise ValueError(f"{items[0].dim()}-D items do not fit the channel's header of {HEADER_LEN}")
        ring = self._group.ring
        refs: list[ChannelRef | None] = [None] * len(features)
        chunks = _chunks(items, per_message, ring.slot_bytes if ring is not None else 0)
        with self._lock:   # the messages' seqs, in a row
            first = self._seq + 1
            self._seq += len(chunks)
        messages = [(first + m, [t.detach() for t in chunk]) for m, chunk in enumerate(chunks)]
        start = 0
        for seq, chunk in messages:
            for j in range(len(chunk)):
                refs[present[start + j]] = ChannelRef(seq, j)
            start += len(chunk)
        if self.later is not None:
            self.later(lambda: self._write(messages))
        else:
            self._write(messages)
        return refs

    def _write(self, messages: list[tuple[int, list[torch.Tensor]]]) -> None:
        """Copies each message's items into a ring slot, or a snapshot of its own, and queues it,
        in seq order. The items may be views of buffers the next forward overwrites (CUDA graph
        outputs): this runs before that forward is queued, in the same stream (`later`: the
        service's AfterReply, whose next call waits for it)."""
        ring = self._group.ring
        for seq, chunk in messages:
            with self._lock:   # messages enter the queue (and the ring) in seq order
                fits = ring is not None and ring.fits(_nbytes(chunk))
                if fits and not self._ring_waiting and ring.free() > 0:
                    slot = ring.write(seq, chunk)
                    msg = _Outgoing(_header(seq, chunk, slot), None, None)
                    self._placed_at(seq, slot, _DTYPES.index(chunk[0].dtype), [tuple(t.shape) for t in chunk])
                else:
                    msg = self._snapshot(seq, chunk)
                    msg.for_ring = fits
                    self._ring_waiting += fits
                    self.group_messages += not fits
                self._queue.put(msg)

    def _placed_at(self, seq: int, slot: int, code: int, shapes: list[tuple[int, ...]]) -> None:
        """Message `seq` (items of dtype code `code`) is written into ring slot `slot` (the caller
        holds the lock)."""
        self.ring_messages += 1
        self._placed[seq] = (slot, code, shapes)
        while len(self._placed) > PLACED_KEPT:
            self._placed.popitem(last=False)

    def placement(self, seq: int) -> tuple[int, int, list[tuple[int, ...]]] | None:
        """Where message `seq` was written in the payload ring: (its slot, the items' dtype code,
        their shapes); None where it went over the group, is not yet written or is long past.
        The drafter, told this ahead of the message's header (a verdict on the tree channel),
        copies the features straight out of the slot (FeatureReceiver.expect)."""
        with self._lock:
            return self._placed.get(seq)

    def _snapshot(self, seq: int, chunk: list[torch.Tensor]) -> _Outgoing:
        payload = torch.cat([t.detach().reshape(-1) for t in chunk]).to(self.device).view(torch.uint8)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        return _Outgoing(_header(seq, chunk), payload, ready)

    def close(self) -> None:
        """Tells the receiver the channel ends (when up), stops the thread and ends the groups
        (without waiting on the peer)."""
        self._queue.put(None)
        self._thread.join(self.send_timeout_s + 1)
        if self.state != "broken":
            self.state = "closed"
        if self._group is not None and not self._thread.is_alive():
            self._group.abort()
            if self._group.ring is not None:
                self._group.ring.close()   # the drafter keeps its own mapping

    def _check_stuck(self) -> None:
        """From the caller's thread: a send the peer has not taken for send_timeout_s breaks the
        channel (a drafter alive but no longer receiving)."""
        since = self._blocked_since
        if since is not None and self.state == "up" and time.monotonic() - since > self.send_timeout_s:
            self._break(f"a send was not taken within {self.send_timeout_s} s")

    def _run(self) -> None:
        try:
            self._group = _Group(self.address, 0, self.device, self.connect_timeout_s,
                                 ring=(self.ring_slots, self.slot_bytes))
            self._post(_Outgoing(_header(0, [torch.zeros(1, dtype=torch.int64)]), torch.zeros(8, dtype=torch.uint8),
                                 None))
            self._drain(wait=True, timeout_s=self.connect_timeout_s)
        except Exception as exc:
            self._break(f"could not connect to the drafter at {self.address}: {exc}")
            return
        self.state = "up"
        log.info("feature channel to the drafter up at %s (payloads: %s)", self.address, self._group.transport)
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
        if msg.for_ring:
            self._to_ring(msg)
        if msg.payload is None:         # in a ring slot: the header names it
            group.send_header(msg.header)
        elif group.nccl is None:
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

    def _to_ring(self, msg: _Outgoing) -> None:
        """Writes a snapshot that found every ring slot unread into the next slot the drafter
        frees (its thread releases each slot once it has copied the message out), on this
        thread's own stream after the snapshot; the header then names the slot. Waiting longer
        than send_timeout_s (measured from `_blocked_since`: a drafter no longer reading) breaks
        the channel, as a send the peer does not take does."""
        ring = self._group.ring
        while ring.free() < 1:
            if self.state != "up" or time.monotonic() - self._blocked_since > self.send_timeout_s:
                raise FeatureChannelError(f"no ring slot was freed within {self.send_timeout_s} s")
            time.sleep(0.0001)
        seq, code = msg.header[0], msg.header[3]
        with self._lock:
            if self.device.type == "cuda":
                if self._ring_stream is None:
                    self._ring_stream = torch.cuda.Stream(self.device)
                with torch.cuda.device(self.device), torch.cuda.stream(self._ring_stream):
                    self._ring_stream.wait_event(msg.ready)
                    slot = ring.write(seq, [msg.payload])
                    # The snapshot was allocated on the serving stream: not reused there before this copy.
                    msg.payload.record_stream(self._ring_stream)
            else:
                slot = ring.write(seq, [msg.payload])
            self._placed_at(seq, slot, code, header_shapes(msg.header))
            self._ring_waiting -= 1
        msg.header[SHAPES_AT - 1] = slot
        msg.payload = msg.ready = None

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


def _nbytes(items: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in items)


def _chunks(items: list[torch.Tensor], per_message: int, slot_bytes: int) -> list[list[torch.Tensor]]:
    """Messages of at most `per_message` items and, with a ring (slot_bytes > 0), of at most one
    slot's bytes where the items allow (an item larger than a slot is a message of its own)."""
    out: list[list[torch.Tensor]] = []
    size = 0
    for t in items:
        n = t.numel() * t.element_size()
        if not out or len(out[-1]) >= per_message or (slot_bytes and size + n > slot_bytes):
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return out
