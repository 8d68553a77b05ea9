"""The tree channel (spectandem/channel/trees.py) over real sockets: a posted tree reaches a
waiting take, NONE and a missing drafter end a take at once, a drafter that goes away ends the
takes waiting on it, a second drafter connects once the first one's connection ends, a restarted verifier gets
its drafter back at the same address, and a tree stays takeable until a later round is taken;
early trees serve a verify only where they hold every one of its tags (their rows then, in the
verify's order), and otherwise the round's own trees do; a verify of only the early trees (no
draft call posts its round) goes on without trees at once where they cannot serve."""

from __future__ import annotations

import logging
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


def test_none_and_a_missing_drafter_end_a_take_at_once(box, caplog):
    """Each take ends on its reason (nobody connected; the drafter's NONE), not on its timeout."""
    caplog.set_level(logging.INFO, logger="spectandem.channel")
    assert box.take(1, 30.0) is None and box.state == "waiting"   # nobody connected
    poster = _connected(box)
    try:
        assert poster.post(2, None, "the draft failed")
        assert box.take(2, 30.0) is None
        assert box.trees_missed == 2
    finally:
        poster.close()
    reasons = {r.getMessage() for r in caplog.records}
    assert "tree channel: no tree for round 1 (no drafter is connected)" in reasons, reasons
    assert "tree channel: the drafter has no tree for round 2 (the draft failed)" in reasons, reasons
    assert not any("nothing came within" in m for m in reasons), reasons


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


def test_verdicts_go_the_other_way_to_the_poster_while_trees_still_come(box):
    """The verifier's VERDICTS frames reach the drafter's `on_verdicts` on the same connection,
    and the trees it posts meanwhile still reach the mailbox; only verdicts whose features went
    over the feature channel (a ChannelRef) and that the bounds name are sent."""
    from spectandem.channel import ChannelRef
    from spectandem.channel.trees import verdicts_from_bytes, verdicts_to_bytes
    from spectandem.protocol import Tag, Verdict

    got = []
    poster = TreePoster(box.address, retry_s=0.02, on_verdicts=got.append)
    _until(lambda: poster.state == "up" and box.state == "up")
    try:
        verdicts = [Verdict(Tag("a", 1, 10), [5, 6], num_accepted=1, num_draft_tokens=3, features=ChannelRef(4, 0)),
                    Verdict(Tag("b", 0, 7), [9], num_accepted=0, num_draft_tokens=3, features=ChannelRef(4, 1)),
                    Verdict(Tag("c", 0, 8), [2], num_accepted=0, num_draft_tokens=0, features=object()),
                    Verdict(Tag("d", 0, 9), [3], num_accepted=0, num_draft_tokens=3, features=ChannelRef(4, 3))]
        placed = {4: (2, 1, [(2, 8), (1, 8), (1, 8), (1, 8)])}   # message 4 in ring slot 2
        body = verdicts_to_bytes(verdicts, {"a": 40, "b": 8, "c": 99}, placed.get)   # "c": inline; "d": not named
        assert box.send_verdicts(body)
        assert verdicts_to_bytes(verdicts[2:3], {"c": 99}) is None
        threading.Timer(0.05, lambda: poster.post(3, b"tree-3")).start()
        assert box.take(3, 10.0) == b"tree-3"
        _until(lambda: len(got) == 1)
        items, bounds, placements, round_id, prefills = verdicts_from_bytes(got[0])
        assert [(i.tag, i.token_ids, i.features) for i in items] == [(Tag("a", 1, 10), [5, 6], ChannelRef(4, 0)),
                                                                     (Tag("b", 0, 7), [9], ChannelRef(4, 1))]
        assert bounds == {"a": 40, "b": 8} and placements == placed and round_id == 0 and prefills == []
        assert verdicts_from_bytes(verdicts_to_bytes(verdicts, {"a": 40}, None, 17))[3] == 17
        # Where the sender knows no placement (the message went over the group), none is told.
        assert verdicts_from_bytes(verdicts_to_bytes(verdicts, {"a": 40}, {}.get))[2] == {}
        assert box.verdicts_sent == 1 and poster.verdicts_received == 1
    finally:
        poster.close()
    # No drafter connected: nothing is sent.
    _until(lambda: box.state == "waiting")
    assert not box.send_verdicts(body) and box.verdicts_sent == 1


