"""The direct feature channel (spectandem/channel.py) over gloo on localhost, both ends in this
process (their own threads and groups, as in two processes): messages arrive in order and
whole, several in flight; the mailbox is bounded and says what it dropped; `take` times out
with a clear error; a peer that dies or stops receiving never blocks the verifier's `send`, and
the sender then reports itself broken so features go inline."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from spectandem.protocol import ExtendItem, Tag, Verdict
from spectandem import codec
from spectandem.channel import (MAX_ITEMS, ChannelRef, FeatureChannelError, FeatureReceiver, FeatureSender, _Group,
                                parse_address)
from spectandem.v1 import engines_pb2

ROOT = Path(__file__).resolve().parents[2]

def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def _wait(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def pair():
    address = _address()
    sender = FeatureSender(address, "cpu", send_timeout_s=2.0)
    receiver = FeatureReceiver(address, "cpu", capacity=4, take_timeout_s=2.0)
    _wait(lambda: sender.ready and receiver.ready)
    yield sender, receiver
    sender.close()
    receiver.close()


def test_messages_arrive_in_order_and_whole(pair):
    sender, receiver = pair
    g = torch.Generator().manual_seed(0)
    rounds = [[torch.randn(3, 8, generator=g), None, torch.randn(1, 8, generator=g)],
              [torch.randn(2, 8, generator=g).to(torch.bfloat16)],
              [torch.randn(0, 8, generator=g)],
              [torch.randint(0, 9, (5,), generator=g)]]
    refs = [sender.send(feats) for feats in rounds]   # all four in flight before any take
    assert refs[0] == [ChannelRef(1, 0), None, ChannelRef(1, 1)]
    assert [r[0].seq for r in refs[1:]] == [2, 3, 4]
    for feats, rs in reversed(list(zip(rounds, refs))):   # taken in any order
        for f, r in zip(feats, rs):
            if f is not None:
                got = receiver.take(r)
                assert got.dtype == f.dtype and torch.equal(got, f)
    with pytest.raises(FeatureChannelError, match="already taken"):
        receiver.take(refs[0][0])
    assert sender.send([None, None]) == [None, None]   # nothing to send: no message


def test_a_call_over_max_items_is_split(pair):
    sender, receiver = pair
    feats = [torch.full((1, 4), float(i)) for i in range(MAX_ITEMS + 3)]
    refs = sender.send(feats)
    assert {r.seq for r in refs} == {1, 2} and refs[MAX_ITEMS] == ChannelRef(2, 0)
    assert all(torch.equal(receiver.take(r), f) for r, f in zip(refs, feats))


def test_take_message_hands_out_a_message_s_items_at_once(pair):
    """`take_message` hands out what `take` would, item by item, over a message's items in any
    order; the message leaves the mailbox once every item is taken, a ref taken twice fails, and
    refs of two messages are refused. The drafter's catch-up takes its items so, message by
    message: where one message's items fail, the others' still come (drafter/service_core.py
    `_take_features`), over items of two messages in any order."""
    from drafter.service_core import _take_features
    from spectandem.protocol import ExtendItem, Tag

    sender, receiver = pair
    first = [torch.full((2, 4), float(i)) for i in range(3)]
    second = [torch.full((1, 4), 10.0 + i) for i in range(2)]
    a, b = sender.send(first), sender.send(second)
    got = receiver.take_message([a[2], a[0], a[1]])
    assert all(torch.equal(g, f) for g, f in zip(got, [first[2], first[0], first[1]]))
    assert a[0].seq not in receiver._mail            # every item of the message taken
    with pytest.raises(FeatureChannelError, match="already taken"):
        receiver.take_message([a[0]])
    with pytest.raises(ValueError, match="one message"):
        receiver.take_message([b[0], a[1]])
    # Items of other shapes: rows of 4, of 3 and of 4 (no one row shape), and of [3, 2, 2],
    # [1, 2, 2] and [0, 2, 2] (rows of [2, 2]), each as `take` hands it out; one item twice in a
    # call fails.
    for feats in ([torch.arange(8.0).view(2, 4), torch.arange(3.0).view(1, 3) + 9, torch.ones(1, 4)],
                  [torch.arange(12.0).view(3, 2, 2), -torch.ones(1, 2, 2), torch.zeros(0, 2, 2)]):
        refs = sender.send(feats)
        got = receiver.take_message([refs[2], refs[0], refs[1]])
        assert [(g.shape, g.tolist()) for g in got] == [(f.shape, f.tolist()) for f in (feats[2], feats[0], feats[1])]
        assert all(g.is_contiguous() for g in got)
    refs = sender.send([torch.ones(1, 4), torch.zeros(1, 4)])
    with pytest.raises(FeatureChannelError, match="already taken"):
        receiver.take_message([refs[0], refs[1], refs[1]])
    assert torch.equal(receiver.take(refs[1]), torch.zeros(1, 4))   # a failed call hands out nothing more
    items = [ExtendItem(Tag(f"r{k}", 0, 5), [1], ref) for k, ref in enumerate([b[1], ChannelRef(99, 0), b[0]])]
    receiver.take_timeout_s = 0.3
    taken, missing = _take_features(receiver, items)
    assert missing == ["r1"] and [i.tag.request_id for i in taken] == ["r0", "r2"]
    assert torch.equal(taken[0].features, second[1]) and torch.equal(taken[1].features, second[0])
    assert not receiver._mail


def test_mailbox_is_bounded_and_late_messages_time_out(pair):
    sender, receiver = pair
    refs = [sender.send([torch.full((2,), float(i))])[0] for i in range(6)]   # capacity 4
    _wait(lambda: receiver.dropped == 2)
    for r in refs[:2]:
        start = time.monotonic()
        with pytest.raises(FeatureChannelError, match="dropped"):   # at once, no waiting
            receiver.take(r)
        assert time.monotonic() - start < 0.5
    assert torch.equal(receiver.take(refs[5]), torch.full((2,), 5.0))
    start = time.monotonic()
    with pytest.raises(FeatureChannelError, match="did not arrive within 0.3 s"):
        receiver.take(ChannelRef(99, 0), timeout_s=0.3)
    assert 0.3 <= time.monotonic() - start < 2.0
    with pytest.raises(FeatureChannelError, match="has 1 items"):
        receiver.take(ChannelRef(refs[4].seq, 1))


def _held_headers(sender: FeatureSender):
    """The sender's headers held back until the returned event is set (payloads still go into
    the ring at `send`)."""
    gate = threading.Event()
    group = sender._group
    send_header = group.send_header
    group.send_header = lambda values: (gate.wait(30), send_header(values))[1]
    return gate


def test_a_message_told_where_it_lies_is_taken_before_its_header(pair):
    """A round's verdicts tell the drafter where their features lie in the payload ring
    (FeatureSender.placement -> FeatureReceiver.expect): `take` copies them out at once, while
    the header is still on its way; the header then only releases the slot, and the ring goes
    on. Without being told, the same take waits for the header (the control)."""
    sender, receiver = pair
    gate = _held_headers(sender)
    f, g = torch.randn(3, 8), torch.randn(2, 8)
    refs = sender.send([f, g])
    placement = sender.placement(refs[0].seq)
    assert placement is not None and placement[2] == [(3, 8), (2, 8)]
    with pytest.raises(FeatureChannelError, match="did not arrive"):   # the control: not told, the header held
        receiver.take(refs[0], timeout_s=0.3)
    receiver.expect({refs[0].seq: placement})
    assert torch.equal(receiver.take(refs[0], timeout_s=1.0), f) and receiver.early_reads == 1
    gate.set()
    assert torch.equal(receiver.take(refs[1]), g)      # the rest of the message, after its header
    with pytest.raises(FeatureChannelError, match="already taken"):
        receiver.take(refs[0])
    # The header released the slot: many more messages through the ring's four slots, all whole.
    for i in range(12):
        t = torch.full((2, 8), float(i))
        assert torch.equal(receiver.take(sender.send([t])[0]), t)
    _wait(lambda: sender._group.ring.free() == sender._group.ring.slots)
    assert receiver.dropped == 0 and receiver.lost == 0


def test_a_placement_that_no_longer_holds_waits_for_the_header(pair):
    """Told a slot that holds another message (the ring's tag says so), `take` copies nothing
    out of it and waits for the header's copy, which is the right one."""
    sender, receiver = pair
    gate = _held_headers(sender)
    f = torch.randn(4, 8)
    ref = sender.send([f])[0]
    slot, code, shapes = sender.placement(ref.seq)
    receiver.expect({ref.seq: ((slot + 1) % sender._group.ring.slots, code, shapes)})
    threading.Timer(0.3, gate.set).start()
    assert torch.equal(receiver.take(ref, timeout_s=5.0), f)
    assert gate.is_set() and receiver.early_reads == 0   # it came with the header, let go only then


def test_dead_receiver_never_blocks_send():
    """The drafter process dies (SIGKILL): send() keeps returning at once; the sender breaks."""
    address = _address()
    sender = FeatureSender(address, "cpu", send_timeout_s=2.0)
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    child = subprocess.Popen([sys.executable, "-c", "import sys, time; from spectandem.channel import "
                              "FeatureReceiver; r = FeatureReceiver(sys.argv[1], 'cpu'); time.sleep(600)", address],
                             cwd=ROOT, env=dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1"))
    try:
        _wait(lambda: sender.ready, timeout=60)
        child.kill()
        child.wait()
        start = time.monotonic()
        for _ in range(20):
            sender.send([torch.randn(4, 8)])   # returns at once whatever happens to the messages
        assert time.monotonic() - start < 0.5
        # Either the gloo send fails (the peer's socket reset) or it hangs and the next check
        # past send_timeout_s breaks it; `ready` runs that check, as every send does.
        _wait(lambda: not sender.ready and sender.state == "broken", timeout=15)
        assert sender.send([torch.randn(4, 8)]) is None   # the caller now returns tensors inline
    finally:
        child.kill()
        sender.close()


def test_a_receiver_that_stops_receiving_breaks_the_sender_within_the_timeout():
    address = _address()
    sender = FeatureSender(address, "cpu", send_timeout_s=1.0)
    peer = _Group(address, 1, torch.device("cpu"), 10.0)   # connects, takes the handshake, then nothing
    try:
        peer.recv_header()
        peer.recv_payload(torch.empty(8, dtype=torch.uint8))
        _wait(lambda: sender.ready)
        start = time.monotonic()
        sender.send([torch.randn(2, 2)])
        assert time.monotonic() - start < 0.2
        _wait(lambda: not sender.ready, timeout=5)   # `ready` (and every send) checks
        assert sender.state == "broken" and time.monotonic() - start < 3.0
        assert sender.send([torch.randn(2, 2)]) is None
    finally:
        sender.close()
        peer.abort()


def test_no_peer_means_not_ready():
    sender = FeatureSender(_address(), "cpu", connect_timeout_s=0.5)
    try:
        assert sender.send([torch.zeros(1)]) is None   # still connecting: inline
        _wait(lambda: sender.state == "broken", timeout=10)
    finally:
        sender.close()


def test_addresses_and_codec():
    assert parse_address("tcp://10.0.0.2:29500") == ("10.0.0.2", 29500)
    for bad in ("10.0.0.2:29500", "tcp://host", "udp://h:1"):
        with pytest.raises(ValueError, match="tcp://HOST:PORT"):
            parse_address(bad)
    r = Verdict(Tag("r", 1, 9), [4, 5], 1, 3, ChannelRef(7, 2))
    msg = engines_pb2.VerifyResultMsg.FromString(codec.verdict_to_msg(r).SerializeToString())
    assert msg.WhichOneof("feature_handle") == "feature_ref" and not msg.HasField("features")
    assert codec.verdict_from_msg(msg) == r
    item = codec.extend_item_from_msg(codec.extend_item_to_msg(ExtendItem(Tag("r", 1, 9), [4, 5], ChannelRef(7, 2))))
    assert item.features == ChannelRef(7, 2)
    feats = torch.randn(2, 8)
    item = codec.extend_item_from_msg(codec.extend_item_to_msg(ExtendItem(Tag("r", 1, 9), [4, 5], feats)))
    assert torch.equal(item.features, feats)
