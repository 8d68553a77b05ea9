"""The feature channel's payload ring (spectandem/channel/ring.py) on CPU shared memory:

- the ring alone: slots taken in order and reused once released, a full ring refuses a write,
  a slot overwritten before its read raises FeatureChannelError (never another message's bytes);
- the channel between two real processes (multiprocessing spawn): messages of several dtypes
  arrive whole through the ring, slots reused many times, messages sent while every slot is
  unread wait for a freed slot, messages larger than a slot go over gloo, both ways in one
  stream; a drafter that stops reading breaks the channel; the ring's file is gone from
  /dev/shm once both ends map it; closing the sender closes the receiver;
- a drafter that cannot map the ring: payloads go over gloo, the features still right.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import threading
import time

import pytest
import torch

from spectandem.channel import ChannelRef, FeatureChannelError, FeatureReceiver, FeatureSender
from spectandem.channel.ring import PayloadRing, RingSpec

CPU = torch.device("cpu")


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _wait(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def ring():
    writer = PayloadRing.create(CPU, 3, 64)
    reader = PayloadRing.attach(RingSpec.from_bytes(writer.export()), CPU)
    yield writer, reader
    reader.close()
    writer.close()


def test_slots_are_taken_in_order_and_reused_once_released(ring):
    writer, reader = ring
    assert writer.slot_bytes == 256    # rounded up to the alignment
    for seq in range(1, 11):           # 10 messages through 3 slots
        items = [torch.full((2, 3), float(seq)), torch.arange(seq, dtype=torch.float32)]
        slot = writer.write(seq, items)
        assert slot == (seq - 1) % 3
        nbytes = (6 + seq) * 4
        got = reader.read(seq, slot, nbytes).view(torch.float32)
        assert torch.equal(got[:6].view(2, 3), items[0]) and torch.equal(got[6:], items[1])
        reader.release()
        assert writer.free() == 3


def test_a_full_ring_refuses_and_a_release_frees_the_oldest_slot(ring):
    writer, reader = ring
    for seq in (1, 2, 3):
        writer.write(seq, [torch.full((4,), float(seq))])
    assert writer.free() == 0
    with pytest.raises(FeatureChannelError, match="no free ring slot"):
        writer.write(4, [torch.zeros(4)])
    with pytest.raises(FeatureChannelError, match="no free ring slot"):
        writer.write(4, [torch.zeros(65)])     # larger than a slot
    assert torch.equal(reader.read(1, 0, 16).view(torch.float32), torch.full((4,), 1.0))
    reader.release()
    assert writer.free() == 1 and writer.write(4, [torch.full((4,), 4.0)]) == 0
    # messages 2 and 3 were never overwritten
    assert torch.equal(reader.read(2, 1, 16).view(torch.float32), torch.full((4,), 2.0))


def test_a_slot_overwritten_before_its_read_is_an_error_not_wrong_data(ring):
    writer, reader = ring
    for seq in (1, 2, 3):
        writer.write(seq, [torch.full((4,), float(seq))])
    reader.release()                   # a reader that released slot 0 without reading message 1
    writer.write(4, [torch.full((4,), 4.0)])
    with pytest.raises(FeatureChannelError, match="holds message 4, not 1"):
        reader.read(1, 0, 16)
    with pytest.raises(FeatureChannelError, match="out of range"):
        reader.read(2, 3, 16)


# ----------------------------------------------------------------------------------------------
# Two processes


def _receiver_process(address: str, orders, results) -> None:
    """The drafter's end in a spawned process: takes the refs it is sent, answers their values."""
    torch.set_num_threads(1)
    receiver = FeatureReceiver(address, "cpu", capacity=64, take_timeout_s=30.0)
    try:
        while True:
            refs = orders.get(timeout=120)
            if refs is None:
                break
            out = []
            for seq, index in refs:
                t = receiver.take(ChannelRef(seq, index))
                out.append((str(t.dtype), list(t.shape), t.float().tolist()))
            results.put((receiver.state, out))
        _wait(lambda: receiver.state != "up")   # the sender's close
        results.put((receiver.state, receiver.lost))
    finally:
        receiver.close()


def _as_sent(t: torch.Tensor):
    return str(t.dtype), list(t.shape), t.float().tolist()


