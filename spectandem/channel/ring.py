"""A ring of payload slots shared by the channel's two ends when both are on one device (one GPU,
or the host's memory between CPU engines): the verifier writes a message's items into the next
free slot, the header (over gloo) names the slot, the drafter copies the bytes out and releases
the slot. No payload crosses a socket or host memory.

Memory: a control block in host shared memory (a file under /dev/shm, mapped by both):
int64[1 + slots] = [released, tag of slot 0, tag of slot 1, ...], and the slots themselves,
`slots` x `slot_bytes`, behind it (CPU) or in one CUDA allocation shared by CUDA IPC (GPU, with
one interprocess event per slot recorded after the slot's write).

Protocol:
- the writer takes slots in order, the n-th ring message slot n % slots, only while fewer than
  `slots` messages are written and not yet released (`free`);
- before writing a slot it sets the slot's tag to the message's seq, then writes the bytes;
- the reader checks the tag before copying out and again once the copy is complete: a slot
  whose tag is not the header's seq was overwritten (a late read), so the message raises
  FeatureChannelError instead of handing out bytes of another message;
- the reader then releases the slot (`released` += 1), in order, the one writer of that field.
"""

from __future__ import annotations

import base64
import contextlib
import json
import mmap
import os
import secrets
import tempfile
from dataclasses import dataclass

import torch

from spectandem.channel.wire import FeatureChannelError, log

_ALIGN = 256   # slot starts and sizes: every dtype's alignment, and CUDA's copy alignment


def _shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


@dataclass(frozen=True)
class RingSpec:
    """What the reader needs to map the writer's ring (JSON through the rendezvous store: no
    pickles from a socket)."""

    path: str                          # the control block's file (and the CPU slots')
    slots: int
    slot_bytes: int
    device_type: str
    cuda_storage: tuple | None = None  # UntypedStorage._share_cuda_() of the slots (CUDA)
    cuda_events: tuple = ()            # one interprocess event's ipc_handle() per slot (CUDA)

    def to_bytes(self) -> bytes:
        return json.dumps({"path": self.path, "slots": self.slots, "slot_bytes": self.slot_bytes,
                           "device_type": self.device_type,
                           "cuda_storage": None if self.cuda_storage is None else [_enc(v) for v in self.cuda_storage],
                           "cuda_events": [_enc(h) for h in self.cuda_events]}).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "RingSpec":
        d = json.loads(raw)
        storage = d["cuda_storage"]
        return cls(d["path"], int(d["slots"]), int(d["slot_bytes"]), d["device_type"],
                   None if storage is None else tuple(_dec(v) for v in storage),
                   tuple(_dec(h) for h in d["cuda_events"]))


def _enc(value):
    return {"b64": base64.b64encode(value).decode()} if isinstance(value, bytes) else value


def _dec(value):
    return base64.b64decode(value["b64"]) if isinstance(value, dict) else value


