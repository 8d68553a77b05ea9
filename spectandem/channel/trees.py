"""The drafter -> verifier tree channel: a round's draft trees go straight to the verifier, so the
router sends a round's draft call and its verify call together and the trees never cross it
(router/loop.py `_sequential_round`). Each round then waits on one call to an engine process
where it waited on two, one after the other.

    router:  Draft(tags, post_round=R) ----> drafter: drafts, post(R, tree) --.
             Verify(tree_round=R) ---------> verifier: take(R) waits  <-------'  (one TCP connection)
                                                       verifies, replies

Wire: frames of a header <QBI (round, kind, length) and `length` bytes. kind TREE: a serialized
DraftTreeMsg (proto/spectandem/v1/engines.proto, spectandem/codec.py); kind NONE: no tree for
this round (the draft failed or drafted nothing), the bytes the reason in UTF-8. The verifier
listens (TreeMailbox) and the drafter connects (TreePoster), again whenever the connection
breaks: a restarted verifier, listening at the same address, gets its drafter back. The mailbox
takes one drafter at a time (it greets the connection it takes with one byte and closes any
other), so a restarted drafter connects once the old one's connection has ended, which its
process's exit does.

The other way, on the same connection, the verifier sends VERDICTS frames (drafter/next_trees.py):
a verify whose request names requests to draft next (`draft_next`) sends those requests'
verdicts (tag, tokens, a ChannelRef to their features on the feature channel) and bounds before it
replies; the poster hands each frame's body to its `on_verdicts`. Body: UTF-8 JSON
{"v": [[request_id, epoch, committed_len, [token ids], seq, index, bound], ...], "at": {seq:
[slot, dtype code, shapes]}, "r": the verify's own tree round (0: its trees did not come this way),
"p": [[request_id, epoch, committed_len, [prompt ids], first token id, {sampling params}, seed,
seq, index, bound], ...]}: "p" (absent where empty) holds the drafter prefills of the requests the
verify prefilled in its step that `draft_next` names, their first tokens and prompt features.

Early trees: the drafter posts the trees it drafts on the verdicts of round R at once, as an
EARLY frame of round R (an empty body where it made none on them):

    verifier: verify R -- verdicts (r=R) --> drafter: catch up, draft, EARLY(R, trees) --.
    router:   Verify(tree_round=R+1, early_after=R, early_tags), no draft call          |
    verifier: take(R+1): EARLY(R) where it holds every tag of early_tags <--------------'

The router offers early_tags (its round's requests, as it tags them) only where a draft call
would take those very trees (drafter/next_trees.py: the same tags, nothing left to catch up, no
depth cap) and the verifier reported each of them sent to the drafter with round R's verdicts
(Verdict.to_drafter); it then makes no draft call for the round, and the rows the verify takes
are early_tags', in their order. Such a verify waits for no TREE frame: it goes on without trees
at once where the mailbox did not send round R's verdicts to the connected drafter for every tag
(`verdicts_went`), or the EARLY frame comes and does not hold them all; the router then drafts
those requests with a draft call next round.

Failure model: `take` never waits for a tree that cannot come. It returns None (no tree: the
verify goes on with its other rows, and the requests of the missing trees get no verdict this
round) when no drafter is connected as it starts, when the connection breaks while it waits,
when the drafter posts NONE, or after its timeout (a hung drafter). A tree stays in the mailbox
until a later round is taken, so a verify the router sends again for the same round finds it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import select
import socket
import struct
import threading
import time

from spectandem.channel.wire import ChannelRef, parse_address
from spectandem.config import SamplingParams
from spectandem.protocol import DrafterPrefillItem, ExtendItem, Tag

log = logging.getLogger("spectandem.channel")

_HEADER = struct.Struct("<QBI")
TREE, NONE, VERDICTS, EARLY = 1, 0, 2, 3
_EARLY_TAKE = object()     # marks what `_Rounds.take_early`'s wait found early
_WELCOME = b"\x01"         # the mailbox's one byte to a connection it takes (it closes the others)
_KEEP = 16                 # rounds the mailbox holds at most (the latest)
MAX_FRAME_BYTES = 1 << 30  # a frame claiming more is a broken peer
VERDICT_SEND_S = 0.5       # the longest a verify waits on a drafter that does not read its verdicts


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    """`n` bytes, or None at the end of the stream."""
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            return None
        got += k
    return bytes(buf)


def verdicts_to_bytes(verdicts, bounds: dict[str, int], placement=None, round_id: int = 0,
                      prefills=()) -> bytes | None:
    """A VERDICTS body for those of `verdicts` (spectandem.protocol.Verdict) that `bounds` names
    and whose features went over the feature channel (a ChannelRef); None where none is left.
    `placement`: FeatureSender.placement, where their messages lie in the payload ring, sent
    along so the drafter copies the features out without waiting for the messages' headers.
    `round_id`: the verify's tree round (0: none), the round the drafter's early trees follow.
    `prefills`: (VerifierPrefillItem, VerifierPrefillResult) of the requests the verify prefilled
    in its step; those `bounds` names whose features went over the channel go as drafter
    prefills."""
    rows = [[v.tag.request_id, v.tag.epoch, v.tag.committed_len, list(v.token_ids), v.features.seq,
             v.features.index, bounds[v.tag.request_id]]
            for v in sendable_verdicts(verdicts, bounds)]
    pre = [[res.tag.request_id, res.tag.epoch, res.tag.committed_len, list(item.prompt_ids), res.first_token_id,
            _params_to_json(item.params), item.seed, res.features.seq, res.features.index, bounds[res.tag.request_id]]
           for item, res in sendable_prefills(prefills, bounds)]
    if not rows and not pre:
        return None
    at = {}
    for seq in dict.fromkeys([row[4] for row in rows] + [row[7] for row in pre]):
        where = placement(seq) if placement is not None else None
        if where is not None:
            slot, code, shapes = where
            at[str(seq)] = [slot, code, [list(s) for s in shapes]]
    msg = {"v": rows, "at": at, "r": round_id}
    if pre:
        msg["p"] = pre
    return json.dumps(msg, separators=(",", ":")).encode("utf-8")


def sendable_verdicts(verdicts, bounds: dict[str, int]) -> list:
    """Those of `verdicts` that go in a VERDICTS body: `bounds` names them and their features went
    over the feature channel."""
    return [v for v in verdicts if v.tag.request_id in bounds and isinstance(v.features, ChannelRef)]


def sendable_prefills(prefills, bounds: dict[str, int]) -> list:
    """Those of `prefills` ((VerifierPrefillItem, VerifierPrefillResult) of a verify step) that
    go with the verdicts: `bounds` names them, none resumes, and their features went over the
    feature channel."""
    return [(item, res) for item, res in prefills
            if res.tag.request_id in bounds and not item.resume and isinstance(res.features, ChannelRef)]


def verdicts_from_bytes(body: bytes) -> tuple[list[ExtendItem], dict[str, int], dict[int, tuple], int,
                                              list[DrafterPrefillItem]]:
    """A VERDICTS body -> (the catch-up items, as the router's would carry them; the bounds, of
    those and of the prefills; where their feature messages lie in the payload ring, for
    FeatureReceiver.expect; the verify's tree round, after which the next trees may go early, 0
    for none; the drafter prefills, as the router's would carry them)."""
    msg = json.loads(body.decode("utf-8"))
    rows, pre = msg["v"], msg.get("p", [])
    items = [ExtendItem(Tag(rid, int(epoch), int(n)), [int(t) for t in tokens], ChannelRef(int(seq), int(index)))
             for rid, epoch, n, tokens, seq, index, _ in rows]
    prefills = [DrafterPrefillItem(Tag(rid, int(epoch), int(n)), [int(t) for t in prompt], int(first),
                                   _params_from_json(params), int(seed), ChannelRef(int(seq), int(index)))
                for rid, epoch, n, prompt, first, params, seed, seq, index, _ in pre]
    placements = {int(seq): (int(slot), int(code), [tuple(int(d) for d in s) for s in shapes])
                  for seq, (slot, code, shapes) in msg.get("at", {}).items()}
    bounds = {row[0]: int(row[6]) for row in rows}
    bounds.update((row[0], int(row[9])) for row in pre)
    return items, bounds, placements, int(msg.get("r", 0)), prefills


def _params_to_json(p: SamplingParams) -> dict:
    """Every field of `p` (tuples as JSON arrays)."""
    return dataclasses.asdict(p)


def _params_from_json(d: dict) -> SamplingParams:
    return SamplingParams(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})