def test_two_processes_share_the_ring_and_fall_back_to_gloo_for_large_messages():
    ctx = multiprocessing.get_context("spawn")
    orders, results = ctx.Queue(), ctx.Queue()
    address = _address()
    child = ctx.Process(target=_receiver_process, args=(address, orders, results), daemon=True)
    child.start()
    sender = FeatureSender(address, "cpu", ring_slots=2, slot_bytes=1024)
    try:
        _wait(lambda: sender.ready, timeout=60)
        ring = sender._group.ring
        assert sender._group.transport == "shared-memory ring"
        assert not os.path.exists(ring.spec.path)       # unlinked once both ends mapped it
        g = torch.Generator().manual_seed(0)
        sent, refs = [], []
        for k in range(12):      # one at a time: each finds a free slot, each slot reused 6 times
            dtype = (torch.float32, torch.bfloat16, torch.int64)[k % 3]
            feats = [(torch.randn(k % 4 + 1, 8, generator=g) * 100).to(dtype), None,
                     (torch.randn(2, 8, generator=g) * 100).to(dtype)]
            r = sender.send(feats)
            _wait(lambda: ring.free() == ring.slots)
            sent += [feats[0], feats[2]]
            refs += [r[0], r[2]]
        assert ring.written == 12
        assert (sender.ring_messages, sender.group_messages) == (12, 0)
        large = torch.randn(40, 8, generator=g)          # 1280 bytes: over gloo
        burst = [[torch.full((4, 8), float(i))] for i in range(6)]   # as fast as they come
        for feats in [[large]] + burst:
            refs += sender.send(feats)
            sent += feats
        _wait(lambda: sender.ring_messages == 12 + 6)    # the burst: each into a slot the drafter freed
        assert sender.group_messages == 1
        orders.put([(r.seq, r.index) for r in refs])
        state, got = results.get(timeout=120)
        assert state == "up"
        assert got == [_as_sent(t) for t in sent]
        sender.close()
        orders.put(None)
        assert results.get(timeout=60) == ("closed", 0)
    finally:
        sender.close()
        child.join(30)
        if child.is_alive():
            child.kill()


def _sender_and_peer(send_timeout_s: float):
    """A sender with a ring of two 1 KiB slots and the drafter's end as a bare group driven by
    hand, past the handshake."""
    from spectandem.channel import _Group

    address = _address()
    sender = FeatureSender(address, "cpu", ring_slots=2, slot_bytes=1024, send_timeout_s=send_timeout_s)
    peer = _Group(address, 1, CPU, 30.0)
    peer.recv_header()
    peer.recv_payload(torch.empty(8, dtype=torch.uint8))     # the handshake
    _wait(lambda: sender.ready)
    return sender, peer


def test_a_message_finding_every_slot_unread_waits_for_a_freed_slot():
    """The drafter's end driven by hand: it reads nothing until three messages are sent. The
    third waits for the first's slot, then its header names that slot; none goes over gloo."""
    sender, peer = _sender_and_peer(send_timeout_s=30.0)
    try:
        feats = [torch.full((2, 4), float(k)) for k in range(3)]
        refs = [sender.send([f])[0] for f in feats]
        assert [r.seq for r in refs] == [1, 2, 3] and sender._group.ring.free() == 0
        time.sleep(0.2)
        assert sender.ring_messages == 2 and sender.placement(3) is None   # the third still waits
        for k, f in enumerate(feats):
            seq, num_items, ndim, code, slot = peer.recv_header()[:5]
            assert (seq, num_items, ndim, slot) == (k + 1, 1, 2, k % 2)
            payload = peer.ring.read(seq, slot, 32)
            peer.ring.release()
            assert torch.equal(payload.view(torch.float32).view(2, 4), f)
        assert (sender.ring_messages, sender.group_messages) == (3, 0) and sender.placement(3)[0] == 0
        _wait(lambda: sender._group.ring.free() == 2)
        closing = threading.Thread(target=peer.recv_header, daemon=True)   # the sender's close, taken
        closing.start()
        sender.close()
        closing.join(10)
    finally:
        sender.close()
        peer.abort()
        peer.ring.close()


def test_a_drafter_that_stops_reading_the_ring_breaks_the_channel():
    """Its slots never freed, a message waiting for one breaks the channel after send_timeout_s;
    later sends return None (the features then go inline, through the router)."""
    sender, peer = _sender_and_peer(send_timeout_s=1.0)
    try:
        assert all(sender.send([torch.ones(2, 4)]) is not None for _ in range(3))
        _wait(lambda: not sender.ready, timeout=10)
        assert sender.state == "broken" and sender.send([torch.ones(2, 4)]) is None
    finally:
        sender.close()
        peer.abort()
        peer.ring.close()


def test_a_drafter_that_cannot_map_the_ring_gets_payloads_over_gloo(monkeypatch):
    def refuse(spec, device):
        raise OSError("no such file")

    monkeypatch.setattr(PayloadRing, "attach", classmethod(lambda cls, spec, device: refuse(spec, device)))
    address = _address()
    sender = FeatureSender(address, "cpu", send_timeout_s=5.0)
    receiver = FeatureReceiver(address, "cpu", take_timeout_s=5.0)
    try:
        _wait(lambda: sender.ready and receiver.ready)
        assert sender._group.ring is None and sender._group.transport == "gloo"
        feats = [torch.randn(3, 8), torch.randn(1, 8)]
        refs = sender.send(feats)
        assert all(torch.equal(receiver.take(r), f) for r, f in zip(refs, feats))
    finally:
        sender.close()
        receiver.close()


def test_no_ring_when_the_verifier_offers_none():
    address = _address()
    sender = FeatureSender(address, "cpu", ring_slots=0)
    receiver = FeatureReceiver(address, "cpu", take_timeout_s=5.0)
    try:
        _wait(lambda: sender.ready and receiver.ready)
        assert sender._group.transport == receiver._group.transport == "gloo"
        feats = [torch.randn(2, 8)]
        assert torch.equal(receiver.take(sender.send(feats)[0]), feats[0])
    finally:
        sender.close()
        receiver.close()
