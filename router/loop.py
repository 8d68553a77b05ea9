"""The router: its loop, the rounds of each pipeline mode, and what it does when an engine fails.

One turn of the loop (`_loop`): `_settle` (release what ended, and what an engine that answers
still holds for the router), `_schedule` (carry out router/scheduler.py's plan: fail what can
never fit, preempt, pick the requests to admit), then `_round`: admit (`_admit`: prefill on the
verifier, stream the first token, prefill on the drafter), re-prefill the drafter with the
requests it does not hold (`_resync`) and run one round in the mode router/pipeline.py chooses.
By default new requests are prefilled in the round's verify step (`_mixes`). With
RouterConfig.admit_beside_draft (serve --overlap-admission, off by default), a sequential round
below LARGE_BATCH running requests admits while the drafter drafts for the running requests: the
verifier prefills the new requests meanwhile, they join the round's verify as plain rows, and
their drafter prefill runs while the verifier verifies (`_admits_beside_draft`). The modes:
- sequential (`_sequential_round`): `_draft` (a tree for the requests the drafter holds, after
  their catch-up with the last round's verdict, in one drafter call; the others decode
  plainly), `_verify` (one batched verify of drafted and plain rows) and `_apply` (commit and
  stream each verdict, drop stale ones, hold the drafter's catch-up back for the next call).
  With a tree channel between engines in other processes (RouterConfig.tree_channel) the draft
  call and the verify go out together and the drafter sends the trees to the verifier itself
  (`_posts_trees`): the round waits on one crossing to an engine process, not two in a row;
- ahead (`_sequential_round(ahead=True)`): the same, while the verifier verifies the drafter
  fills its outcome cache (`_draft_ahead`), so a hit's next tree is ready with the verdict;
- ping-pong (`_pingpong_round`): two halves, the drafter on one while the verifier verifies the
  other;
- short drafts ("short:N", `_draft`'s steps) and plain (`_draft` drafts for no request whose
  tokens do not depend on the tree).
The acceptance rule is the verifier's: a `Verdict` carries the accepted draft tokens
and the bonus token; `_commit` streams them, cut at EOS, a stop string, max_tokens or the context.

Invariants:
- a request's committed length only grows; tokens are streamed once, in order, never taken back;
- drafts are provisional until a verdict for their (epoch, committed length) arrives;
- the verifier is never made to wait on a missing draft: a request without one decodes plainly
  (its tree is just the root) in the same verify batch. The exception is a round whose trees go
  drafter -> verifier over the tree channel (RouterConfig.tree_channel): there the verify waits
  for the trees the drafter is drafting, at most `drafter_timeout` (and not at all once the
  drafter is gone), and the requests of trees that did not come get no verdict that round;
- every admitted request ends in exactly one terminal event (finish or failure), and is released
  on both sides;
- a reply whose (epoch, committed length) is not the request's own is dropped and counted, never
  applied.

Preemption (`_preempt`): frees the request's KV on both sides, keeps its committed tokens, bumps
its epoch and requeues it ahead of new requests. The drafter keeps the request's pending next
tree, if it has one ready (draft ahead), with its draft probabilities, tagged with the committed
length. On resume the verifier rebuilds its KV from the committed tokens (nothing is resampled),
the drafter is re-prefilled from the verifier's features, and the kept tree is the next draft if
its committed length still matches.

The drafter is optional at every moment: if it is absent, slow (no answer within
`drafter_timeout`) or failing, the round goes on without it; the requests it held are marked
unsynced and are re-prefilled on the drafter (from the verifier's recomputed features) once it
answers again. A drafter that fails or is too slow only takes the drafts out of the round; a
verifier that fails ends the round and its requests (UNAVAILABLE).

Failed engines are probed by a watcher task of their own (`_watch`), every probe_interval, off
the round loop: a hung drafter costs the rounds one `drafter_timeout`, and a verifier that comes
back is found while the router is idle. Whatever an engine may still hold for requests the router
no longer runs there (a call that failed or timed out, a request ended by a verifier failure) is
kept in `_release_v` / `_release_d` and released as soon as that engine answers: before the
watcher declares it back, or at the next turn of the loop while it is up.

Request ids are unique among live requests: `submit` refuses an id in use (DuplicateRequest,
ALREADY_EXISTS on the wire), and a request whose id an engine still holds for an ended one
waits to be admitted until that is released. An engine's refusal of one request at admission
fails that request alone.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import random
import time
import uuid

from router.capacity import KvBudget
from router.detok import Detokenizer
from router.links import DrafterLink, DuplicateRequest, EngineUnavailable, VerifierLink
from router.pipeline import LARGE_BATCH, ModeChooser, SpeculationSwitch
from router.requests import (Failure, StreamEvent, RequestStatus, RouterConfig, RouterCounters,  # noqa: F401 (re-exported)
                             ServedRequest)
from router.scheduler import Running, Scheduler, Waiting
from spectandem.config import SamplingParams
from spectandem.protocol import (DraftHandle, DrafterPrefillItem, ExtendItem, PlainItem, Tag, TreeRoute,
                                 VerifierPrefillItem)
from spectandem.messages import StaleMessage, trees_from_ready
from spectandem.reference import take_tokens

log = logging.getLogger("spectandem.router")

# Plain rounds hold a request's catch-ups back for its next draft; at this many the router sends
# them. Features that travel over the feature channel wait for the drafter in a mailbox that
# keeps the last 32 messages, one a verifier call (spectandem/channel/receiver.py).
BACKLOG_ROUNDS = 8
# A detached request rejoins the drafter once fewer than LARGE_BATCH run only while it may still
# generate this many tokens: a rejoin recomputes the target features of its whole context (a
# target forward, verifier/engine.py `features`) and prefills the drafter with them while the
# batch waits, which a request near its end does not win back (at the tail of a batch of 64
# requests of 128 tokens on the H100, such rejoins halved the gRPC backend's throughput).
REJOIN_MIN_TOKENS = 128
# Clients send concurrent requests as a wave whose calls land a little apart. While they are still
# landing (the last came less than ARRIVAL_GAP_S ago), admission waits for the rest, at most
# ARRIVAL_WAIT_S, so that one prefill takes the wave instead of its first call alone followed,
# a round later, by the others.
ARRIVAL_GAP_S = 0.002
ARRIVAL_WAIT_S = 0.010
AHEAD_UNANSWERED_ROUNDS = 3   # "ahead" rounds in a row without a hit or miss: the drafter does not draft ahead
# A round whose trees go over the tree channel: the verifier waits for them this much longer than
# the router waits for the drafter's reply (the trees leave the drafter before its reply).
TREE_WAIT_MARGIN_S = 2.0
# Rounds without the tree channel after a drafter said it could not post (its channel is down,
# say after a restart), before its info is asked whether its end is up again.
TREE_RETRY_ROUNDS = 256


async def _within(call, seconds: float | None):
    """`asyncio.wait_for(call, seconds)`, the call sent before this task yields. On Python 3.11
    `wait_for` runs the call in a task of its own, which starts only after the callbacks already
    queued: a round's drafter call went out after the streams that the last commit woke had
    written to their clients, and the drafter idled meanwhile (1 ms a round on 2 CPU cores, the
    demo pair in-process). `asyncio.timeout` runs it in this task, as 3.12's `wait_for` does."""
    timeout = getattr(asyncio, "timeout", None)
    if timeout is None:   # Python 3.10
        return await asyncio.wait_for(call, seconds)
    async with timeout(seconds):
        return await call


