"""What the in-process links of router/links_local.py hand each other between threads, off the
router's turns:

- `StagedTrees`: one armed verify's next trees (LocalVerifierLink.arm_next): put by the router's
  stage_next or straight from the drafter's worker (direct_stage), the first put wins; taken by
  the verifier's worker, which then launches the verdict's tree.
- `PreAhead`: one draft-ahead call the verifier's worker started on the drafter link after such
  a launch (LocalDrafterLink.pre_ahead), with the arguments the router's next call will give;
  that call takes its reply.
- `PreDraft`: the same for a verdict that did not chain (a miss): the catch-up and the next
  round's draft (LocalDrafterLink.pre_draft); the router's next draft call takes its tree. Where
  the verifier launched that tree at once, a `PreAhead` queued behind it drafts ahead for it
  (`after`), as a pre-ahead does after a chained launch; the router's draft-ahead call takes it.
- `PreCalls`: the drafter link's thread that runs them.

Two holds order the threads at the Python lock on a GPU (router/links_local.py): the verdict
goes to the router only once the drafter's next call has queued its drafting (`wait_queued`),
and a pre-ahead whose trees went to an armed verify is done only once that verify launched
(`StagedTrees.wait_taken`) and the drafter's call its verdict started (`StagedTrees.follower`,
next in the same thread) has queued its drafting.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading

from router.links import EngineUnavailable
from spectandem.protocol import AheadReply, Tag
from spectandem.devices import on_queued

log = logging.getLogger("spectandem.router")


class StagedTrees:
    """One armed verify's handoff: its tags, and the trees stage_next gives (any thread).
    `prepare(trees)`, if given, runs in the putting thread as the trees are staged, before the
    verifier's worker can take them: the verifier packs the next verify's inputs then
    (VerifierEngine.prepare_next), before its verdict if the trees come first."""

    def __init__(self, request_ids: list[str], committed_lens: list[int], then=None, missed=None, prepare=None):
        self.request_ids, self.committed_lens = request_ids, committed_lens
        self.then, self.missed, self.prepare = then, missed, prepare
        self._given = threading.Event()
        self._taken = threading.Event()   # the verifier has launched from them (or decided not to)
        self._put = threading.Lock()
        self._trees = None
        self.follower = None   # the drafter's call the verdict started (set before `taken`), if any

    def put_trees(self, trees: list[dict | None] | None) -> bool:
        """Per request its outcome trees (AheadReply.trees: None or empty where it has none), or
        None. Only the first call counts -> whether this one did."""
        with self._put:
            if self._given.is_set():
                return False
            self._trees = None if trees is None or not any(trees) else [t or None for t in trees]
            if self.prepare is not None and self._trees is not None:
                try:   # before the verifier's worker can take them (it may be waiting)
                    self.prepare(self._trees)
                except Exception:   # packing ahead is only a shortcut: the verdict's launch packs its own
                    log.exception("preparing the next verify's inputs failed")
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
    cancelled = False  # pending still when the router went another way (PreCalls._claim)

    def __init__(self, tags: list[Tag], extend: list):
        self.tags, self.extend = tags, extend
        self._lock = threading.Lock()
        self._done = False
        self._reply = None
        self._waiters: list = []      # callables run once it is done (from its thread)
        self._trees = None            # a pre-ahead's trees, once on the host (before it is done)
        self._on_trees = None         # who gets them (result's on_trees), once, from either side
        self._queued = threading.Event()   # its device work is queued (or it is done)
        self._on_queued: list = []          # callables run once it is (`when_queued`)
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
        self.mark_queued()
        for fn in waiters:
            fn()

    def mark_queued(self) -> None:
        """From the call's thread (spectandem.devices.on_queued): its drafting is on the device."""
        with self._lock:
            self._queued.set()
            fns, self._on_queued = self._on_queued, []
        for fn in fns:
            fn()

    def when_queued(self, fn) -> None:
        """`fn()` once the call's drafting is queued on the device or the call is done: from the
        call's thread then, or from this one at once if it already is."""
        with self._lock:
            if not self._queued.is_set():
                self._on_queued.append(fn)
                return
        fn()

    def wait_queued(self, timeout: float) -> bool:
        """Waits until the call's drafting is queued on the device or the call is done, at most
        `timeout` seconds -> whether it is."""
        return self._queued.wait(timeout)

    def trees_ready(self, trees) -> None:
        """From the call's thread, as soon as its trees (a pre-ahead's) or tree (a pre-draft's)
        are on the host: they go to `on_ready`'s taker now if one is registered, else when it is."""
        with self._lock:
            self._trees = trees
            give, self._on_trees = self._on_trees, None
        if give is not None:
            self._given(give(trees))

    def _given(self, taken) -> None:
        """What the taker of its trees returned, when `trees_ready` gave them (a pre-ahead's:
        the StagedTrees they went to, or None)."""
        self.staged_into = taken

    def on_ready(self, fn) -> None:
        """`fn(trees)` once, from whichever thread has them first: the call's, as soon as they
        are on the host (`trees_ready`, before the call is done), or this one's at once if they
        already are; never if the call makes none."""
        with self._lock:
            trees = self._trees
            if trees is None and not self._done:
                self._on_trees = fn
        if trees is not None:
            fn(trees)

    async def result(self, on_trees=None):
        """Its reply (None: it failed or had none), once done; `on_ready(on_trees)` first."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done():
            loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(None))
        if on_trees is not None:
            self.on_ready(on_trees)
        with self._lock:
            waiting = not self._done
            if waiting:
                self._waiters.append(done)
        if not waiting:
            done()
        await fut
        return self._reply


class PreDraft(_PreCall):
    """One pre-draft (LocalDrafterLink.pre_draft): extend(items), then draft(tags); its reply is
    the DraftTree."""

    kind, name = "draft", "pre-draft"
    launched = False   # its taker (LocalVerifierLink._launch_missed) launched the tree from this thread
    launched_early = False   # its early taker launched it from the device tokens (`on_device`)

    def __init__(self, tags: list[Tag], extend: list):
        super().__init__(tags, extend)
        self._device_taker = None
        self._device_seen = False

    def _given(self, taken) -> None:
        self.launched = taken is True

    def on_device(self, fn) -> bool:
        """`fn(tree, tokens, ready)` from the call's thread once its drafting is queued and before
        the host has the tree (DrafterEngine.draft's on_device: argmax chains), if that has not
        happened yet -> whether it was registered in time."""
        with self._lock:
            if self._device_seen:
                return False
            self._device_taker = fn
        return True

    def _device_ready(self, tree, tokens, ready) -> None:
        with self._lock:
            self._device_seen = True
            taker = self._device_taker
        if taker is not None:
            self.mark_queued()   # a verifier's worker waiting on that lets go first: the taker needs the verifier
            self.launched_early = taker(tree, tokens, ready) is True

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
            tree = None if unknown else drafter_draft(engine, self.tags, None, on_device=self._device_ready)
        except (ValueError, KeyError):
            return None, absorbed
        if tree is not None:
            # Its drafting is done (a verifier's worker waiting on that lets go first: the taker
            # below needs the verifier), then the tree to `on_ready`'s taker (the verifier
            # link launches it).
            self.mark_queued()
            self.trees_ready(tree)
        return tree, absorbed


class PreAhead(_PreCall):
    """One pre-ahead call (LocalDrafterLink.pre_ahead): its arguments, and its reply once done."""

    kind, name = "draft_ahead", "pre-ahead"

    def __init__(self, tags: list[Tag], extend: list, after: PreDraft | None = None):
        super().__init__(tags, extend)
        # `after`: the miss's pre-draft this one follows: it drafts ahead only for a tree the
        # verifier is already verifying (`PreDraft.launched`), and not once cancelled (the
        # router's draft did not take that tree). Skipped, its reply is None.
        self.after = after

    def skipped(self) -> bool:
        return self.cancelled or (self.after is not None and not self.after.launched)

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

        if self.skipped():
            return None, []
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


class PreCalls:
    """The drafter link's pre-call thread (router/links_local.py LocalDrafterLink): pre-calls run
    there one after another, each an engine call (`_call`); the link's own calls claim them
    (`_claim`) and skip what they absorbed (`_unabsorbed`). `launch_first_s`: how long a
    pre-ahead whose trees went to an armed verify waits for that launch before it is done."""

    launch_first_s = 0.0

    def _init_pre_calls(self) -> None:
        self._pending: list = []   # the last pre-calls started (a pre-draft may have its pre-ahead), until claimed
        self._last_pre = None      # the last pre-call started: calls go after it
        self._pre_jobs: queue.SimpleQueue | None = None
        self._absorbed: set[tuple[str, int]] = set()  # extend items a pre-call absorbed (id, length)
        self._pre_failed: tuple[str, Exception] | None = None   # (the pre-call's name, its error)

    def _start(self, *jobs):
        """Queues these pre-calls, in order; earlier unclaimed ones stop pending -> the first."""
        self._pending = list(jobs)
        self._last_pre = jobs[-1]
        if self._pre_jobs is None:
            self._pre_jobs = queue.SimpleQueue()
            threading.Thread(target=self._pre_worker, name="drafter-pre-call", daemon=True).start()
        for job in jobs:
            self._pre_jobs.put(job)
        return jobs[0]

    def _pre_worker(self) -> None:
        while True:
            job = self._pre_jobs.get()
            try:
                reply = self._call(job.kind, self._pre_run, job)
            except Exception as exc:    # the engine failed: the next call says so
                self._pre_failed = (job.name, exc)
                job.finish(None)
            else:
                follower = None
                if job.staged_into is not None and self.launch_first_s > 0:
                    if job.staged_into.wait_taken(self.launch_first_s):   # the verifier's launch first
                        follower = job.staged_into.follower
                if hasattr(follower, "when_queued"):
                    # Then the call the verdict started (queued behind this one, next in this
                    # thread) queues its drafting before the router's turn on this reply: at the
                    # Python lock that turn would stretch the call's host work.
                    follower.when_queued(lambda job=job, reply=reply: job.finish(reply))
                else:
                    job.finish(reply)

    def _pre_run(self, job):
        with on_queued(job.mark_queued):
            reply, absorbed = job.run(self.engine)
        self._absorbed.update(absorbed)
        return reply

    def _claim(self, cls, *args):
        """The first pending pre-call if it is a `cls` (which then stops pending) and covers a
        call of these arguments; None otherwise. One that does not cover ends the pending ones:
        the router went another way (those queued behind it, not started yet, are skipped)."""
        job = self._pending[0] if self._pending else None
        if not isinstance(job, cls):
            return None
        if job.covers(*args):
            self._pending.pop(0)
            return job
        for other in self._pending[1:]:
            other.cancelled = True
        self._pending = []
        return None

    def _absorbing(self, items: list):
        """A pending pre-call whose catch-up items include every one of `items` (the same tags
        and features: a miss's pre-draft, for the router's extend of that verdict), or None."""
        keys = {item_key(i): i for i in items}
        for job in self._pending:
            mine = {item_key(i): i for i in job.extend}
            if keys and all(k in mine and mine[k].features is i.features for k, i in keys.items()):
                return job
        return None

    def _raise_pre_failure(self) -> None:
        """A failed pre-call (pre-ahead, pre-draft) left the engine in an unknown state: the next
        call fails as the engine's own failure (EngineUnavailable: the router takes the drafter
        down), once."""
        if self._pre_failed is not None:
            (name, exc), self._pre_failed = self._pre_failed, None
            self._absorbed.clear()
            raise EngineUnavailable(f"{name} failed: {exc}") from exc

    def _unabsorbed(self, items: list) -> list:
        """In the worker, after any pre-call: the items no pre-call absorbed yet."""
        self._raise_pre_failure()
        if not self._absorbed:
            return items
        keep = [i for i in items if item_key(i) not in self._absorbed]
        self._absorbed.difference_update(item_key(i) for i in items)
        return keep


def item_key(item) -> tuple[str, int]:
    """An extend item's identity for what a pre-call absorbed: (request id, committed length
    after it)."""
    return item.tag.request_id, item.tag.committed_len