def test_a_failing_on_verdicts_leaves_the_connection_up(box):
    def broken(body):
        raise RuntimeError("a broken drafter")

    poster = TreePoster(box.address, retry_s=0.02, on_verdicts=broken)
    _until(lambda: poster.state == "up" and box.state == "up")
    try:
        assert box.send_verdicts(b'{"v":[]}') and box.send_verdicts(b'{"v":[]}')
        _until(lambda: poster.verdicts_received == 2)
        assert poster.state == "up" and poster.post(1, b"tree-1") and box.take(1, 10.0) == b"tree-1"
    finally:
        poster.close()


def test_a_drafter_that_stops_reading_never_holds_a_verify(box):
    """A drafter end that connected but reads nothing (a hung process): once its socket's buffers
    are full, a send of verdicts gives up within its timeout instead of blocking the verify, and
    the connection is closed (half a frame may be in it)."""
    sock = socket.create_connection(("127.0.0.1", int(box.address.rsplit(":", 1)[1])))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        assert sock.recv(1) == b"\x01"          # taken, then never read again
        _until(lambda: box.state == "up")
        body = b'{"v":[]}' + b" " * (1 << 20)   # 1 MB frames fill the buffers within a few sends
        t0 = time.monotonic()
        sent = [box.send_verdicts(body, timeout_s=0.2) for _ in range(64)]
        assert False in sent and time.monotonic() - t0 < 20.0
        first_fail = sent.index(False)
        assert all(sent[:first_fail]) and not any(sent[first_fail:])   # closed, then nobody to send to
        _until(lambda: box.state == "waiting")
    finally:
        sock.close()


def _trees(rows: list[tuple[str, int]], first_token: int = 100):
    """A DraftTree of one chain of 3 nodes per (request id, committed length), distinct tokens."""
    import torch

    from spectandem.messages import DraftTree
    from spectandem.protocol import Tag

    b = len(rows)
    tokens = torch.arange(first_token, first_token + 3 * b, dtype=torch.int64).view(b, 3)
    tree = DraftTree(request_ids=[r for r, _ in rows], committed_lens=[n for _, n in rows], token_ids=tokens,
                     parents=torch.tensor([[-1, 0, 1]] * b), node_valid=torch.ones(b, 3, dtype=torch.bool),
                     scores=torch.zeros(b, 3))
    return tree, [Tag(r, 0, n) for r, n in rows]


def test_early_trees_serve_a_verify_that_holds_all_their_tags(box):
    """The drafter's EARLY frame after round 4 (trees of a, b, c), round 4's verdicts having gone
    to it for all three, serves round 5's verify of c and a: those rows, in that order, at once
    (no tree is posted for round 5 itself); a verify sent again for round 5 finds the same frame."""
    from spectandem import codec
    from spectandem.protocol import Tag
    from verifier.service_core import tree_from_channel

    poster = _connected(box)
    try:
        early, tags = _trees([("a", 10), ("b", 20), ("c", 30)])
        assert box.send_verdicts(b'{"v":[]}', 4, ["a", "b", "c"])
        assert poster.post(4, codec.draft_tree_to_bytes(early, tags), early=True)
        for taken in (1, 2):
            tree, got = tree_from_channel(box, 5, 30.0, 4, [Tag("c", 0, 30), Tag("a", 0, 10)])
            assert got == [Tag("c", 0, 30), Tag("a", 0, 10)] and tree.request_ids == ["c", "a"]
            assert tree.token_ids.tolist() == [early.token_ids[2].tolist(), early.token_ids[0].tolist()]
            assert box.early_taken == taken and box.trees_missed == 0
    finally:
        poster.close()