class Router:
    def __init__(self, verifier: VerifierLink, drafter: DrafterLink | None, tokenizer, cfg: RouterConfig):
        self.verifier, self.drafter, self.tokenizer, self.cfg = verifier, drafter, tokenizer, cfg
        self.waiting: list[ServedRequest] = []
        self.running: list[ServedRequest] = []
        self.serving = True                      # the verifier answers
        self.drafter_up = drafter is not None
        self._wake = asyncio.Event()
        self._stopping = False   # stop(): the loop ends at its next turn even if the cancel is lost
        self._verified = False   # whether this turn of the loop sent a verify (and so yielded)
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._live: dict[str, ServedRequest] = {}   # request id -> the request using it (not yet done)
        self._admitted = 0
        self._last_arrival = float("-inf")   # when the latest request was submitted (time.monotonic)
        # When the last round ended (time.perf_counter), while the router went straight on to the
        # next: `_round` times a round from there. None after an idle wait.
        self._round_ended: float | None = None
        self._tokens_committed = 0
        self._modes = ModeChooser(cfg)
        self._mode = "sequential"
        self._switch = SpeculationSwitch(cfg)
        self._detaching = False           # new requests are admitted without the drafter
        self.on_serving_change = None            # callback(bool), e.g. to update gRPC health
        # Ids an engine may still hold that the router no longer runs there (a call that failed or
        # timed out, requests ended by a failure): released once that engine answers.
        self._release_v: set[str] = set()
        self._release_d: set[str] = set()
        # Ended requests whose release runs in the background (`_release_soon`), and those calls:
        # each release as a whole, and its call to each engine ("verifier", "drafter").
        self._ending: list[ServedRequest] = []
        self._releasing: set[asyncio.Task] = set()
        self._releasing_on: dict[str, set[asyncio.Task]] = {"verifier": set(), "drafter": set()}
        self.counters = RouterCounters()
        self.kv = KvBudget(cfg, drafter is not None)
        self.scheduler = Scheduler(self.kv, cfg.max_running)
        # Round state (the rounds section below).
        self._ahead_unanswered = 0       # "ahead" rounds in a row whose draft-ahead answered neither hit nor miss
        self._capped_plain = False       # this round's plain steps were cut by the requests' ends
        # This round's drafted requests: id -> (the request, its tokens before the round).
        self._drafted: dict[str, tuple[ServedRequest, int]] = {}
        self._draft_failed = frozenset()   # ids whose draft this round came back unusable (stale)
        self._joining = frozenset()        # ids admitted beside this round's draft (their plain row: a plain round)
        # Tree channel rounds (`_posts_trees`): the next round id (unique to this router), and the
        # round from which the channel is tried again after a drafter could not post.
        self._tree_round = random.randrange(1, 1 << 62)
        self._trees_off_until = 0
        # (tree round, ids) of the last round whose verdicts went to the drafter over the tree
        # channel, for the next round only (`_early_trees`), and that of the round before this one.
        self._verdicts_after: tuple[int, frozenset] | None = None
        self._prev_verdicts: tuple[int, frozenset] | None = None
        # Stream events of committed tokens not yet handed to their streams (`_deliver`).
        self._outbox: list[tuple] = []
        # Listeners get (event, request, data): "admitted", "tokens" (data: number of new tokens,
        # the first time also {"first": True}), "finished" (data: finish reason),
        # "failed" (data: status code name), "cancelled". Metrics and logs hook in here.
        self.listeners: list = []

    # ---------------------------------------------------------------- public side

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._loop())
        self._watcher = loop.create_task(self._watch())

    async def stop(self) -> None:
        if self._watcher:
            self._watcher.cancel()
        if self._task:
            # Cancelling alone is not enough: on Python 3.11 an `asyncio.wait_for` whose inner call
            # finishes as the cancel arrives returns the result and drops the cancel, and the loop
            # then waits on `_wake` for ever. The flag ends it at its next turn either way.
            self._stopping = True
            self._wake.set()
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._deliver()
        for r in self.waiting + self.running:
            self._finish_failure(r, Failure("UNAVAILABLE", "the server is shutting down"))
        try:
            await asyncio.wait_for(self._releases_landed(), self.cfg.probe_interval * 5)
            await asyncio.wait_for(self._forget_kept(self.waiting), self.cfg.probe_interval * 5)
            # A dying or restarting engine must not hold shutdown: the engines go away next anyway.
            await asyncio.wait_for(self._release([r for r in self.running if r.on_verifier or r.on_drafter]),
                                   self.cfg.probe_interval * 5)
            await asyncio.wait_for(self._settle(), self.cfg.probe_interval * 5)
        except asyncio.TimeoutError:
            log.warning("engines did not confirm releases at shutdown")

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> ServedRequest:
        """Queues a request. Raises EngineUnavailable while the verifier is down, DuplicateRequest
        when `request_id` names a request that has not ended."""
        if not self.serving:
            raise EngineUnavailable("the verifier is not available")
        if request_id and self.in_use(request_id):
            raise DuplicateRequest(f"request_id {request_id!r} is already in use by a request that has not ended")
        req = ServedRequest(request_id or uuid.uuid4().hex, list(prompt_ids), params, params.resolved_seed(),
                            Detokenizer(self.tokenizer, params.stop))
        self._live[req.request_id] = req
        self.waiting.append(req)
        self._last_arrival = time.monotonic()
        self._wake.set()
        return req

    async def warm_up(self, batch_sizes: list[int], vocab_size: int, max_tokens: int = 128, say=None,
                      stop: asyncio.Event | None = None) -> None:
        """Runs greedy requests at each batch size in turn (prompts of several lengths), so that the
        engines capture the graphs of every batch bucket and "auto" meets each of its modes once
        before the first client does; then forgets what the warm-up's text told "auto" (it keeps each
        mode's speed: ModeChooser.forget_text) and the counters. Serving's start (router/serve.py),
        before the port opens. Once `stop` is set no further batch size starts (serve told to end)."""
        lengths = (16, 48, 96, 200)
        for i, b in enumerate(batch_sizes, 1):
            if stop is not None and stop.is_set():
                break
            if say is not None:
                say(f"warming up: {b} requests at once ({i}/{len(batch_sizes)})")
            reqs = []
            for j in range(b):
                n = lengths[j % len(lengths)]
                prompt = [1 + (7 * j + 13 * k) % (vocab_size - 1) for k in range(n)]
                reqs.append(self.submit(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=j),
                                        f"warm-up-{b}-{j}"))
            for r in reqs:
                while True:
                    ev = await r.events.get()
                    if isinstance(ev, Failure) or ev.finish_reason is not None:
                        break
                if r.status is not RequestStatus.FINISHED:
                    why = f": {ev.code}: {ev.message}" if isinstance(ev, Failure) else ""
                    raise RuntimeError(f"a warm-up request did not finish ({r.status.value}{why})")
        while self.running or self._releasing or self._releases_due():   # the engines let the last ones go
            await asyncio.sleep(0.005)
        self._modes.forget_text()   # the engines' speeds stay; what the warm-up's drafts committed goes
        self._switch = SpeculationSwitch(self.cfg)   # the warm-up's drafts say nothing of a client's
        self.counters = RouterCounters()

    def in_use(self, request_id: str) -> bool:
        """Whether a request that has not ended uses this id."""
        return request_id in self._live

    def _ended(self, r: ServedRequest, status: RequestStatus) -> None:
        """Ends the request: its id may be used again (admitted once the engines let it go)."""
        r.status = status
        if self._live.get(r.request_id) is r:
            del self._live[r.request_id]

    def _emit(self, event: str, req: ServedRequest, data=None) -> None:
        for fn in self.listeners:
            try:
                fn(event, req, data)
            except Exception:  # an observer must never break serving
                log.exception("listener failed on %s", event)

    def cancel(self, req: ServedRequest) -> None:
        """Stops all work for the request (client cancel, disconnect or deadline)."""
        if not req.done:
            self.counters.requests_cancelled += 1
            self._emit("cancelled", req)
            self._ended(req, RequestStatus.CANCELLED)
            self._deliver()   # the tokens it committed come first
            req.events.put_nowait(StreamEvent([], "", finish_reason="abort", stats=req.stats()))
            self._wake.set()

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- the loop, scheduling, admission

    async def _loop(self) -> None:
        while not self._stopping:
            if not self.waiting and not self.running and not self._releases_due():
                self._deliver()
                self._wake.clear()
                self._round_ended = None
                await self._wake.wait()
                if self._stopping:
                    return
            self._verified = False
            admit: list[ServedRequest] = []
            try:
                await self._let_arrivals_land()
                await self._settle()
                admit = await self._schedule()
                await self._round(admit)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not leave clients waiting forever
                log.exception("round failed")
                # Those being admitted are off the queue and may not have joined the running batch.
                running, failed = self.running, {id(r): r for r in self.running + self.waiting + admit}
                self.running, self.waiting = [], []   # before the release: requests may arrive meanwhile
                for r in failed.values():
                    self._finish_failure(r, Failure("INTERNAL", f"round failed: {exc}"))
                joined = {id(r) for r in running}
                self._release_v.update(r.request_id for r in admit if id(r) not in joined)   # it may hold some
                await self._release(running)
            # A turn that verified yielded while the verifier worked. No yield here: where the next
            # turn calls no engine before its verify, the streams this turn's commits woke write
            # to their clients while that verify is in flight, not before it is sent. A turn
            # without a verify may not have yielded at all.
            if not self._verified:
                self._deliver()
                await asyncio.sleep(0)

    async def _let_arrivals_land(self) -> None:
        """Waits while a wave of new requests is still landing (ARRIVAL_GAP_S, ARRIVAL_WAIT_S)."""
        if not self.waiting:
            return
        start = time.monotonic()
        if time.monotonic() - self._last_arrival < ARRIVAL_GAP_S:
            self._deliver()   # nothing runs on the engines meanwhile
        while time.monotonic() - self._last_arrival < ARRIVAL_GAP_S and time.monotonic() - start < ARRIVAL_WAIT_S:
            self._round_ended = None   # a wait, not a mode's work
            await asyncio.sleep(ARRIVAL_GAP_S / 4)

    async def _release_finished(self) -> None:
        """Releases the requests that ended: in the background where the next round fits both KV
        pools with them still held (`_release_soon`), else now."""
        finished = [r for r in self.running if r.done]
        if not finished:
            return
        self.running = [r for r in self.running if not r.done]
        if self.kv.fits([r.committed_len for r in self.running + self._ending + finished]):
            self._release_soon(finished)
        else:
            await self._release(finished)

    def _release_soon(self, reqs: list[ServedRequest]) -> None:
        """Releases `reqs` (ended) without waiting: the calls go with the round's first engine call
        rather than before it, where the GPU would wait for them and for whatever else the event
        loop runs meanwhile (the streams that the last commit woke). Their ids count as held at
        once (no new request takes one before it is released: `_schedule`); whatever prefills
        waits for the calls first, on the engine it prefills on (`_releases_landed`): a verify
        that carries prefills need not wait for the drafter's release, which queues behind the
        round's draft call there."""
        ids_v = [r.request_id for r in reqs if r.on_verifier]
        for r in reqs:
            r.on_verifier = False
        self._release_v.update(ids_v)   # pending until confirmed (`_release`)
        self._ending += reqs
        on_v = asyncio.ensure_future(self._release_on_verifier(ids_v))
        on_d = asyncio.ensure_future(self._release_on_drafter(reqs, False))
        task = asyncio.ensure_future(asyncio.gather(on_v, on_d))
        self._releasing.add(task)
        for side, t in (("verifier", on_v), ("drafter", on_d)):
            self._releasing_on[side].add(t)
            t.add_done_callback(self._releasing_on[side].discard)

        def landed(t: asyncio.Task) -> None:
            self._releasing.discard(t)
            self._ending = [r for r in self._ending if r not in reqs]
            if not t.cancelled() and t.exception() is not None:
                log.error("releasing %d ended requests failed: %r", len(reqs), t.exception())
        task.add_done_callback(landed)

    async def _releases_landed(self, engine: str | None = None) -> None:
        """Waits for the background releases (`_release_soon`) on `engine` ("verifier" or
        "drafter"; None: both): before a prefill there, so that the KV and the slots of ended
        requests are free, and before shutdown."""
        pending = self._releasing if engine is None else self._releasing_on[engine]
        while pending:
            live = [t for t in pending if not t.done()]
            if live:
                await asyncio.gather(*live, return_exceptions=True)
            else:
                # Done, their done callbacks (which take them out of `pending`) still queued: a
                # gather of done tasks returns without yielding to the event loop, so those
                # callbacks would never run and this loop would hold the thread for good.
                await asyncio.sleep(0)

    async def _schedule(self) -> list[ServedRequest]:
        """Carries out the scheduler's plan (router/scheduler.py): fails the requests that can
        never fit, preempts until the next round fits both KV pools; returns the requests to
        admit, taken off the queue (`_round` admits them)."""
        await self._release_finished()
        cancelled = [r for r in self.waiting if r.status is RequestStatus.CANCELLED]
        await self._forget_kept(cancelled)
        self.waiting = [r for r in self.waiting if r.status is not RequestStatus.CANCELLED]
        held = self._release_v | {r.request_id for r in self.running}   # ids an engine still holds
        plan = self.scheduler.plan([Running(r.request_id, r.committed_len, r.admit_seq) for r in self.running],
                                   [Waiting(r.request_id, r.committed_len, r.resuming) for r in self.waiting], held)
        waiting = {r.request_id: r for r in self.waiting}
        batch = [waiting[i] for i in plan.admit]
        for rid, why in plan.fail_waiting:
            r = waiting[rid]
            self.waiting.remove(r)
            self._finish_failure(r, Failure("RESOURCE_EXHAUSTED", why))
            await self._forget_kept([r])
        await self._make_room(plan)
        for r in batch:
            self.waiting.remove(r)
        return batch

    async def _make_room(self, plan=None) -> None:
        """Carries out the plan's preemptions and its failure of a request that alone outgrows the
        pools; without a plan, plans them for the running requests as they are now (the round
        checks again after admission: a new request's first token may take a block more)."""
        if plan is None:
            plan = self.scheduler.plan([Running(r.request_id, r.committed_len, r.admit_seq) for r in self.running], [])
        running = {r.request_id: r for r in self.running}
        for rid in plan.preempt:
            await self._preempt(running[rid])
        for rid, why in plan.fail_running:
            r = running[rid]
            self._finish_failure(r, Failure("RESOURCE_EXHAUSTED", why))
            self.running = [x for x in self.running if x is not r]
            await self._release([r])

    async def _preempt(self, victim: ServedRequest) -> None:
        """Frees the request's KV on both sides (the drafter keeps its ready next tree), keeps its
        committed tokens and requeues it ahead of new requests, under a new epoch."""
        self.running.remove(victim)
        await self._releases_landed()   # the resume's re-prefill needs what they free
        await self._release([victim], keep_draft=True)
        victim.epoch += 1
        if not victim.done:
            victim.status = RequestStatus.PREEMPTED
        self.counters.preemptions += 1
        first_new = next((i for i, w in enumerate(self.waiting) if not w.resuming), len(self.waiting))
        self.waiting.insert(first_new, victim)
        log.info("preempted %s at committed length %d (epoch %d)", victim.request_id, victim.committed_len,
                 victim.epoch)

    async def _admit(self, batch: list[ServedRequest], drafter_later: bool = False):
        """Prefills the planned requests on the verifier, streams their first tokens (resumed
        ones commit nothing new) and prefills them on the drafter. `drafter_later`: returns the
        drafter's prefill (the requests, their features) for the caller to send, None when there
        is none, instead of sending it."""
        resumed = {r.request_id for r in batch if r.resuming}
        detach = self._detach(batch)
        batch, results = await self._prefill_verifier(batch, self._admission_features(batch, detach), resumed)
        return await self._after_prefill(batch, results, detach, resumed, drafter_later)

    def _detach(self, batch: list[ServedRequest]) -> set[str]:
        """The ids of the requests of `batch` admitted without the drafter: where "auto" settled
        on plain at this batch size (router/pipeline.py), those whose drafts are deterministic.
        A request whose drafts are sampled is always admitted with it: its seeded tokens follow
        its drafts, and a plain row would draw others (what a seed gives must not depend on
        load)."""
        settled = self.drafter is not None and self._modes.settled_plain(len(self.running) + len(batch))
        if settled != self._detaching:
            self._detaching = settled
            log.info("auto pipeline: new requests whose drafts are deterministic are admitted %s the drafter "
                     "(%d running)", "without" if settled else "with", len(self.running) + len(batch))
        return {r.request_id for r in batch if self._invisible_when_plain(r)} if settled else set()

    def _detach_running(self) -> None:
        """Where "auto" has settled on plain at this batch size, the running requests whose drafts
        are deterministic leave the drafter too, as those admitted since do (`_detach`): their
        plain rounds then carry no target features and no held-back catch-ups, and the drafter
        frees their slots (released at the next `_settle`). Kept ready to speculate until they ended,
        they had a speculating server kept on plain serve 0.89 of a plain server at 64 running on
        the H200, 0.93-0.97 once they left (benchmarks/results/auto-settled-plain-h200.txt). They
        rejoin as detached admissions do (`_resync`)."""
        if not (self.drafter_up and self._modes.settled_plain(len(self.running))):
            return
        leaving = [r for r in self.running if r.on_drafter and not r.done and self._invisible_when_plain(r)]
        for r in leaving:
            r.on_drafter, r.detached = False, True
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None
            self._release_d.add(r.request_id)
        if leaving:
            self.counters.detached_running += len(leaving)
            log.info("auto pipeline: %d running requests leave the drafter (plain settled at %d running)",
                     len(leaving), len(self.running))

    def _admission_features(self, batch: list[ServedRequest], detach: set[str]) -> bool:
        """Whether the verifier's prefill of `batch` returns target features: some request of it
        joins the drafter."""
        return self.cfg.want_features and any(r.request_id not in detach for r in batch)

    async def _after_prefill(self, batch: list[ServedRequest], results, detach: set[str], resumed: set[str],
                             drafter_later: bool = False):
        """`_admit` once the verifier has prefilled `batch` (`results` in its order): the
        requests join the running batch, their first tokens stream, and those not in `detach`
        are prefilled on the drafter (or that prefill is returned: `_admit`'s `drafter_later`),
        but for those whose drafter prefill the verifier sent with its verify step's verdicts
        (`with_verdicts`: `_sequential_round`), which are on the drafter as after a prefill call."""
        if not batch:
            return None
        for r in batch:
            r.detached = r.request_id in detach
        self.counters.detached_admissions += sum(r.detached for r in batch)
        for r in batch:
            r.on_verifier = True
            if r.admit_seq < 0:
                self._admitted += 1
                r.admit_seq = self._admitted
                self.counters.requests_admitted += 1
                self._emit("admitted", r)
        self.running.extend(batch)
        features = {}
        for r, res in zip(batch, results):
            if not r.done:
                r.status = RequestStatus.RUNNING
            if r.request_id in resumed:  # resumed: nothing new to commit
                self.counters.resumes += 1
                features[r.request_id] = res.features
            elif self._commit(r, [res.first_token_id]):
                features[r.request_id] = res.features
        live = [r for r in batch if not r.done and not r.detached]
        handed = {res.tag.request_id for res in results if res.with_verdicts}
        if handed and self.drafter_up:
            # Those that ended at their first token are released on the drafter too (it may
            # have taken their prefill, or skips it once they are released: drafter/next_trees.py).
            for r in batch:
                if r.request_id in handed:
                    r.on_drafter, r.drafter_kept = True, False
            self.counters.prefills_with_verdicts += sum(r.request_id in handed for r in live)
            live = [r for r in live if r.request_id not in handed]
        later = None
        if self.drafter_up and live:
            later = (live, [features[r.request_id] for r in live])
            if not drafter_later:
                await self._drafter_prefill(*later)
                later = None
        await self._release([r for r in batch if r.done])
        return later

    @staticmethod
    def _prefill_item(r: ServedRequest, resume: bool) -> VerifierPrefillItem:
        tag = Tag(r.request_id, r.epoch, r.committed_len if resume else len(r.prompt_ids))
        return VerifierPrefillItem(tag, r.prompt_ids + r.tokens if resume else r.prompt_ids, r.params,
                                   r.seed, resume=resume)

    async def _prefill_verifier(self, batch: list[ServedRequest], want_features: bool, resumed: set[str]):
        """-> (the requests the verifier took, its results in their order); `resumed`: the ids of
        preempted requests, prefilled with their committed tokens. A refusal (ValueError)
        of the batch is retried request by request, so that only the refused ones fail; an
        unavailable verifier fails them all (and everything waiting)."""
        await self._releases_landed("verifier")
        groups = [batch]
        taken, results = [], []
        while groups:
            group = groups.pop(0)
            try:
                call = self.verifier.prefill([self._prefill_item(r, r.request_id in resumed) for r in group],
                                             want_features)
                self._deliver()   # while the prefill runs
                out = await call
            except EngineUnavailable as exc:
                self._release_v.update(r.request_id for r in group + taken)   # it may hold some
                self._verifier_failed(self.running + group + [r for g in groups for r in g], exc)
                self.running = []
                for r in taken:
                    self._finish_failure(r, Failure("UNAVAILABLE", "the verifier is unavailable; try again"))
                return [], []
            except ValueError as exc:
                if len(group) > 1:
                    groups[:0] = [[r] for r in group]
                    continue
                log.warning("the verifier refused request %s: %s", group[0].request_id, exc)
                self._finish_failure(group[0], Failure("INVALID_ARGUMENT", f"the verifier refused the request: {exc}"))
                await self._forget_kept(group)
                continue
            taken += group
            results += out
        return taken, results

    async def _drafter_prefill(self, reqs: list[ServedRequest], features: list) -> None:
        await self._releases_landed("drafter")
        items = [DrafterPrefillItem(r.tag(), r.prompt_ids + r.tokens[:-1], r.tokens[-1], r.params, r.seed, f)
                 for r, f in zip(reqs, features)]
        try:
            untaken = await _within(self.drafter.prefill(items), self.cfg.drafter_timeout)
            for r in reqs:
                r.on_drafter = r.request_id not in untaken   # untaken: resynced before the next draft
                r.drafter_kept = False   # the prefill took the kept tree back, or dropped it
        except (EngineUnavailable, asyncio.TimeoutError, StaleMessage) as exc:
            self._release_d.update(r.request_id for r in reqs)   # a late prefill may still land
            self._drafter_failed(exc)
        except ValueError as exc:   # refused: these requests decode without drafts
            log.warning("the drafter refused %d requests (%s): they decode without drafts", len(reqs), exc)
            self._release_d.update(r.request_id for r in reqs)
            for r in reqs:
                r.on_drafter = False
                r.drafter_refused = True

    # ---------------------------------------------------------------- rounds

    async def _round(self, admit: list[ServedRequest] = ()) -> None:
        """Admits `admit` (the scheduler's plan for this turn) and runs one round. New requests
        ride in the round's verify step where they can (`_mixes`); with
        RouterConfig.admit_beside_draft a round of the sequential kind admits them while the
        drafter drafts for the running requests instead (`_admits_beside_draft`); otherwise
        admission comes first."""
        self._prev_verdicts, self._verdicts_after = self._verdicts_after, None
        # "auto" times a round from the end of the one before (where the router went straight on):
        # the host work between two rounds is every mode's, and a plain round whose decode the
        # verifier queued ahead (RouterConfig.decode_ahead) would look as fast as that gap is long
        # if timed from its own start only.
        ended, self._round_ended = self._round_ended, None
        admit, mixed, admitted = list(admit), [], len(admit)
        beside = bool(admit) and self._admits_beside_draft(admit)
        # Beside the draft (where asked for and speculation runs), a prefill overlaps it;
        # otherwise the prompts ride in the verify step.
        speculating = self._mode not in (None, "plain")
        if admit and not (speculating and beside) and self._mixes(admit):
            mixed, admit, beside = admit, [], False
        if not beside:
            await self._admit_first(admit)
            admit = []
        else:
            await self._admit_first([])
            if not self.running:   # the running requests ended meanwhile: nothing to draft beside
                await self._admit_first(admit)
                admit = []
        if mixed and not self.running:   # nothing left to ride on
            await self._admit_first(mixed)
            mixed = []
        if not self.running:
            return
        await self._resync()
        mode = self._mode = self._modes.choose(len(self.running) + len(admit) + len(mixed), self.drafter_up)
        if mode == "plain":
            self._detach_running()
        detached = sum(r.detached for r in self.running) if mode != "plain" else 0   # `record` reads it of drafting rounds
        # The round's measurement for "auto" takes in the turn's admission, wherever it ran (before
        # the round, beside its draft, in its verify step); "auto" times a window by its rounds
        # that admitted none where it has enough (router/pipeline.py).
        t0, before, rounds = time.perf_counter(), self._tokens_committed, self.counters.rounds
        t0 = ended if ended is not None else t0
        request_rounds = len(self.running) + len(admit) + len(mixed)
        if mode in ("ahead", "pingpong"):
            await self._releases_landed("drafter")   # draft ahead forks requests on the drafter: its slots free first
            if admit or mixed:   # their drafter calls go with the verify
                await self._admit_first(admit + mixed)
                admit = mixed = []
                if not self.running:
                    return
        self._capped_plain, self._drafted = False, {}
        self._draft_failed = self._joining = frozenset()
        try:
            if mode == "pingpong":
                await self._pingpong_round()
            else:
                await self._sequential_round(ahead=mode == "ahead", admit=admit, mixed=mixed)
        finally:   # the verifies this round ran (ping-pong: two), by its mode (plain without a drafter)
            by_mode, key = self.counters.mode_rounds, mode if self.drafter is not None else "plain"
            if self.counters.rounds > rounds:
                by_mode[key] = by_mode.get(key, 0) + self.counters.rounds - rounds
        upkeep = time.perf_counter()
        if any(len(r.backlog) >= BACKLOG_ROUNDS for r in self.running):   # long plain stretches
            await self._flush_backlog([r for r in self.running if r.backlog])
        upkeep = time.perf_counter() - upkeep
        # A plain round whose steps were cut by the requests' ends decodes fewer tokens than the
        # mode does: the batch's tail, not plain decoding's rate. It does not count as a measurement,
        # nor does a speculating round that drafted for no request (the acceptance switch had
        # speculation off, every request detached, the drafter away): it decoded plainly, at plain
        # decoding's rate, and counted as the mode's would keep "auto" from the mode once drafts
        # are accepted again (router/pipeline.py).
        # What a drafting mode commits per request-round is measured on the requests it drafted
        # for that go on: a detached request decodes plainly beside them, an ending one commits
        # what its end leaves (router/pipeline.py).
        if not self._capped_plain and (mode == "plain" or self._drafted):
            going = [(r, n) for r, n in self._drafted.values() if not r.done]
            drafted = (sum(len(r.tokens) - n for r, n in going), len(going))
            self._modes.record(mode, self._tokens_committed - before, time.perf_counter() - t0, request_rounds, upkeep,
                               admitted, drafted=drafted if mode != "plain" else None, detached=detached)
        self._round_ended = time.perf_counter()

    async def _admit_first(self, batch: list[ServedRequest]) -> None:
        """Admits `batch` now, then releases what ended (during admission too) and makes room for
        the round."""
        if batch:
            await self._admit(batch)
        await self._release_finished()
        await self._make_room()

    def _mixes(self, batch: list[ServedRequest]) -> bool:
        """Whether this turn's new requests may be prefilled in the round's verify step
        (VerifierLink.verify_prefill; serve --mixed-prefill): none resumes, some requests are
        running, and they fit the next round beside the new ones (their first tokens included)
        without a preemption. The new requests join the running batch after that verify, their
        first tokens its results. With RouterConfig.admit_beside_draft, `_round` takes admission
        beside the draft instead where the round speculates and that is possible
        (`_admits_beside_draft`)."""
        if not self.cfg.mixed_prefill or not self.running or any(r.resuming for r in batch):
            return False
        return self._fits_beside(batch)

    def _fits_beside(self, batch: list[ServedRequest]) -> bool:
        """Whether the running requests fit the next round beside `batch` (their first tokens
        included) without a preemption or a failure."""
        after = ([Running(r.request_id, r.committed_len, r.admit_seq) for r in self.running]
                 + [Running(r.request_id, r.committed_len + 1, self._admitted + 1 + i) for i, r in enumerate(batch)])
        plan = self.scheduler.plan(after, [])
        return not plan.preempt and not plan.fail_running

    def _admits_beside_draft(self, batch: list[ServedRequest]) -> bool:
        """Whether this turn's admission may run while the drafter drafts for the running requests:
        the drafter is up and holds some of them, no admitted request resumes (a resume takes back
        the drafter's kept tree), and the running requests fit the next round beside the new ones
        (their first tokens included) without a preemption. The new requests then join the round's
        verify as plain rows (those whose drafts are sampled wait for the next round, their first
        drafted one), and their drafter prefill runs while the verifier verifies.

        Not from LARGE_BATCH running requests on: there arrivals come in larger groups, whose
        prefill is a long forward of its own that the running requests wait for (the draft beside
        it is short), while in the verify step the prompts share one pass over the weights with
        the round. On one H100 (8B-shaped pair, a = 0.8, concurrency 64, pipeline sequential, back to
        back) serving went from 4,937 to 5,663 tok/s, ITL p99 from 111 to 78 ms
        (benchmarks/results/serve-h100-sequential.txt). Below it too, once a round's tokens stream
        during the next verify (`_deliver`), the verify step served more: at 8 and 16 running
        (a = 0.8, alternated) 2,079 and 2,135 against 2,071 and 1,964 tok/s, 3,327 and 3,514
        against 3,064 and 3,195, ITL p99 over p50 2.2-2.4 against 3.2-3.9
        (benchmarks/results/serve-h100-admission.txt): off by default."""
        if (not self.cfg.admit_beside_draft or len(self.running) >= LARGE_BATCH
                or not (self.drafter_up and any(r.on_drafter for r in self.running))
                or any(r.resuming for r in batch)):
            return False
        return self._fits_beside(batch)

    async def _sequential_round(self, ahead: bool = False, admit: list[ServedRequest] = (),
                                mixed: list[ServedRequest] = ()) -> None:
        """Draft (with the last round's catch-up), verify, hold this round's catch-up back for the
        next drafter call. `ahead`: while the verifier verifies, the drafter prepares the
        next trees for the likeliest outcomes; on a hit the next draft call returns at once and
        the catch-up with the real features runs while the verifier is busy again. `admit`
        (not with `ahead`): requests prefilled on the verifier while the drafter drafts, verified
        plainly in this round and prefilled on the drafter while the verifier verifies. `mixed`
        (not with `ahead`): requests prefilled in the round's verify step (`_mixes`), then on
        the drafter."""
        later = None
        if admit:
            draft_task = asyncio.ensure_future(self._draft(list(self.running)))
            await asyncio.sleep(0)   # the draft call goes out first: it is the longer of the two
            try:
                later = await self._admit(admit, drafter_later=True)
            finally:
                draft, drafted = await draft_task
            if not self.running:   # the verifier failed during admission
                return
        posting = elided = None
        if not admit:
            drafted, draft = self._to_draft(self.running)
            if drafted and draft is None:
                if await self._posts_trees():   # the trees go drafter -> verifier while the verify goes out
                    self._tree_round += 1
                    early_after, early_tags = self._early_trees(drafted) if not ahead else (0, ())
                    draft = DraftHandle([r.tag() for r in drafted],
                                        TreeRoute(self._tree_round, self.cfg.drafter_timeout + TREE_WAIT_MARGIN_S,
                                                  early_after, early_tags))
                    if early_tags:
                        # The drafter drafted this round's trees on the last verdicts and posted
                        # them; a draft call would only find them made. None goes: the verify takes
                        # them, or goes on without them at once (TreeRoute.early_after). The
                        # held-back catch-ups are those the drafter caught up with on the verdicts.
                        elided = {r.request_id: self._take_backlog([r]) for r in drafted}
                    else:
                        posting = functools.partial(self._draft_call, drafted, self._tree_round)   # started below
                else:
                    draft, drafted = await self._draft_call(drafted)
        # Not those that ended at their first token; nor, this round, new requests whose drafts are
        # sampled: a plain row would draw other seeded tokens than their first drafted round.
        wait = {id(r) for r in admit if not self._invisible_when_plain(r)}
        self._joining = frozenset(r.request_id for r in admit)   # their plain row: a plain round, never a fallback
        group = [r for r in self.running if r.on_verifier and id(r) not in wait]
        # The drafter's turn comes once the verify forward is queued.
        launched = asyncio.get_running_loop().create_future() if ahead and drafted else None
        draft_next = self._next_drafts(drafted, ahead)
        detach = self._detach(mixed) if mixed else set()
        channel_round = posting is not None or elided is not None
        if draft_next and channel_round:   # its verdicts go to the drafter over the tree channel
            # So do the drafter prefills of the requests its step prefills (the verifier marks
            # those it sent: `_after_prefill`): the drafter takes them first and drafts their
            # first trees with the others' on the verdicts, so the next round's early trees hold
            # them as well.
            draft_next.update((r.request_id, self._draft_bound(r)) for r in mixed if r.request_id not in detach)
        if posting is not None:   # the draft call goes out first: the drafter drafts this round's trees on it
            posting = asyncio.ensure_future(posting())
        verify = asyncio.ensure_future(self._verify(draft, drafted, group, launched, draft_next) if not mixed else
                                       self._verify_with_prefill(draft, drafted, group, list(mixed), draft_next,
                                                                 detach))
        try:
            if posting is not None:   # from here on, the requests whose trees went (the others get no verdict)
                drafted = (await posting)[1]
            if later is not None and self.drafter_up:
                await self._drafter_prefill(*later)
            if launched is not None:
                await asyncio.wait([launched, verify], return_when=asyncio.FIRST_COMPLETED)
            cached = [r for r in drafted if self._cached(r, ahead)]
            if cached:   # with their held-back catch-ups (the last verdict's, if it hit), in one call
                await self._draft_ahead(cached, self._take_backlog(cached))
        finally:
            results = await verify
        admitted = None
        if mixed:
            results, admitted = results
        if elided is not None:
            self._after_elided(elided, drafted, results)
        if results is not None and draft_next and channel_round:
            # The next round's early trees serve those whose verdicts (or drafter prefills) went.
            went = {v.tag.request_id for v in results if v.to_drafter}
            went.update(res.tag.request_id for res in (admitted[1] if admitted else ()) if res.with_verdicts)
            self._verdicts_after = (self._tree_round, frozenset(went & draft_next.keys()))
        if results is not None:
            extend = self._apply(results, drafted, group)
            if admitted is not None:   # after the round's results: they join, then go to the drafter
                await self._after_prefill(*admitted)
            ready = {r.request_id for r in drafted if r.next_tree is not None}
            if extend and (not ahead or all(i.tag.request_id in ready for i in extend)):
                # Held back: the next round's drafter call carries it (sequential: its draft;
                # ahead, where every drafted request hit and the router holds its next tree: the
                # draft-ahead that goes with the verify of that tree).
                by_id = {r.request_id: r for r in drafted}
                for item in extend:
                    by_id[item.tag.request_id].backlog.append(item)
            elif extend:   # after what the requests still hold back, in order
                await self._extend(self._take_backlog(drafted) + extend)

    def _after_elided(self, elided: dict[str, list[ExtendItem]], drafted: list[ServedRequest], results) -> None:
        """A round the early trees served without a draft call (`_sequential_round`): the drafter
        caught up on the last verdicts before it drafted them, so the catch-ups held back for it
        (`elided`: request id -> items) are done with where the round verified its tree. Where it
        did not (the verify found no early trees for the round), they are held back again, before
        any the round adds, for the next draft call, which then drafts those requests (their
        verdicts did not go to the drafter: `_early_trees`). A failed verify (`results` None)
        left the requests off both engines (`_verifier_failed`): nothing is held back for them."""
        if results is None:
            return
        verified = {v.tag.request_id for v in results}
        served = [r for r in drafted if r.request_id in verified]
        for r in drafted:
            if r.request_id not in verified:
                r.backlog[:0] = elided[r.request_id]
        self.counters.posted_trees += len(served)
        self.counters.early_tree_rounds += 1 if served else 0

    def _cached(self, r: ServedRequest, ahead: bool) -> bool:
        """Whether this ahead round drafts ahead for `r` (its next tree may be held for the router)."""
        return (ahead and r.on_drafter and self.drafter_up
                and (self.cfg.pipeline == "ahead" or self._invisible_when_plain(r)))

    async def _draft_ahead(self, reqs: list[ServedRequest], extend: list[ExtendItem] = ()) -> None:
        """Draft ahead for `reqs`, after the catch-up `extend` (held back by the last round)."""
        try:
            reply = await _within(self.drafter.draft_ahead([r.tag() for r in reqs], extend),
                                  self.cfg.drafter_timeout)
        except (EngineUnavailable, asyncio.TimeoutError, StaleMessage) as exc:
            self._drafter_failed(exc)
            return
        self._off_drafter(reply.unknown)
        flags = reply.hits
        for r, trees in zip(reqs, reply.trees):
            r.ahead_trees = (r.committed_len, trees) if trees else None
        self.counters.draft_ahead_hits += sum(f is True for f in flags)
        self.counters.draft_ahead_misses += sum(f is False for f in flags)
        # A drafter that drafts ahead answers hit or miss from its second such round on; one
        # that never does (None for every request, round after round) makes "ahead" a plain
        # sequential round plus a call: "auto" stops offering it.
        self._ahead_unanswered = 0 if any(f is not None for f in flags) else self._ahead_unanswered + 1
        if (self._ahead_unanswered >= AHEAD_UNANSWERED_ROUNDS and self.cfg.pipeline == "auto"
                and "ahead" not in self._modes.unavailable):
            self._modes.unavailable.add("ahead")
            log.info("the drafter does not draft ahead: pipeline mode \"ahead\" is no longer a candidate")

    def _invisible_when_plain(self, r: ServedRequest) -> bool:
        """Deterministic drafts: a plain round draws exactly the tokens a speculative one would."""
        return not r.params.drafts_sampled(self.cfg.draft_sampling_min_temperature)

    async def _pingpong_round(self) -> None:
        """Ping-pong: the drafter drafts half B while the verifier verifies half A, then catches
        up half A while the verifier verifies half B. Each request still sees draft -> verify ->
        extend in order, so its tokens are those of the sequential loop."""
        a, b = self.running[0::2], self.running[1::2]
        draft_a, drafted_a = await self._draft(a)
        verify_a = asyncio.ensure_future(self._verify(draft_a, drafted_a, a))
        draft_b, drafted_b = await self._draft(b)
        results_a = await verify_a
        if results_a is None:
            return
        extend_a = self._apply(results_a, drafted_a, a)
        verify_b = asyncio.ensure_future(self._verify(draft_b, drafted_b, b))
        if extend_a:
            await self._extend(extend_a)
        results_b = await verify_b
        if results_b is None:
            return
        extend_b = self._apply(results_b, drafted_b, b)
        if extend_b:
            await self._extend(extend_b)

    async def _draft(self, group: list[ServedRequest]):
        """-> (draft handle or None, the requests it covers). Requests not covered decode plainly."""
        drafted, ready = self._to_draft(group)
        if ready is not None or not drafted:
            return ready, drafted
        return await self._draft_call(drafted)

    def _to_draft(self, group: list[ServedRequest]) -> tuple[list[ServedRequest], DraftHandle | None]:
        """-> (the requests of `group` this round drafts for, the handle of their trees where the
        router holds every one of them, else None). The trees the requests held are taken; the
        requests are recorded with their token counts ("auto" measures what their trees commit)."""
        fits = lambda r: r.committed_len - 1 + self.cfg.lookahead <= self.cfg.max_len
        spec_off = self._switch.off(self.counters.rounds) or self._mode == "plain"
        drafted = [r for r in group if self.drafter_up and r.on_drafter and fits(r)
                   and not (spec_off and self._invisible_when_plain(r))]
        for r in drafted:
            self._drafted.setdefault(r.request_id, (r, len(r.tokens)))
        ready = [r.next_tree for r in drafted]
        for r in group:
            r.next_tree = None       # a ready tree serves this round or none
        if drafted and all(t is not None and t[0] == r.committed_len for t, r in zip(ready, drafted)):
            # Draft ahead hit for every drafted request: the trees the router holds are those the
            # drafter would return (drafter/engine.py makes both from the same rows).
            tree = trees_from_ready([r.request_id for r in drafted], [r.committed_len for r in drafted],
                                    [t[1] for t in ready])
            self.counters.ready_trees += len(drafted)
            return drafted, self.drafter.ready_handle(tree, [r.tag() for r in drafted])
        return drafted, None

    async def _draft_call(self, drafted: list[ServedRequest], post_round: int = 0):
        """The drafter call for `drafted` -> (draft handle or None, the requests it covers).
        `post_round`: the drafter sends the trees to the verifier over the tree channel as that
        round; the handle then says which requests they cover, and where it could not send them,
        none are covered (the verify of that round finds no trees)."""
        steps = None
        if self._mode.startswith("short:"):   # shorter trees where the tree does not decide the tokens
            cap = int(self._mode.split(":")[1])
            steps = [cap if self._invisible_when_plain(r) else None for r in drafted]
        # With the held-back catch-ups (the last round's, plain rounds', a hit's): the drafter
        # absorbs them first, in the same call.
        backlog = self._take_backlog(drafted)
        tags = [r.tag() for r in drafted]
        call = (self.drafter.draft(tags, steps, backlog, post_round=post_round) if post_round
                else self.drafter.draft(tags, steps, backlog))
        try:
            draft = await _within(call, self.cfg.drafter_timeout)
        except (EngineUnavailable, asyncio.TimeoutError, StaleMessage) as exc:
            self._drafter_failed(exc)
            return None, []
        # It restarted, or did not take a prefill that came with the verdicts: no tree for them,
        # re-prefilled by the next resync.
        if draft.unknown:
            self._off_drafter(draft.unknown)
            drafted = [r for r in drafted if r.on_drafter]
            if not drafted:
                return None, []
        if post_round and not draft.posted:
            self._trees_off_until = self.counters.rounds + TREE_RETRY_ROUNDS
            log.warning("the drafter could not send its trees over the tree channel: trees go through the "
                        "router until it can (asked every %d rounds)", TREE_RETRY_ROUNDS)
            return None, []
        if list(draft.tags) != [r.tag() for r in drafted]:
            self.counters.stale_dropped += 1   # a draft of another epoch or length: never verified
            self._draft_failed = self._draft_failed | {r.request_id for r in drafted}
            return None, []
        if post_round:
            self.counters.posted_trees += len(drafted)
        return draft, drafted

    def _early_trees(self, drafted: list[ServedRequest]) -> tuple[int, tuple]:
        """A tree-channel round's TreeRoute early_after and early_tags: the trees the drafter
        posted early on the last round's verdicts serve this round where that round's verdicts
        went to it for every one of `drafted` and this round's draft call asks no depth cap, as
        then the draft call takes exactly those trees (drafter/next_trees.py; the verifier checks
        each tag). (0, ()) otherwise."""
        prev = self._prev_verdicts
        if prev is None or self._mode.startswith("short:") or any(r.request_id not in prev[1] for r in drafted):
            return 0, ()
        return prev[0], tuple(r.tag() for r in drafted)

    async def _posts_trees(self) -> bool:
        """Whether this round's trees go drafter -> verifier over the tree channel. After a pause
        (a drafter that could not post), only once the drafter's info says its end is up again
        (a drafter process started again connects by itself; a Ray drafter actor that restarted
        has no channel, and its pauses go on)."""
        if not self.cfg.tree_channel or self.counters.rounds < self._trees_off_until:
            return False
        if self._trees_off_until:
            try:
                state = (await _within(self.drafter.info(), self.cfg.drafter_timeout)).extra.get("tree_channel")
            except (EngineUnavailable, asyncio.TimeoutError) as exc:
                state = f"unknown ({exc or type(exc).__name__})"
            if state != "up":
                self._trees_off_until = self.counters.rounds + TREE_RETRY_ROUNDS
                return False
            self._trees_off_until = 0
            log.info("the drafter's tree channel is up again: trees go drafter -> verifier")
        return True

    async def _verify(self, draft, drafted: list[ServedRequest], group: list[ServedRequest], launched=None,
                      draft_next: dict[str, int] | None = None):
        """One batched verify of the group (drafted rows, then plain rows); None if the verifier
        failed. `launched` (a future): resolved once the verifier's forward is queued (VerifierLink.verify's
        on_launch). `draft_next`: `_next_drafts`."""
        plain, want = self._verify_rows(drafted, group)
        self._verified = True
        more = {"draft_next": draft_next} if draft_next else {}
        try:
            return await self.verifier.verify(draft, plain, want, on_launch=self._on_launch(launched), **more)
        except EngineUnavailable as exc:
            self._verifier_failed(list(self.running), exc)
            self.running = []
            return None
        finally:
            self._deliver()   # a link that never said the forward was queued

    def _next_drafts(self, drafted: list[ServedRequest], ahead: bool) -> dict[str, int] | None:
        """For a verifier link that hands its verdicts to the drafter (`hands_verdicts`: in-process
        engines with a thread each): the drafted requests whose next trees the drafter may draft as
        soon as their verdicts are in, each with the committed length from which it is not drafted
        again (its max_tokens; the context, the lookahead included, as `_to_draft` has it). None
        where the next round is not expected to draft them alike: an ahead round (whose drafter
        work is the draft ahead), a mode other than sequential, or one about to change (router/
        pipeline.py `continues`), or the acceptance switch turning speculation off."""
        if (not drafted or ahead or self._mode != "sequential" or not getattr(self.verifier, "hands_verdicts", False)
                or not self._modes.continues(self.drafter_up) or self._switch.off(self.counters.rounds + 1)):
            return None
        return {r.request_id: self._draft_bound(r) for r in drafted}

    def _draft_bound(self, r: ServedRequest) -> int:
        """The committed length from which `r` is not drafted again (`_next_drafts`)."""
        fits = self.cfg.max_len - self.cfg.lookahead + 2   # `_to_draft`: committed_len - 1 + lookahead <= max_len
        return min(len(r.prompt_ids) + r.params.max_tokens, self.cfg.max_len, fits)

    def _on_launch(self, launched=None):
        """A verify's `on_launch`: called by the link once the forward is queued (from an in-process
        engine's worker thread, or as the call goes out to another process). The tokens committed
        since the last one then go to their streams (`_deliver`) while the device works, and
        `launched`, if given, is resolved."""
        loop = asyncio.get_running_loop()

        def launched_now():
            self._deliver()
            if launched is not None and not launched.done():
                launched.set_result(None)

        return lambda: loop.call_soon_threadsafe(launched_now)

    def _verify_rows(self, drafted: list[ServedRequest], group: list[ServedRequest]) -> tuple[list[PlainItem], bool]:
        """A verify's plain rows (the group's requests without a draft) and whether it wants
        features: not for a round of detached requests only, on which no drafter catches up."""
        steps = self._plain_steps(group) if not drafted else 1
        rows = [r for r in group if r not in drafted]
        # None may end in this call (its client is likely to send another request, which changes
        # the next call), and the next call must decode more than one step (one step is a verify,
        # which a decode ahead does not serve).
        again = (steps > 1 and bool(rows) and self._next_turn_alike()
                 and min(r.tokens_left(self.cfg.max_len) for r in rows) - steps > 1)
        plain = [PlainItem(r.tag(), r.tokens[-1], steps, again) for r in rows]
        want = self.cfg.want_features and (any(r.on_drafter for r in group) or not any(r.detached for r in group))
        return plain, want

    def _next_turn_alike(self) -> bool:
        """Whether the next turn is expected to decode the same requests plainly again (what a
        plain item's `again` tells a verifier that decodes ahead): no request waits to be admitted
        (or none could be), and the next round runs in this round's mode, whose rows are plain
        (router/pipeline.py `continues`; the acceptance switch stays off where it made them so)."""
        if self.waiting and len(self.running) < self.cfg.max_running:
            return False
        if not self._modes.continues(self.drafter_up):
            return False
        # A speculating mode's rows are plain while the acceptance switch keeps drafts off.
        return not self.drafter_up or self._mode == "plain" or self._switch.off(self.counters.rounds + 1)

    async def _verify_with_prefill(self, draft, drafted: list[ServedRequest], group: list[ServedRequest],
                                   mixed: list[ServedRequest], draft_next: dict[str, int] | None = None,
                                   detach: set[str] = frozenset()):
        """`_verify` with `mixed` prefilled in the same step -> (its results or None, `_after_prefill`'s
        arguments for the requests the verifier took, or None). A refusal (ValueError) of the
        prefill verifies without it and admits `mixed` as `_admit` does, whose retries fail only
        the refused requests. `draft_next`: `_next_drafts`, with the requests of `mixed` whose
        drafter prefill goes with the verdicts; `detach`: `_detach(mixed)`."""
        plain, want = self._verify_rows(drafted, group)
        items = [self._prefill_item(r, False) for r in mixed]
        self._verified = True
        try:
            await self._releases_landed("verifier")   # the drafter's prefill waits for its own (`_drafter_prefill`)
            more = {"draft_next": draft_next} if draft_next else {}
            results, prefilled = await self.verifier.verify_prefill(draft, plain, want, items,
                                                                    self._admission_features(mixed, detach),
                                                                    on_launch=self._on_launch(), **more)
        except EngineUnavailable as exc:
            self._release_v.update(r.request_id for r in mixed)   # it may hold some
            self._verifier_failed(list(self.running) + mixed, exc)
            self.running = []
            return None, None
        except ValueError as exc:
            log.warning("the verifier refused a verify with %d prefills (%s): verifying, then admitting, apart",
                        len(mixed), exc)
            results = await self._verify(draft, drafted, group)
            if results is not None:
                await self._admit(mixed)
            return results, None
        finally:
            self._deliver()   # a link that never said the forward was queued
        self.counters.mixed_prefills += len(mixed)
        return results, (mixed, prefilled, detach, set())

    def _plain_steps(self, group: list[ServedRequest]) -> int:
        """Tokens per request of a round without drafts: cfg.plain_steps when every request is
        greedy, no more than the request that may generate the most still wants (max_tokens) and
        no step past any request's context. A request whose max_tokens falls inside the steps
        decodes them all and keeps its tokens up to its end (`_commit`): its row costs little
        beside the batch's, where cutting every request's steps at the nearest end would make
        most rounds of a continuous batch short (some request ends in most of them), each round
        paying the call's host work again. Sets `_capped_plain` when the steps were cut (the
        batch's tail, or the context)."""
        k = self.cfg.plain_steps
        if k <= 1 or not all(r.params.greedy for r in group):
            return 1
        room = min(r.context_left(self.cfg.max_len) for r in group)
        wanted = max(r.tokens_left(self.cfg.max_len) for r in group)
        steps = max(1, min(k, room, wanted))
        self._capped_plain = self._capped_plain or steps < k
        return steps

    def _apply(self, results, drafted: list[ServedRequest], group: list[ServedRequest]) -> list[ExtendItem]:
        """Commits a verify's results (dropping stale ones); returns the drafter catch-up items."""
        extend = []
        c = self.counters
        c.rounds += 1
        expected = {r.request_id: r for r in group}
        for res in results:
            r = expected.pop(res.tag.request_id, None)
            if r is None or res.tag.epoch != r.epoch or res.tag.committed_len != r.committed_len + len(res.token_ids):
                c.stale_dropped += 1   # a reply of an old epoch (or unknown): dropped, never applied
                if r is not None:
                    expected[r.request_id] = r
                continue
            r.num_rounds += 1
            r.draft_tokens += res.num_draft_tokens
            r.accepted_tokens += res.num_accepted
            if res.num_draft_tokens:
                c.num_drafts += 1
                c.draft_tokens += res.num_draft_tokens
                c.accepted_tokens += res.num_accepted
                c.add_accepted(res.num_accepted)
                self._switch.observe(res.num_accepted, c.rounds)
            if r not in drafted and self.drafter is not None:
                # A request that joined beside this round's draft is verified plainly by choice,
                # whether its drafter prefill has landed yet or not.
                if r.request_id in self._joining or (self.drafter_up and (r.on_drafter or r.detached)
                                                     and r.request_id not in self._draft_failed):
                    r.plain_rounds += 1
                    c.plain_rounds += 1
                else:
                    r.fallback_rounds += 1
                    c.fallback_rounds += 1
            ahead, r.ahead_trees = r.ahead_trees, None
            if ahead is not None and ahead[0] == r.committed_len:
                hit = ahead[1].get(tuple(res.token_ids))
                r.next_tree = None if hit is None else (r.committed_len + len(res.token_ids), hit)
            going_on = self._commit(r, res.token_ids) if not r.done else False
            if going_on and r.on_drafter and self.drafter_up:
                item = ExtendItem(Tag(r.request_id, r.epoch, r.committed_len), res.token_ids, res.features)
                # Decoded plainly: the catch-up waits until the request is drafted again, when the
                # drafter absorbs every held-back round in one forward (the drafter's engine merges
                # them), so rounds of "plain" cost the drafter nothing.
                (r.backlog if r not in drafted else extend).append(item)
            elif going_on:
                r.on_drafter = False
                r.backlog.clear()
        return extend

    async def _extend(self, items: list[ExtendItem]) -> None:
        try:
            unknown = await _within(self.drafter.extend(items), self.cfg.drafter_timeout)
        except (EngineUnavailable, asyncio.TimeoutError, StaleMessage) as exc:
            self._drafter_failed(exc)
            return
        self._off_drafter(unknown)

    def _off_drafter(self, unknown: list[str]) -> None:
        """Requests the drafter reports it does not hold (it restarted): re-prefill them."""
        for r in self.running:
            if r.request_id in unknown:
                r.on_drafter = False
                r.backlog.clear()
                r.ahead_trees = r.next_tree = None

    @staticmethod
    def _take_backlog(reqs: list[ServedRequest]) -> list[ExtendItem]:
        """The requests' held-back catch-ups (ServedRequest.backlog), in order; their backlogs emptied."""
        items = [item for r in reqs for item in r.backlog]
        for r in reqs:
            r.backlog.clear()
        return items

    async def _flush_backlog(self, reqs: list[ServedRequest]) -> None:
        """Sends the requests' held-back catch-ups now (before a preempting release)."""
        items = self._take_backlog(reqs)
        if items and self.drafter_up:
            await self._extend(items)

    async def _resync(self) -> None:
        """Re-prefills, on a drafter that is (back) up, the requests it does not hold."""
        if not self.drafter_up:
            return
        large = len(self.running) >= LARGE_BATCH   # detached requests rejoin below it
        stale = [r for r in self.running if not r.on_drafter and not r.done and not r.drafter_refused
                 and not (r.detached and (large or r.tokens_left(self.cfg.max_len) < REJOIN_MIN_TOKENS))]
        for r in stale:
            r.detached = False
        if not stale:
            return
        feats = [None] * len(stale)
        if self.cfg.want_features:   # asked for at once: over a network link, one reply's transfer
            feats = await asyncio.gather(*(self.verifier.features(r.tag()) for r in stale),   # overlaps
                                         return_exceptions=True)                             # the next's compute
            failed = next((f for f in feats if isinstance(f, BaseException)), None)
            if isinstance(failed, EngineUnavailable):
                self._verifier_failed(list(self.running), failed)
                self.running = []
                return
            if failed is not None:
                raise failed
        await self._drafter_prefill(stale, feats)

    # ---------------------------------------------------------------- streaming

    def _commit(self, r: ServedRequest, tokens: list[int]) -> bool:
        """Commits a round's tokens and queues their stream event (`_deliver` hands it on; a
        request's first tokens go at once); returns True while the request goes on."""
        if r.done:
            return False
        n, reason = take_tokens(len(r.tokens), tokens, r.params, self.cfg.eos_token_ids,
                                r.committed_len + len(tokens), self.cfg.max_len)
        new = tokens[:n]
        r.tokens.extend(new)
        self._tokens_committed += len(new)
        text = None   # decoded on delivery, unless a stop string may end the request here
        if r.detok.stop:
            text = r.detok.push(new)
            if r.detok.stopped and reason is None:
                reason = "stop"
        first = r.num_rounds == 0 and len(r.tokens) == len(new)
        self._emit("tokens", r, {"count": len(new), "first": first})
        stats = None
        if reason is not None:
            self._ended(r, RequestStatus.FINISHED)
            self.counters.requests_finished += 1
            self._emit("finished", r, reason)
            stats = r.stats()
        event = (r, new, text, reason, stats, len(r.prompt_ids) if first else 0)
        if first:   # its stream's first event: nothing of it waits in the outbox
            self._hand_on(*event)
        else:
            self._outbox.append(event)
        return reason is None

    def _deliver(self) -> None:
        """Hands the queued stream events to their streams, decoding the text of those that wait
        for it. A round's tokens are delivered once the next verify's forward is queued (or when
        the loop has nothing else to do): the clients' streams and the text decoding then run on
        the event loop while the device works, rather than beside the drafter's host code, which
        they would slow down (in one process the threads take turns at the Python lock)."""
        box, self._outbox = self._outbox, []
        for event in box:
            self._hand_on(*event)

    @staticmethod
    def _hand_on(r: ServedRequest, new: list[int], text: str | None, reason: str | None, stats: dict | None,
                 prompt_tokens: int) -> None:
        if text is None:
            text = r.detok.push(new)
        if reason is not None:
            text += r.detok.flush()
        r.events.put_nowait(StreamEvent(new, text, finish_reason=reason, stats=stats, prompt_tokens=prompt_tokens))

    def _finish_failure(self, r: ServedRequest, failure: Failure) -> None:
        self._deliver()   # the tokens it committed come first
        if not r.done:
            self.counters.requests_failed += 1
            self._emit("failed", r, failure.code)
            self._ended(r, RequestStatus.FAILED)
            r.events.put_nowait(failure)

    # ---------------------------------------------------------------- engine failures and releases

    def _verifier_failed(self, reqs: list[ServedRequest], exc: Exception) -> None:
        """Fails `reqs` and every waiting request with UNAVAILABLE (the cause goes to the log, not
        to clients: it names internal addresses) and marks the verifier down. What the engines
        hold for them is released once each answers (the drafter's at once, if it is up). The
        caller drops `reqs` from the running batch."""
        log.error("verifier failed: %s", exc)
        for r in reqs:
            if r.on_verifier:
                self._release_v.add(r.request_id)
            if r.on_drafter or r.drafter_kept:
                self._release_d.add(r.request_id)
            r.on_verifier = r.on_drafter = r.drafter_kept = False
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None
        for r in self.waiting:
            if r.drafter_kept:
                self._release_d.add(r.request_id)
                r.drafter_kept = False
        for r in reqs + self.waiting:
            self._finish_failure(r, Failure("UNAVAILABLE", "the verifier is unavailable; try again"))
        self.waiting = []
        self._set_serving(False)

    def _drafter_failed(self, exc: Exception) -> None:
        """Rounds go on without the drafter; what it held is released once it answers again (the
        running requests are then re-prefilled from the verifier's features)."""
        if self.drafter_up:
            self.counters.drafter_outages += 1
            log.warning("the drafter is unavailable (%s): decoding without drafts until it answers again",
                        str(exc) or type(exc).__name__)
        self.drafter_up = False
        for r in self.running:
            if r.on_drafter:
                self._release_d.add(r.request_id)
            r.on_drafter = False
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None

    def _releases_due(self) -> bool:
        """Whether an engine that answers still holds ids the router let go of."""
        ending = self._ending_ids()
        return bool(((self._release_v - ending) and self.serving) or ((self._release_d - ending) and self.drafter_up))

    def _ending_ids(self) -> set[str]:
        """Ids whose release is under way in the background (`_release_soon`): not released again."""
        return {r.request_id for r in self._ending}

    async def _settle(self) -> None:
        """Before admission: finished requests are released on both sides (a new request may reuse
        an id), and what an engine that answers still holds for the router is let go of."""
        await self._release_finished()
        ending = self._ending_ids()
        ids = sorted(self._release_v - ending)
        if ids and self.serving:
            try:
                await asyncio.wait_for(self.verifier.release(ids), self.cfg.probe_interval * 5)
                self._release_v.difference_update(ids)
            except (EngineUnavailable, asyncio.TimeoutError) as exc:
                self._verifier_failed(self.running, exc)
                self.running = []
        ids = sorted(self._release_d - ending)
        if ids and self.drafter_up:
            try:
                await asyncio.wait_for(self.drafter.release(ids), self.cfg.drafter_timeout)
                self._release_d.difference_update(ids)
            except (EngineUnavailable, asyncio.TimeoutError) as exc:
                self._drafter_failed(exc)

    async def _watch(self) -> None:
        """Probes failed engines every probe_interval, off the round loop. An engine is declared
        back only once it has released what it still held for the router."""
        while not self._stopping:
            await asyncio.sleep(self.cfg.probe_interval)
            if not self.serving:
                await self._probe_verifier()
            if self.drafter is not None and not self.drafter_up:
                await self._probe_drafter()

    async def _probe_verifier(self) -> None:
        try:
            await asyncio.wait_for(self.verifier.info(), self.cfg.probe_interval * 5)
            while self._release_v:   # ids added while a release is under way go in the next one
                ids = sorted(self._release_v)
                await asyncio.wait_for(self.verifier.release(ids), self.cfg.probe_interval * 5)
                self._release_v.difference_update(ids)
        except Exception as exc:
            log.debug("verifier probe: %s", exc)
            return
        self._set_serving(True)
        self._wake.set()

    async def _probe_drafter(self) -> None:
        try:
            await asyncio.wait_for(self.drafter.info(), self.cfg.drafter_timeout)
            while self._release_d:
                ids = sorted(self._release_d)
                await asyncio.wait_for(self.drafter.release(ids), self.cfg.drafter_timeout)
                self._release_d.difference_update(ids)
        except Exception as exc:
            log.debug("drafter probe: %s", exc)
            return
        for r in self.waiting:   # what it kept for preempted requests went with the releases
            r.drafter_kept = False
        self.drafter_up = True
        log.warning("the drafter answers again: speculation resumes")
        self._wake.set()

    def _set_serving(self, up: bool) -> None:
        if up != self.serving:
            self.serving = up
            log.warning("the verifier %s", "answers again: serving" if up else "is unavailable: not serving")
            if self.on_serving_change:
                self.on_serving_change(up)

    async def _forget_kept(self, reqs: list[ServedRequest]) -> None:
        """Releases the drafter's kept trees of preempted requests that will not resume."""
        kept = [r for r in reqs if r.drafter_kept]
        for r in kept:
            r.drafter_kept = False
        if kept and not self.drafter_up:
            self._release_d.update(r.request_id for r in kept)
        elif kept:
            try:
                await asyncio.wait_for(self.drafter.release([r.request_id for r in kept]), self.cfg.drafter_timeout)
            except (EngineUnavailable, asyncio.TimeoutError) as exc:
                self._release_d.update(r.request_id for r in kept)
                self._drafter_failed(exc)

    async def _release(self, reqs: list[ServedRequest], keep_draft: bool = False) -> None:
        """Frees the requests on both sides, the two engines' calls at once; keep_draft
        (preemption): the drafter keeps each one's ready next tree for its resume. An engine that
        does not answer gets them again once it does (`_release_v`, `_release_d`)."""
        ids_v = [r.request_id for r in reqs if r.on_verifier]
        for r in reqs:
            r.on_verifier = False
        # Pending until confirmed, so that a call that fails, times out or is cancelled (stop)
        # leaves them to be released again; a kept tree is released when its request ends.
        self._release_v.update(ids_v)
        await asyncio.gather(self._release_on_verifier(ids_v), self._release_on_drafter(reqs, keep_draft))

    async def _release_on_verifier(self, ids: list[str]) -> None:
        if ids and self.serving:
            try:
                await asyncio.wait_for(self.verifier.release(ids), self.cfg.probe_interval * 5)
                self._release_v.difference_update(ids)
            except (EngineUnavailable, asyncio.TimeoutError):
                pass   # released by `_settle`, or by the watcher once the verifier answers

    async def _release_on_drafter(self, reqs: list[ServedRequest], keep_draft: bool) -> None:
        if keep_draft:   # in step first: a preempted request's drafter keeps its next tree
            await self._flush_backlog([r for r in reqs if r.on_drafter])
        # Benchmark mode: each greedy request's output goes with its release, whether the drafter
        # holds the request or not, for the drafter to learn (drafter/controlled.py).
        outputs = ({r.request_id: r.prompt_ids + r.tokens for r in reqs if r.params.greedy}
                   if self.cfg.drafter_learns_outputs and self.drafter is not None else None)
        ids_d = [r.request_id for r in reqs if r.on_drafter]
        for r in reqs:
            r.drafter_kept = keep_draft and r.on_drafter and self.drafter_up
            r.on_drafter = False
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None
        if ids_d and not (keep_draft and self.drafter_up):
            self._release_d.update(ids_d)
        if not (ids_d or outputs) or not self.drafter_up:
            return
        try:
            await asyncio.wait_for(self.drafter.release(ids_d, keep_draft, outputs), self.cfg.drafter_timeout)
            self._release_d.difference_update(ids_d)
        except (EngineUnavailable, asyncio.TimeoutError) as exc:
            self._release_d.update(ids_d)
            self._drafter_failed(exc)

