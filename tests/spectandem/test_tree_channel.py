"""The tree channel (spectandem/channel/trees.py) over real sockets: a posted tree reaches a
waiting take, NONE and a missing drafter end a take at once, a drafter that goes away ends the
takes waiting on it, a second drafter connects once the first one's connection ends, a restarted verifier gets
its drafter back at the same address, and a tree stays takeable until a later round is taken."""

from __future__ import annotations

import socket
import struct
import threading
import time

import pytest

from spectandem.channel.trees import TreeMailbox, TreePoster


def _until(cond, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(0.01)


@pytest.fixture
def box():
    b = TreeMailbox("tcp://127.0.0.1:0")
    yield b
    b.close()


def _connected(box: TreeMailbox) -> TreePoster:
    poster = TreePoster(box.address, retry_s=0.02)
    _until(lambda: poster.state == "up" and box.state == "up")
    return poster


def test_a_posted_tree_reaches_the_take_waiting_for_it(box):
    poster = _connected(box)
    try:
        threading.Timer(0.1, lambda: poster.post(7, b"tree-7")).start()
        assert box.take(7, 10.0) == b"tree-7"
        big = bytes(range(256)) * 40_000   # 10 MB: sampled drafts carry their probabilities
        assert poster.post(8, big)
        assert box.take(8, 10.0) == big
        assert poster.trees_posted == 2 and box.trees_taken == 2
    finally:
        poster.close()


def test_none_and_a_missing_drafter_end_a_take_at_once(box):
    t0 = time.monotonic()
    assert box.take(1, 30.0) is None and box.state == "waiting"   # nobody connected
    poster = _connected(box)
    try:
        assert poster.post(2, None, "the draft failed")
        assert box.take(2, 30.0) is None
        assert time.monotonic() - t0 < 20.0   # neither waited its 30 s
        assert box.trees_missed == 2
    finally:
        poster.close()


def test_a_take_waits_at_most_its_timeout(box):
    poster = _connected(box)
    try:
        t0 = time.monotonic()
        assert box.take(3, 0.3) is None
        assert time.monotonic() - t0 >= 0.3
        assert box.state == "up"
    finally:
        poster.close()


def test_a_drafter_that_goes_away_ends_the_takes_waiting_on_it(box):
    poster = _connected(box)
    got = []
    waiter = threading.Thread(target=lambda: got.append(box.take(5, 30.0)))
    waiter.start()
    time.sleep(0.1)
    poster.close()
    waiter.join(20.0)
    assert not waiter.is_alive() and got == [None]
    _until(lambda: box.state == "waiting")


def test_a_second_drafter_connects_once_the_first_ones_connection_ends(box):
    first = _connected(box)
    second = TreePoster(box.address, retry_s=0.02)
    try:
        time.sleep(0.3)
        assert second.state == "connecting" and first.state == "up"   # one drafter at a time
        first.close()                                                  # its process ended
        _until(lambda: second.state == "up" and box.state == "up")
        assert second.post(9, b"from-second")
        assert box.take(9, 10.0) == b"from-second"
    finally:
        first.close()
        second.close()


def test_a_restarted_verifier_gets_its_drafter_back_at_the_same_address():
    box = TreeMailbox("tcp://127.0.0.1:0")
    poster = _connected(box)
    address = box.address
    try:
        box.close()
        _until(lambda: poster.state == "connecting")
        box = TreeMailbox(address)
        _until(lambda: poster.state == "up" and box.state == "up")
        assert poster.post(11, b"again")
        assert box.take(11, 10.0) == b"again"
    finally:
        poster.close()
        box.close()


def test_a_tree_stays_takeable_until_a_later_round_is_taken(box):
    poster = _connected(box)
    try:
        for r in (20, 21, 22):
            assert poster.post(r, f"t{r}".encode())
        assert box.take(21, 10.0) == b"t21"
        assert box.take(21, 10.0) == b"t21"   # a verify sent again for the same round
        assert box.take(22, 10.0) == b"t22"
        t0 = time.monotonic()
        assert box.take(21, 0.2) is None       # done with once 22 was taken
        assert box.take(20, 0.2) is None
        assert time.monotonic() - t0 >= 0.4
    finally:
        poster.close()


def test_a_malformed_frame_drops_the_connection_not_the_mailbox(box):
    with socket.create_connection(("127.0.0.1", int(box.address.rsplit(":", 1)[1]))) as s:
        _until(lambda: box.state == "up")
        s.sendall(struct.pack("<QBI", 1, 9, 3) + b"abc")   # kind 9 is no kind
        _until(lambda: box.state == "waiting")
    poster = _connected(box)
    try:
        assert poster.post(2, b"fine")
        assert box.take(2, 10.0) == b"fine"
    finally:
        poster.close()


def test_posting_without_a_connection_says_so():
    with socket.socket() as s:   # a port with nobody listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    poster = TreePoster(f"tcp://127.0.0.1:{port}", retry_s=0.02)
    try:
        assert poster.state == "connecting"
        assert poster.post(1, b"x") is False
    finally:
        poster.close()
    assert poster.state == "closed"