def test_a_verify_of_only_the_early_trees_never_waits_for_trees_that_cannot_come(box, caplog):
    """A verify of the early trees (no draft call posts its round): the early trees after round 4
    serve round 5 where the verdicts of round 4 went to the connected drafter for every tag; the
    verify goes on without trees at once where those verdicts did not all go, where they went over
    a connection that has since been replaced, and where the EARLY frame comes without every tag
    (another committed length, a request it lacks), or empty (the drafter made none). Some of those
    rounds also get round-own trees posted later, which such a verify must not wait for: each such
    take ends on its reason, none on its timeout."""
    from spectandem import codec
    from spectandem.protocol import Tag
    from verifier.service_core import tree_from_channel

    caplog.set_level(logging.INFO, logger="spectandem.channel")
    poster = _connected(box)
    try:
        early, tags = _trees([("a", 10), ("b", 20)])
        assert box.send_verdicts(b'{"v":[]}', 4, ["a", "b"])
        assert box.verdicts_went(4, ["b", "a"]) and not box.verdicts_went(4, ["a", "z"])
        assert not box.verdicts_went(3, ["a"])
        assert poster.post(4, codec.draft_tree_to_bytes(early, tags), early=True)
        tree, got = tree_from_channel(box, 5, 30.0, 4, [Tag("b", 0, 20)])
        assert got == [Tag("b", 0, 20)] and tree.request_ids == ["b"]

        own, own_tags = _trees([("a", 11)], first_token=500)
        # verdicts of round 6 went for "a" only; the verify names "a" and "b"
        assert box.send_verdicts(b'{"v":[]}', 6, ["a"])
        assert poster.post(6, codec.draft_tree_to_bytes(early, tags), early=True)
        assert tree_from_channel(box, 7, 30.0, 6, [Tag("a", 0, 10), Tag("b", 0, 20)]) == (None, [])
        # they all went, but the EARLY frame lacks "c"; then one that is empty
        assert box.send_verdicts(b'{"v":[]}', 8, ["a", "c"])
        threading.Timer(0.1, lambda: poster.post(8, codec.draft_tree_to_bytes(early, tags), early=True)).start()
        threading.Timer(0.3, lambda: poster.post(9, codec.draft_tree_to_bytes(own, own_tags))).start()
        assert tree_from_channel(box, 9, 30.0, 8, [Tag("a", 0, 10), Tag("c", 0, 5)]) == (None, [])
        assert box.send_verdicts(b'{"v":[]}', 10, ["a"])
        threading.Timer(0.1, lambda: poster.post(10, b"", early=True)).start()
        assert tree_from_channel(box, 11, 30.0, 10, [Tag("a", 0, 10)]) == (None, [])
        # the EARLY frame holds "a" at another committed length; round 13's own trees come later
        assert box.send_verdicts(b'{"v":[]}', 12, ["a"])
        threading.Timer(0.1, lambda: poster.post(12, codec.draft_tree_to_bytes(early, tags), early=True)).start()
        threading.Timer(0.3, lambda: poster.post(13, codec.draft_tree_to_bytes(own, own_tags))).start()
        assert tree_from_channel(box, 13, 30.0, 12, [Tag("a", 0, 11)]) == (None, [])
    finally:
        poster.close()
    # verdicts that went over a connection since replaced: a new drafter never had them
    _until(lambda: box.state == "waiting")
    assert box.send_verdicts(b'{"v":[]}', 14, ["a"]) is False   # none is connected
    second = _connected(box)
    try:
        assert box.send_verdicts(b'{"v":[]}', 14, ["a"]) and box.verdicts_went(14, ["a"])
        second.close()
        third = _connected(box)
        try:
            assert not box.verdicts_went(14, ["a"])
            assert tree_from_channel(box, 15, 30.0, 14, [Tag("a", 0, 10)]) == (None, [])
        finally:
            third.close()
    finally:
        second.close()
    reasons = {r.getMessage() for r in caplog.records}
    went = "the verdicts of round {} did not all go to the drafter"
    held = "its trees on those verdicts do not hold the round"
    for round_id, why in ((7, went.format(6)), (9, held), (11, held), (13, held), (15, went.format(14))):
        assert f"tree channel: the drafter has no tree for round {round_id} ({why})" in reasons, (round_id, reasons)
    assert not any("nothing came within" in m for m in reasons), reasons