class PayloadRing:
    """One end of the ring: `create` on the writer (the verifier), `attach` on the reader."""

    def __init__(self, spec: RingSpec, fd: int, device: torch.device, data: torch.Tensor | None,
                 events: list, owner: bool):
        self.spec, self.device, self.owner = spec, device, owner
        self.slots, self.slot_bytes = spec.slots, spec.slot_bytes
        control_bytes = _control_bytes(spec.slots)
        host_bytes = control_bytes + (spec.slots * spec.slot_bytes if spec.device_type == "cpu" else 0)
        self._map = mmap.mmap(fd, host_bytes)
        os.close(fd)
        host = torch.frombuffer(self._map, dtype=torch.uint8)
        self.control = host[:control_bytes].view(torch.int64)
        self.data = host[control_bytes:] if data is None else data
        self.events = events
        self.written = 0                   # writer: ring messages written
        self.read_count = 0                # reader: ring messages released
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" and not owner else None

    @classmethod
    def create(cls, device: torch.device, slots: int, slot_bytes: int) -> "PayloadRing":
        """The writer's ring: slots of `slot_bytes` (rounded up to the alignment) on `device`."""
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"a payload ring needs slots >= 1 and slot_bytes >= 1, got {slots}, {slot_bytes}")
        slot_bytes = -(-slot_bytes // _ALIGN) * _ALIGN
        path = os.path.join(_shm_dir(), f"spectandem-ring-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, _control_bytes(slots) + (slots * slot_bytes if device.type == "cpu" else 0))
            data, events, storage, handles = None, [], None, ()
            if device.type == "cuda":
                with torch.cuda.device(device):
                    data = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=device)
                    storage = data.untyped_storage()._share_cuda_()
                    events = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
                    handles = tuple(e.ipc_handle() for e in events)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        spec = RingSpec(path, slots, slot_bytes, device.type, storage, handles)
        return cls(spec, fd, device, data, events, owner=True)

    @classmethod
    def attach(cls, spec: RingSpec, device: torch.device) -> "PayloadRing":
        """The reader's end of the ring `spec` describes, on `device` (the writer's device)."""
        if spec.device_type != device.type:
            raise FeatureChannelError(f"the payload ring is on {spec.device_type}, this end on {device.type}")
        fd = os.open(spec.path, os.O_RDWR)
        data, events = None, []
        try:
            if device.type == "cuda":
                with torch.cuda.device(device):
                    # The allocation the writer shared, opened on this process's index of the same GPU.
                    storage = torch.UntypedStorage._new_shared_cuda(device.index, *spec.cuda_storage[1:])
                    data = torch.empty(0, dtype=torch.uint8, device=device).set_(storage)
                    events = [torch.cuda.Event.from_ipc_handle(device, h) for h in spec.cuda_events]
        except BaseException:
            os.close(fd)
            raise
        return cls(spec, fd, device, data, events, owner=False)

    def unlink(self) -> None:
        """Removes the control block's name (both ends keep their mappings)."""
        if self.owner:
            try:
                os.unlink(self.spec.path)
            except FileNotFoundError:
                pass

    def export(self) -> bytes:
        return self.spec.to_bytes()

    # --- the writer ---------------------------------------------------------------------------

    def fits(self, nbytes: int) -> bool:
        return nbytes <= self.slot_bytes

    def free(self) -> int:
        """Slots the writer may take now."""
        return self.slots - (self.written - int(self.control[0]))

    def write(self, seq: int, items: list[torch.Tensor]) -> int:
        """Writes `items` (one dtype) back to back into the next slot, tagged `seq`, in the current
        stream's order (CUDA: the slot's event is recorded after); -> the slot."""
        nbytes = sum(t.numel() * t.element_size() for t in items)
        if not self.fits(nbytes) or self.free() < 1:
            raise FeatureChannelError(f"no free ring slot of {self.slot_bytes} bytes for {nbytes} bytes "
                                      f"({self.free()} of {self.slots} free)")
        slot = self.written % self.slots
        self.control[1 + slot] = seq                # the tag first: a reader still on the slot sees it change
        start = slot * self.slot_bytes
        if items:   # one copy for all of them (a verify's items are many small rows)
            dst = self.data[start:start + nbytes].view(items[0].dtype)
            torch.cat([t.reshape(-1) for t in items], out=dst)
        if self.events:
            self.events[slot].record(torch.cuda.current_stream(self.device))
        self.written += 1
        return slot

    # --- the reader ---------------------------------------------------------------------------

    def read(self, seq: int, slot: int, nbytes: int) -> torch.Tensor:
        """A copy of the first `nbytes` of `slot`, which holds message `seq`, complete when this
        returns (`read_queued` on the reader's own stream, waited for without spinning a CPU
        core); FeatureChannelError if the slot holds another message (before or during the
        copy). Does not release the slot."""
        with torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext():
            out, done = self.read_queued(seq, slot, nbytes)
        if done is not None:
            done.synchronize()
            self._check_tag(seq, slot)
        return out

    def read_queued(self, seq: int, slot: int, nbytes: int):
        """A copy of the first `nbytes` of `slot`, which holds message `seq` and whose write has
        been recorded, queued on the caller's stream (CUDA: no wait here; the caller's later work
        on that stream sees the bytes) -> (the copy, an event recorded after it; None on the
        CPU, where the copy is done). FeatureChannelError if the slot holds another message. The
        slot must not be released before the event completes."""
        if not 0 <= slot < self.slots or nbytes > self.slot_bytes:
            raise FeatureChannelError(f"ring slot {slot} of {self.slots} ({nbytes} bytes) is out of range")
        self._check_tag(seq, slot)
        start = slot * self.slot_bytes
        if self.device.type != "cuda":
            out = self.data[start:start + nbytes].clone()
            self._check_tag(seq, slot)
            return out, None
        stream = torch.cuda.current_stream(self.device)
        stream.wait_event(self.events[slot])
        out = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        out.copy_(self.data[start:start + nbytes])
        done = torch.cuda.Event(blocking=True)   # waited for off the taker's path, without spinning a core
        done.record(stream)
        return out, done

    def release(self) -> None:
        """The oldest unreleased slot may be written again."""
        self.read_count += 1
        self.control[0] = self.read_count

    def _check_tag(self, seq: int, slot: int) -> None:
        tag = int(self.control[1 + slot])
        if tag != seq:
            raise FeatureChannelError(f"ring slot {slot} holds message {tag}, not {seq}: message {seq} was "
                                      f"overwritten before it was read")

    def close(self) -> None:
        self.unlink()
        self.control = self.data = None
        self.events = []
        try:
            self._map.close()
        except BufferError:   # a view is still alive somewhere: the mapping goes with it
            log.debug("feature channel: ring mapping still in use at close")


def _control_bytes(slots: int) -> int:
    return -(-(1 + slots) * 8 // _ALIGN) * _ALIGN