def _read_frame(sock: socket.socket, kinds: tuple[int, ...]) -> tuple[int, int, bytes] | str | None:
    """The next frame, (round, kind, body); None at the end of the stream; a string saying why
    it is malformed (a kind not in `kinds`, or too long)."""
    head = _read_exact(sock, _HEADER.size)
    if head is None:
        return None
    round_id, kind, length = _HEADER.unpack(head)
    if length > MAX_FRAME_BYTES or kind not in kinds:
        return f"a malformed frame (kind {kind}, {length} bytes)"
    body = _read_exact(sock, length) if length else b""
    return None if body is None else (round_id, kind, body)


def _send_within(sock: socket.socket, data: bytes, timeout_s: float) -> None:
    """`sock.sendall(data)` without blocking past `timeout_s` (TimeoutError), the socket left
    blocking for its reader."""
    view, deadline = memoryview(data), time.monotonic() + timeout_s
    while view:
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT):]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([], [sock], [], left)[1]:
            raise TimeoutError(f"{len(view)} of {len(data)} bytes not taken within {timeout_s} s")


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class _Rounds:
    """A round's entries as the verifier's end of the tree channel keeps them (TreeMailbox,
    TreeHandOff): at most _KEEP rounds, the latest; a round's entry stays until a later round is
    taken, so a verify sent again for the same round finds it; a wait gives up once its round's
    entry cannot come."""

    def __init__(self):
        self._cond = threading.Condition()
        self._box: dict[int, object] = {}
        # Early trees, by the round whose verdicts they follow (TreeMailbox: EARLY frames' bodies;
        # TreeHandOff: (tree, tags), None where none were made).
        self._early: dict[int, object] = {}
        self.trees_taken = self.trees_missed = self.early_taken = self.early_rows_taken = 0
        self._went: dict[int, tuple[object, frozenset]] = {}   # tree round -> (way, the ids whose verdicts went)

    def _note_verdicts(self, round_id: int, request_ids, way=None) -> None:
        """The verdicts of tree round `round_id` of these requests went to the drafter, `way` (its
        connection across processes; None in one)."""
        with self._cond:
            self._went[round_id] = (way, frozenset(request_ids))
            while len(self._went) > _KEEP:
                del self._went[min(self._went)]

    def _way(self):
        """The way verdicts go to the drafter now (`_note_verdicts`), asked under the lock: None in
        one process."""
        return None

    def verdicts_went(self, round_id: int, request_ids) -> bool:
        """Whether the verdicts of tree round `round_id` went to the drafter for every one of
        `request_ids`, the way they go now (a drafter that connected since never had them)."""
        with self._cond:
            if round_id not in self._went:
                return False
            way, ids = self._went[round_id]
            return way is self._way() and set(request_ids) <= ids

    def _gone(self):
        """A wait's `gone` (`_wait_for`): why the entry cannot come, asked under the lock; None: it
        still can."""
        return lambda: None

    def take_early(self, round_id: int, timeout_s: float, early_after: int, early_tags: list, accept):
        """Round `round_id`'s trees where no draft call posts them: `accept(entry)` of the early
        trees posted on the verdicts of round `early_after` (what to verify of them: the rows of
        `early_tags`, in their order; None where they do not hold every one of those, or the
        drafter made none) -> that, or None: at once where the verdicts of `early_after` did not
        all go to the drafter (`verdicts_went`), as soon as the early trees come and `accept`
        refuses them, or where the drafter is gone or nothing came within `timeout_s`. The early
        entry is kept while it is the latest: a verify sent again for the round finds it too."""
        if not self.verdicts_went(early_after, [t.request_id for t in early_tags]):
            self._none_posted(round_id, f"the verdicts of round {early_after} did not all go to the drafter")
            return None

        def early():
            for r in [r for r in self._early if r < early_after]:   # rounds done with
                del self._early[r]
            return (_EARLY_TAKE, accept(self._early[early_after])) if early_after in self._early else None
        entry = self._wait_for(round_id, timeout_s, self._gone(), early)
        if entry is None:
            return None
        if not (isinstance(entry, tuple) and entry[0] is _EARLY_TAKE and entry[1] is not None):
            self._none_posted(round_id, "its trees on those verdicts do not hold the round")
            return None
        self.trees_taken += 1
        self.early_taken += 1
        self.early_rows_taken += len(early_tags)
        return entry[1]

    def _put(self, round_id: int, entry) -> None:
        """Under self._cond."""
        self._box[round_id] = entry
        while len(self._box) > _KEEP:
            del self._box[min(self._box)]
        self._cond.notify_all()

    def _wait_for(self, round_id: int, timeout_s: float, gone=lambda: None, early=lambda: None):
        """`round_id`'s entry once it is in (earlier rounds then go), or None (a miss, logged):
        `gone()`, asked under the lock, named why it cannot come, or `timeout_s` passed. `early()`,
        asked under the lock while the entry is not in: what to return instead (None: wait on)."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while round_id not in self._box:
                got = early()
                if got is not None:
                    for r in [r for r in self._box if r < round_id]:
                        del self._box[r]
                    return got
                left = deadline - time.monotonic()
                why = gone() or (f"nothing came within {timeout_s:.1f} s" if left <= 0 else None)
                if why:
                    self.trees_missed += 1
                    log.warning("tree channel: no tree for round %d (%s)", round_id, why)
                    return None
                self._cond.wait(left)
            entry = self._box[round_id]
            for r in [r for r in self._box if r < round_id]:   # earlier rounds are done with
                del self._box[r]
        return entry

    def _none_posted(self, round_id: int, reason: str) -> None:
        self.trees_missed += 1
        log.info("tree channel: the drafter has no tree for round %d (%s)", round_id, reason)


class TreeMailbox(_Rounds):
    """The verifier's end: listens at `address` (tcp://HOST:PORT; port 0: a free one, see
    `address`) and keeps the trees its drafter posts, by round."""

    def __init__(self, address: str):
        host, port = parse_address(address)
        self._listener = _listen(host, port)
        self.address = f"tcp://{host}:{self._listener.getsockname()[1]}"
        super().__init__()   # entries: (kind, body)
        self._conn: socket.socket | None = None
        self._closed = False
        self._send_lock = threading.Lock()
        self.verdicts_sent = 0
        # tree round -> (the connection they went over, the request ids whose verdicts went)
        threading.Thread(target=self._accept, name="tree-mailbox", daemon=True).start()

    @property
    def state(self) -> str:
        """"up" (a drafter is connected), "waiting" (none is) or "closed"."""
        with self._cond:
            return "closed" if self._closed else ("up" if self._conn is not None else "waiting")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return   # closed
            _tune(conn)
            with self._cond:
                if self._closed:
                    conn.close()
                    return
                busy = self._conn is not None
                if not busy:
                    self._conn = conn
                    self._cond.notify_all()
            if busy:   # one drafter at a time: another may connect once this one's connection ends
                _shut(conn)
                continue
            try:
                conn.sendall(_WELCOME)
            except OSError:
                pass   # the reader finds the connection broken
            log.info("tree channel: a drafter connected at %s", self.address)
            threading.Thread(target=self._read, args=(conn,), name="tree-reader", daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        why = "the drafter closed the connection"
        try:
            while True:
                frame = _read_frame(conn, (TREE, NONE, EARLY))
                if not isinstance(frame, tuple):
                    why = frame or why
                    break
                round_id, kind, body = frame
                with self._cond:
                    if kind == EARLY:
                        self._early[round_id] = body
                        while len(self._early) > _KEEP:
                            del self._early[min(self._early)]
                        self._cond.notify_all()
                    else:
                        self._put(round_id, (kind, body))
        except OSError as exc:
            why = f"{type(exc).__name__}: {exc}"
        with self._cond:
            if self._conn is conn:
                self._conn = None
                log.warning("tree channel: lost its drafter (%s)", why)
            self._cond.notify_all()
        _shut(conn)

    def send_verdicts(self, body: bytes, round_id: int = 0, request_ids=(), timeout_s: float = VERDICT_SEND_S) -> bool:
        """Sends a VERDICTS frame to the connected drafter; False where none is connected, or the
        send failed or did not finish within `timeout_s` (a drafter that stopped reading: the
        verify never waits on it longer). A send that did not finish leaves half a frame in the
        stream, so the connection is then shut: the reader finds it broken, and the drafter
        connects again. `round_id`, `request_ids`: the verify's tree round and the requests whose
        verdicts (or drafter prefills) the body holds, noted where it went (`verdicts_went`)."""
        with self._cond:
            self._went.pop(round_id, None)
            conn = self._conn
        if conn is None:
            return False
        try:
            with self._send_lock:
                _send_within(conn, _HEADER.pack(0, VERDICTS, len(body)) + body, timeout_s)
        except OSError as exc:   # TimeoutError included
            log.warning("tree channel: sending verdicts to the drafter failed (%s: %s); closing its connection",
                        type(exc).__name__, exc)
            _shut(conn)
            return False
        self.verdicts_sent += 1
        if round_id:
            self._note_verdicts(round_id, request_ids, conn)
        return True

    def _way(self):
        return self._conn

    def take(self, round_id: int, timeout_s: float) -> bytes | None:
        """The tree posted for `round_id` (a serialized DraftTreeMsg), or None: no drafter is
        connected, it went away or posted none for this round, or nothing came within `timeout_s`."""
        entry = self._wait_for(round_id, timeout_s, self._gone())
        if entry is None:
            return None
        kind, body = entry
        if kind == NONE:
            self._none_posted(round_id, body.decode("utf-8", "replace"))
            return None
        self.trees_taken += 1
        return body

    def _gone(self):
        """No drafter connected as the wait begins, or the one that was went away."""
        first: list = []   # the connection when the wait began (asked first under the lock)

        def gone():
            if not first:
                first.append(self._conn)
            if first[0] is None:
                return "no drafter is connected"
            return "its drafter went away" if self._conn is not first[0] or self._closed else None
        return gone

    def close(self) -> None:
        with self._cond:
            self._closed = True
            conn, self._conn = self._conn, None
            self._cond.notify_all()
        try:
            self._listener.close()
        except OSError:
            pass
        if conn is not None:
            _shut(conn)


class TreePoster:
    """The drafter's end: connects to the verifier's mailbox at `address` in the background (its
    model may still be loading there), and again after the connection breaks. `on_verdicts(body)`:
    called, in the connection's reading thread, with each VERDICTS frame's body the verifier
    sends (None: they are dropped)."""

    def __init__(self, address: str, retry_s: float = 0.2, on_verdicts=None):
        self.host, self.port = parse_address(address)
        self.address, self.retry_s = address, retry_s
        self.on_verdicts = on_verdicts
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None
        self._closed = False
        self.trees_posted = self.verdicts_received = 0
        threading.Thread(target=self._connect, name="tree-poster", daemon=True).start()

    @property
    def state(self) -> str:
        """"up", "connecting" or "closed"."""
        with self._lock:
            return "closed" if self._closed else ("up" if self._sock is not None else "connecting")

    def _connect(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
            try:
                sock = socket.create_connection((self.host, self.port), timeout=5.0)
                _tune(sock)
                # A connection to itself (the port free, and picked as this end's own) is none.
                taken = sock.getsockname() != sock.getpeername() and sock.recv(1) == _WELCOME
                sock.settimeout(None)
            except OSError:
                taken, sock = False, None
            if not taken:
                if sock is not None:
                    sock.close()
                time.sleep(self.retry_s)
                continue
            with self._lock:
                if self._closed:
                    sock.close()
                    return
                self._sock = sock
            log.info("tree channel: connected to the verifier at %s", self.address)
            self._read(sock)   # returns when the verifier goes (or `post` or `close` shut the socket)
            with self._lock:
                if self._sock is sock:
                    self._sock = None
                    log.warning("tree channel: the verifier at %s went away; connecting again", self.address)
            _shut(sock)

    def _read(self, sock: socket.socket) -> None:
        """The verifier's VERDICTS frames, each handed to `on_verdicts`, until the connection ends
        or a frame is malformed."""
        try:
            while True:
                frame = _read_frame(sock, (VERDICTS,))
                if not isinstance(frame, tuple):
                    if frame:
                        log.warning("tree channel: %s from the verifier", frame)
                    return
                body = frame[2]
                self.verdicts_received += 1
                if self.on_verdicts is not None:
                    try:
                        self.on_verdicts(body)
                    except Exception:   # the drafter's own failure: its router calls go on as without it
                        log.exception("tree channel: drafting on the verifier's verdicts failed")
        except OSError:
            return

    def post(self, round_id: int, tree: bytes | None, reason: str = "", early: bool = False) -> bool:
        """Sends round `round_id`'s tree (None: a NONE frame carrying `reason`); False when the
        channel is not up (the caller returns the tree inline) or the send failed. `early`: the
        trees drafted on the verdicts of round `round_id`, for the round after it (EARLY)."""
        kind, body = (EARLY if early else TREE, tree) if tree is not None else (NONE, reason.encode("utf-8"))
        with self._lock:
            sock = self._sock
            if sock is None:
                return False
            try:
                sock.sendall(_HEADER.pack(round_id, kind, len(body)) + body)
            except OSError as exc:
                log.warning("tree channel: sending to the verifier failed (%s: %s); connecting again",
                            type(exc).__name__, exc)
                self._sock = None
                _shut(sock)   # the connecting thread connects again
                return False
            if kind == TREE:
                self.trees_posted += 1
            return True

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sock, self._sock = self._sock, None
        if sock is not None:
            _shut(sock)



class TreeHandOff(_Rounds):
    """The tree channel between two engines of one process (serve --backend local where each
    engine has a worker thread of its own): the drafter's thread `post`s a round's trees as
    objects, the verifier's thread `take`s them, waiting on a condition; nothing is serialized
    and no event loop turn lies between the draft and the verify. The mailbox's rules
    (`_Rounds`); `take` returns None where the drafter posted none for the round or nothing came
    within its timeout. The two ends must not share one worker thread: a verify waiting for its
    trees would then keep the draft that posts them from running.

    Early trees as across processes: the verifier's link notes the requests whose verdicts of a
    tree round it handed to the drafter (`note_verdicts`), the drafter posts the trees it drafts
    on them (`post_early`), and a verify that no draft call posts for takes only those
    (`take_early`)."""

    state = "up"

    def __init__(self):
        super().__init__()   # entries: (tree, tags), or the reason none came
        self.trees_posted = 0

    def post(self, round_id: int, tree, tags: list | None = None, reason: str = "") -> bool:
        """Round `round_id`'s `tree` (a DraftTree on the host or the verifier's device) for `tags`;
        tree None: none comes this round, for `reason`. Always True (the hand-off is always up)."""
        with self._cond:
            self._put(round_id, (tree, list(tags or ())) if tree is not None else (reason or "no tree"))
            if tree is not None:
                self.trees_posted += 1
        return True

    def take(self, round_id: int, timeout_s: float):
        """(the trees posted for `round_id`, their tags), or None: none was posted for it, or
        nothing came within `timeout_s`."""
        entry = self._wait_for(round_id, timeout_s)
        if isinstance(entry, str):
            self._none_posted(round_id, entry)
            return None
        if entry is not None:
            self.trees_taken += 1
        return entry

    def note_verdicts(self, round_id: int, request_ids) -> None:
        """The verdicts of tree round `round_id` of these requests went to the drafter."""
        self._note_verdicts(round_id, request_ids)

    def post_early(self, after_round: int, tree, tags) -> None:
        """The trees the drafter drafted on the verdicts of tree round `after_round` (`tree` None:
        it made none on them)."""
        with self._cond:
            self._early[after_round] = (tree, list(tags)) if tree is not None else None
            while len(self._early) > _KEEP:
                del self._early[min(self._early)]
            self._cond.notify_all()


def rows_held(entry, want: list):
    """(the rows of `want`'s requests, in its order, of the early trees `entry` (a DraftTree and its
    tags), `want`) where it holds each of those tags; None where it does not, or is None (none
    made): what a verify of early trees takes (`_Rounds.take_early`'s `accept`)."""
    if entry is None:
        return None
    tree, tags = entry
    held = {t.request_id: t for t in tags}
    if any(held.get(t.request_id) != t for t in want):
        return None
    ids = [t.request_id for t in want]
    return (tree if tree.request_ids == ids else tree.select(ids)), want


def _listen(host: str, port: int, wait_s: float = 10.0) -> socket.socket:
    """A listening socket at (host, port). A verifier started again binds its old port, which its
    drafter's attempts to connect may hold for an instant (a connection to itself, which it then
    drops): that is waited out, up to `wait_s`."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return socket.create_server((host, port))
        except OSError as exc:
            if exc.errno != errno.EADDRINUSE or port == 0 or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _shut(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()
