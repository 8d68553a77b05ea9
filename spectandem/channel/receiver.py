"""The drafter's end of the feature channel (spectandem/channel/__init__.py)."""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from spectandem.call_clock import CallClock, timed
from spectandem.channel.wire import (_CLOSE, _DTYPES, NO_SLOT, SHAPES_AT, ChannelRef, FeatureChannelError, _device, _Group,
                                     header_shapes, parse_address)

log = logging.getLogger("spectandem.channel")

# ----------------------------------------------------------------------------------------------
# Receiver (the drafter)


@dataclass
class _Message:
    payload: torch.Tensor              # [nbytes] uint8
    shapes: list[tuple[int, ...]]
    dtype: torch.dtype
    taken: set = field(default_factory=set)
    streams: set = field(default_factory=set)   # CUDA streams the payload's use was recorded on

    def __post_init__(self):
        # Each item's start (in elements) once, and the payload as its dtype: taking an item of
        # a message of 64 is then one slice and one view.
        self.typed = self.payload.view(self.dtype)
        self.starts = [0]
        for s in self.shapes:
            self.starts.append(self.starts[-1] + math.prod(s))
        self._rows: tuple[torch.Tensor, ...] | None = None

    def item(self, index: int) -> torch.Tensor:
        return self.typed[self.starts[index]:self.starts[index + 1]].view(self.shapes[index])

    def items(self, indices: list[int]) -> list[torch.Tensor]:
        """`item` of each of `indices`. Where every item is rows of one shape (a round's
        features: [tokens, width]), the payload is split into them once, in one call, rather than
        sliced and viewed item by item."""
        if self._rows is None:
            rest = {s[1:] for s in self.shapes}
            row = rest.pop() if len(rest) == 1 and all(self.shapes) else None
            self._rows = () if row is None or math.prod(row) == 0 or len(self.shapes) < 2 else torch.split(
                self.typed[:self.starts[-1]].view(-1, *row), [s[0] for s in self.shapes])
        if not self._rows:
            return [self.item(i) for i in indices]
        return [self._rows[i] for i in indices]


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
        self.lost = 0                    # ring messages overwritten before they were read
        self._mail: OrderedDict[int, _Message] = OrderedDict()
        self._bytes = 0
        self._last_seq = 0
        # Messages whose ring slots the drafter was told ahead of their headers (`expect`), and
        # those of them `take` already copied out (their headers then only release the slots).
        self._placed: OrderedDict[int, tuple[int, torch.dtype, list[tuple[int, ...]]]] = OrderedDict()
        # seq -> None while `take` copies it out, then what says the copy is done (on CUDA the
        # event recorded after it, on the CPU True): the header waits for it before releasing the slot.
        self._early: dict[int, object] = {}
        self.early_reads = 0             # messages copied out of the ring by `take` itself
        self._cond = threading.Condition()
        self._group: _Group | None = None
        self._thread = threading.Thread(target=self._run, name="feature-receiver", daemon=True)
        self._thread.start()

    @property
    def ready(self) -> bool:
        return self.state == "up"

    def expect(self, placements: dict[int, tuple[int, int, list[tuple[int, ...]]]]) -> None:
        """Where messages lie in the payload ring, told ahead of their headers (a round's verdicts
        over the tree channel; FeatureSender.placement): seq -> (slot, dtype code, item shapes).
        `take` of such a message, not yet here, copies it straight out of its slot rather than
        waiting for this end's thread to receive its header. Without a ring, nothing changes."""
        if self.state != "up" or self._group is None or self._group.ring is None:
            return
        with self._cond:
            for seq, (slot, code, shapes) in placements.items():
                if seq > self._last_seq and seq not in self._mail:
                    self._placed[seq] = (slot, _DTYPES[code], shapes)
            while len(self._placed) > self.capacity:
                self._placed.popitem(last=False)

    def take(self, ref: ChannelRef, timeout_s: float | None = None, clock: CallClock | None = None,
             kind: str = "features") -> torch.Tensor:
        """The features behind `ref` (a view of the message's payload, on this side's device);
        waits up to `timeout_s` (default take_timeout_s) for a message not yet here. `clock`:
        the waits for the message are timed as "<kind>.wait", its copy out of the ring ahead of its
        header as "<kind>.early_read"."""
        deadline = time.monotonic() + (self.take_timeout_s if timeout_s is None else timeout_s)
        with self._cond:
            while True:
                msg = self._mail.get(ref.seq)
                if msg is not None:
                    return self._hand_out([ref], msg)[0]
                if ref.seq <= self._last_seq:
                    raise FeatureChannelError(f"features of channel message {ref.seq} were dropped (the mailbox "
                                              f"holds {self.capacity} messages), overwritten in the payload "
                                              f"ring or already taken")
                if self.state in ("broken", "closed"):
                    raise FeatureChannelError(f"the feature channel is {self.state}; message {ref.seq} never came")
                placed = self._placed.pop(ref.seq, None)
                if placed is not None:
                    self._early[ref.seq] = None    # copying it out: its header waits for that
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise FeatureChannelError(f"features of channel message {ref.seq} did not arrive within "
                                              f"{self.take_timeout_s if timeout_s is None else timeout_s} s")
                with timed(clock, f"{kind}.wait"):
                    self._cond.wait(remaining)
        with timed(clock, f"{kind}.early_read"):
            msg, done = self._read_early(ref.seq, *placed)
        with self._cond:
            if msg is None:                 # no longer in its slot: the header's copy is the one
                del self._early[ref.seq]
                self._cond.notify_all()
            else:
                self._early[ref.seq] = True if done is None else done
                self.early_reads += 1
                self._keep(ref.seq, msg)
                self._cond.notify_all()
                return self._hand_out([ref], msg)[0]
        return self.take(ref, max(0.0, deadline - time.monotonic()), clock, kind)

    def take_message(self, refs: list[ChannelRef], timeout_s: float | None = None, clock: CallClock | None = None,
                     kind: str = "features") -> list[torch.Tensor]:
        """`take` of each of `refs`, all items of one message, the lock taken once for the lot
        rather than once per item: a round's catch-up of 64 requests is one message. Raises
        FeatureChannelError where a `take` of one of them would. `clock`: as `take`'s, and the
        other items' hand-out as "<kind>.hand_out"."""
        if len({r.seq for r in refs}) > 1:
            raise ValueError(f"take_message takes the items of one message, got messages {sorted({r.seq for r in refs})}")
        if not refs:
            return []
        out = [self.take(refs[0], timeout_s, clock, kind)]   # waits for the message: the rest are in it then
        rest = refs[1:]
        if not rest:
            return out
        with timed(clock, f"{kind}.hand_out"), self._cond:
            msg = self._mail.get(refs[0].seq)
            if msg is None:
                raise FeatureChannelError(f"item {rest[0].index} of channel message {rest[0].seq}: the message "
                                          f"left the mailbox (every item taken, or dropped)")
            out += self._hand_out(rest, msg)
        return out

    def _read_early(self, seq: int, slot: int, dtype: torch.dtype, shapes: list[tuple[int, ...]]):
        """Message `seq` copied out of its ring slot by the taker, ahead of its header, queued on
        the taker's stream -> (the message, the copy's event or None); (None, None) where the
        slot no longer holds it. This end's thread releases the slot, in order, once the header
        has come and the copy is done."""
        nbytes = _nbytes(shapes, dtype)
        try:
            payload, done = self._group.ring.read_queued(seq, slot, nbytes)
        except FeatureChannelError as exc:
            log.debug("feature channel: early read of message %d: %s", seq, exc)
            return None, None
        return _Message(payload, shapes, dtype), done

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

    def _hand_out(self, refs: list[ChannelRef], msg: _Message) -> list[torch.Tensor]:
        """Items `refs` of `msg` (refs of that one message; the caller holds the lock), all or
        none: an index out of range or taken already (before, or twice here) raises."""
        indices = [r.index for r in refs]
        seen: set[int] = set()
        for ref, i in zip(refs, indices):
            if not 0 <= i < len(msg.shapes):
                raise FeatureChannelError(f"channel message {ref.seq} has {len(msg.shapes)} items, not {i + 1}")
            if i in msg.taken or i in seen:
                raise FeatureChannelError(f"item {i} of channel message {ref.seq} was already taken")
            seen.add(i)
        out = msg.items(indices)
        if out and out[0].is_cuda:
            # The payload was allocated on the receiver's stream: keep its memory from being
            # reused there while the taker's stream still reads it (once per stream: the items
            # share the payload's memory).
            stream = torch.cuda.current_stream(out[0].device)
            if stream not in msg.streams:
                out[0].record_stream(stream)
                msg.streams.add(stream)
        msg.taken.update(indices)
        if len(msg.taken) == len(msg.shapes):
            del self._mail[refs[0].seq]
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
                    seq, num_items, ndim, code, slot = header[:SHAPES_AT]
                    if num_items == _CLOSE or self.state == "closed":
                        break
                    if self._read_already(seq, slot):
                        continue
                    shapes = header_shapes(header)
                    dtype = _DTYPES[code]
                    nbytes = _nbytes(shapes, dtype)
                    if slot != NO_SLOT:
                        payload = self._from_ring(seq, slot, nbytes)
                        if payload is None:
                            continue
                    else:
                        payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
                        if nbytes:
                            self._group.recv_payload(payload)
                    if seq == 0:   # the handshake
                        self._set_state("up")
                        log.info("feature channel from the verifier up at %s (payloads: %s)", self.address,
                                 self._group.transport)
                        continue
                    self._store(seq, _Message(payload, shapes, dtype))
            self._set_state("closed")
        except Exception as exc:
            if self.state != "closed":
                log.warning("feature channel from the verifier broken (%s: %s): features of later rounds are "
                            "resynced through the router", type(exc).__name__, exc)
            self._set_state("broken")
        finally:
            if self._group is not None and self._group.ring is not None:
                self._group.ring.close()

    def _from_ring(self, seq: int, slot: int, nbytes: int) -> torch.Tensor | None:
        """Message `seq`'s payload copied out of its ring slot, which is then released; None when
        the slot was overwritten first (its refs then raise FeatureChannelError, as dropped ones)."""
        ring = self._group.ring
        if ring is None:
            raise FeatureChannelError(f"message {seq} is in ring slot {slot}, but this end has no ring")
        try:
            return ring.read(seq, slot, nbytes)
        except FeatureChannelError as exc:
            with self._cond:
                self.lost += 1
                self._last_seq = max(self._last_seq, seq)
                self._cond.notify_all()
            log.warning("feature channel: %s", exc)
            return None
        finally:
            ring.release()

    def _set_state(self, state: str) -> None:
        with self._cond:
            if self.state not in ("broken", "closed"):
                self.state = state
            self._cond.notify_all()

    def _read_already(self, seq: int, slot: int) -> bool:
        """For the header of message `seq`: whether `take` copied it out of its slot ahead of the
        header (then, once that copy is done, the slot is released here, in the ring's order,
        and the message kept as it is). No `take` starts copying it once this has run."""
        with self._cond:
            self._placed.pop(seq, None)
            while seq in self._early and self._early[seq] is None:   # a take is copying it out
                self._cond.wait()
            if seq not in self._early:
                return False
            done = self._early.pop(seq)
            self._last_seq = max(self._last_seq, seq)
            self._cond.notify_all()
        if slot != NO_SLOT:
            if done is not True:
                done.synchronize()
            self._group.ring.release()
        return True

    def _store(self, seq: int, msg: _Message) -> None:
        with self._cond:
            self._last_seq = seq
            self._keep(seq, msg)
            self._cond.notify_all()

    def _keep(self, seq: int, msg: _Message) -> None:
        """Into the mailbox (the caller holds the lock). Bounded: the oldest go first, the newest
        message always stays."""
        self._mail[seq] = msg
        self._bytes += msg.payload.numel()
        while len(self._mail) > self.capacity or (self._bytes > self.max_bytes and len(self._mail) > 1):
            old_seq, old = self._mail.popitem(last=False)
            self._bytes -= old.payload.numel()
            self.dropped += 1
            # Routine: the last round's features of requests that ended are never taken. A
            # drop that matters shows where its features are taken (a warning, and a resync).
            log.debug("feature mailbox full: dropped message %d (%d of %d items untaken)", old_seq,
                      len(old.shapes) - len(old.taken), len(old.shapes))


def _nbytes(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> int:
    """A message's payload size: its items' elements, of `dtype`."""
    return sum(math.prod(s) for s in shapes) * dtype.itemsize