def test_the_prefills_of_a_verify_step_go_with_its_verdicts_as_the_routers_prefill_would_carry_them():
    """The requests a verify prefilled in its step that the bounds name go with its verdicts as
    drafter prefills: tag, prompt, first token, sampling parameters and seed as the router's
    prefill call would carry them, the prompt's features by reference, where their message lies,
    and their bounds. Not those the bounds do not name, a resume, nor features that did not go
    over the channel; a body of prefills alone is sent too."""
    from spectandem.channel import ChannelRef
    from spectandem.channel.trees import verdicts_from_bytes, verdicts_to_bytes
    from spectandem.config import SamplingParams
    from spectandem.protocol import DrafterPrefillItem, Tag, Verdict, VerifierPrefillItem, VerifierPrefillResult

    sampled = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.8, top_k=7, seed=11, stop_token_ids=(2, 3),
                             stop=("\n\n",), ignore_eos=True)
    greedy = SamplingParams(max_tokens=5)
    prefills = [(VerifierPrefillItem(Tag("n", 2, 4), [7, 8, 9, 10], sampled, 11),
                 VerifierPrefillResult(Tag("n", 2, 5), 42, ChannelRef(6, 0))),
                (VerifierPrefillItem(Tag("g", 0, 2), [1, 2], greedy, 99),
                 VerifierPrefillResult(Tag("g", 0, 3), 4, ChannelRef(6, 1))),
                (VerifierPrefillItem(Tag("x", 0, 2), [1, 2], greedy, 5),   # not named
                 VerifierPrefillResult(Tag("x", 0, 3), 4, ChannelRef(6, 2))),
                (VerifierPrefillItem(Tag("i", 0, 2), [1, 2], greedy, 5),   # inline features
                 VerifierPrefillResult(Tag("i", 0, 3), 4, object())),
                (VerifierPrefillItem(Tag("r", 1, 3), [1, 2, 3], greedy, 5, resume=True),
                 VerifierPrefillResult(Tag("r", 1, 3), 0, ChannelRef(6, 3)))]
    verdicts = [Verdict(Tag("a", 1, 10), [5, 6], num_accepted=1, num_draft_tokens=3, features=ChannelRef(4, 0))]
    placed = {4: (2, 1, [(2, 8)]), 6: (3, 1, [(4, 8), (2, 8), (2, 8), (3, 8)])}
    bounds = {"a": 40, "n": 34, "g": 7, "i": 9, "r": 9}
    items, got_bounds, placements, _, got = verdicts_from_bytes(verdicts_to_bytes(verdicts, bounds, placed.get, 3,
                                                                                  prefills))
    assert [i.tag for i in items] == [Tag("a", 1, 10)]
    assert got == [DrafterPrefillItem(Tag("n", 2, 5), [7, 8, 9, 10], 42, sampled, 11, ChannelRef(6, 0)),
                   DrafterPrefillItem(Tag("g", 0, 3), [1, 2], 4, greedy, 99, ChannelRef(6, 1))]
    assert got_bounds == {"a": 40, "n": 34, "g": 7} and placements == placed
    _, only_bounds, only_placed, _, only = verdicts_from_bytes(verdicts_to_bytes([], {"g": 7}, placed.get, 0, prefills))
    assert [p.tag for p in only] == [Tag("g", 0, 3)] and only_bounds == {"g": 7} and only_placed == {6: placed[6]}
    assert verdicts_to_bytes([], {"x2": 1}, placed.get, 0, prefills) is None
