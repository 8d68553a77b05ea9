"""What the in-process links of router/links_local.py hand each other between threads, off the
router's turns:

- `StagedTrees`: one armed verify's next trees (LocalVerifierLink.arm_next): put by the router's
  stage_next or straight from the drafter's worker (direct_stage), the first put wins; taken by
  the verifier's worker, which then launches the verdict's tree.
- `PreAhead`: one draft-ahead call the verifier's worker started on the drafter link after such
  a launch (LocalDrafterLink.pre_ahead), with the arguments the router's next call will give;
  that call takes its reply.
- `PreDraft`: the same for a verdict that did not chain (a miss): the catch-up and the next
  round's draft (LocalDrafterLink.pre_draft); the router's next draft call takes its tree.
"""

from __future__ import annotations

import asyncio
import threading

from router.links import AheadReply, Tag


class StagedTrees:
    """One armed verify's handoff: its tags, and the trees stage_next gives (any thread)."""

    def __init__(self, request_ids: list[str], committed_lens: list[int], then=None, missed=None):
        self.request_ids, self.committed_lens = request_ids, committed_lens
        self.then, self.missed = then, missed
        self._given = threading.Event()
        self._taken = threading.Event()   # the verifier has launched from them (or decided not to)
        self._put = threading.Lock()
        self._trees = None

    def put_trees(self, trees: list[dict | None] | None) -> bool:
        """Per request its outcome trees (AheadReply.trees: None or empty where it has none), or
        None. Only the first call counts -> whether this one did."""
        with self._put:
            if self._given.is_set():
                return False
            self._trees = None if trees is None or not any(trees) else [t or None for t in trees]
            self._given.set()
            return True

    def wait(self, timeout: float):
        """The trees (None: none came, or not within `timeout` seconds)."""
        return self._trees if self._given.wait(timeout) else None

    def taken(self) -> None:
        """From the verifier's worker: the verdict's next verify is launched, or will not be."""
        self._taken.set()

    def wait_taken(self, timeout: float) -> bool:
        return self._taken.wait(timeout)


class _PreCall:
    """A drafter call a link's worker thread runs ahead of the router's: its arguments (the
    tags, and catch-up items absorbed first), and its reply once done."""

    kind = name = ""   # the engine call's kind (busy_s), the call's name in errors

    def __init__(self, tags: list[Tag], extend: list):
        self.tags, self.extend = tags, extend
        self._lock = threading.Lock()
        self._done = False
        self._reply = None
        self._waiters: list = []      # callables run once it is done (from its thread)
        self._trees = None            # a pre-ahead's trees, once on the host (before it is done)
        self._on_trees = None         # who gets them (result's on_trees), once, from either side
        self._queued = threading.Event()   # its device work is queued (or it is done)
        self.staged_into = None            # the StagedTrees its trees went to, if on_trees said so

    @property
    def done(self) -> bool:
        return self._done

    def run(self, engine) -> tuple:
        """The engine calls, in the link's worker -> (reply, `item_key`s of the extend items it
        absorbed)."""
        raise NotImplementedError

    def finish(self, reply) -> None:
        with self._lock:
            self._done, self._reply = True, reply
            waiters, self._waiters = self._waiters, []
        self._queued.set()
        for fn in waiters:
            fn()

    def mark_queued(self) -> None:
        """From the call's thread (spectandem.devices.on_queued): its drafting is on the device."""
        self._queued.set()

    def wait_queued(self, timeout: float) -> bool:
        """Waits until the call's drafting is queued on the device or the call is done, at most
        `timeout` seconds -> whether it is."""
        return self._queued.wait(timeout)

    def trees_ready(self, trees) -> None:
        """From the call's thread, as soon as its trees are on the host (drafter_draft_ahead's
        on_trees): they go to `result`'s on_trees now if it is registered, else when it is."""
        with self._lock:
            self._trees = trees
            give, self._on_trees = self._on_trees, None
        if give is not None:
            self.staged_into = give(trees)

    async def result(self, on_trees=None):
        """Its reply (None: it failed or had none), once done. `on_trees(trees)` once, from
        whichever thread has them first: the call's, as soon as its trees are on the host
        (`trees_ready`), or this one's at once if they already are."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done():
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
        with self._lock:
            trees = self._trees
            if on_trees is not None and trees is None and not self._done:
                self._on_trees = on_trees          # trees_ready gives them
            waiting = not self._done
            if waiting:
                self._waiters.append(done)
        if on_trees is not None and trees is not None:
            on_trees(trees)
        if not waiting:
            done()
        await fut
        return self._reply


class PreDraft(_PreCall):
    """One pre-draft (LocalDrafterLink.pre_draft): extend(items), then draft(tags); its reply is
    the DraftTree."""

    kind, name = "draft", "pre-draft"

    def covers(self, tags: list[Tag], num_steps) -> bool:
        """Whether draft(tags, num_steps) asks what it computed: the same tags in the same order,
        trees of the configured depth."""
        return bool(tags) and list(tags) == list(self.tags) and not any(num_steps or ())

    def run(self, engine) -> tuple:
        """A stale item or tag makes no tree (None): the router's own calls then say so."""
        from drafter.service_core import drafter_draft, drafter_extend

        try:
            unknown = drafter_extend(engine, self.extend)
        except (ValueError, KeyError):   # checked before anything is absorbed
            return None, []
        absorbed = [item_key(i) for i in self.extend if i.tag.request_id not in unknown]
        try:
            return (None if unknown else drafter_draft(engine, self.tags, None)), absorbed
        except (ValueError, KeyError):
            return None, absorbed


class PreAhead(_PreCall):
    """One pre-ahead call (LocalDrafterLink.pre_ahead): its arguments, and its reply once done."""

    kind, name = "draft_ahead", "pre-ahead"

    def covers(self, tags: list[Tag], extend) -> bool:
        """Whether draft_ahead(tags, extend) asks what it computed: each tag one of its own, and
        the catch-up items exactly its items for those requests (the same features)."""
        own = {t.request_id: t for t in self.tags}
        if not tags or any(own.get(t.request_id) != t for t in tags):
            return False
        ids = {t.request_id for t in tags}
        mine = [i for i in self.extend if i.tag.request_id in ids]
        return len(mine) == len(extend) and all(
            a.tag == b.tag and list(a.token_ids) == list(b.token_ids) and a.features is b.features
            for a, b in zip(mine, extend))

    def run(self, engine) -> tuple:
        from drafter.service_core import drafter_draft_ahead

        reply = drafter_draft_ahead(engine, self.tags, self.extend, on_trees=self.trees_ready)
        return reply, [item_key(i) for i in self.extend if i.tag.request_id not in reply.unknown]

    def restricted(self, reply, tags: list[Tag]):
        """Its reply for `tags` (a subset of its own, in their order)."""
        if [t.request_id for t in tags] == [t.request_id for t in self.tags]:
            return reply
        at = {t.request_id: i for i, t in enumerate(self.tags)}
        ids = set(at) & {t.request_id for t in tags}
        return AheadReply([reply.hits[at[t.request_id]] for t in tags], [reply.trees[at[t.request_id]] for t in tags],
                          [u for u in reply.unknown if u in ids])


def item_key(item) -> tuple[str, int]:
    """An extend item's identity for what a pre-call absorbed: (request id, committed length
    after it)."""
    return item.tag.request_id, item.tag.committed_len
