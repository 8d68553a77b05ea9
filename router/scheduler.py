"""The router's round loop: admission by KV capacity, one batched verify per round, streaming,
preemption by recompute, cancellation and drafter fallback.

Invariants:
- a request's committed length only grows; tokens are streamed once, in order, never taken back;
- drafts are provisional until a verdict for their (epoch, committed length) arrives;
- the verifier is never made to wait on a missing draft: a request without one decodes plainly
  (its tree is just the root) in the same verify batch;
- every admitted request ends in exactly one terminal event (finish or failure), and is released
  on both sides;
- a reply whose (epoch, committed length) is not the request's own is dropped and counted, never
  applied.

Capacity: before each round the router checks that every running request's next round fits in
both KV pools (committed_len - 1 + lookahead entries, rounded up to blocks, per side). If not,
it preempts the most recently admitted request: frees its KV on both sides, keeps its committed
tokens, bumps its epoch and requeues it ahead of new requests. The drafter keeps the request's
pending next tree, if it has one ready (draft ahead), with its draft probabilities, tagged with
the committed length. On resume the verifier rebuilds its KV from the committed tokens (nothing
is resampled), the drafter is re-prefilled from the verifier's features, and the kept tree is
the next draft if its committed length still matches. A request that cannot fit even alone
fails with RESOURCE_EXHAUSTED.

Rounds run in the mode router/pipeline.py chooses: sequential, ahead (the drafter fills its
outcome cache while the verifier verifies), ping-pong, short drafts or plain (router/rounds.py).

The drafter is optional at every moment: if it is absent, slow (no answer within
`drafter_timeout`) or failing, the round goes on without it; the requests it held are marked
unsynced and are re-prefilled on the drafter (from the verifier's recomputed features) once it
answers again.

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
import logging
import uuid

from router.capacity import KvBudget
from router.detok import Detokenizer
from router.links import DrafterLink, DuplicateRequest, EngineUnavailable, VerifierLink
from spectandem.protocol import DrafterPrefillItem, Tag, VerifierPrefillItem
from router.pipeline import ModeChooser, SpeculationSwitch
from router.requests import Failure, RouterConfig, RouterCounters, ServedRequest, StreamEvent  # noqa: F401 (re-exported)
from router.rounds import RoundsMixin
from spectandem.config import SamplingParams
from spectandem.messages import StaleMessage
from spectandem.reference import take_tokens

log = logging.getLogger("spectandem.router")


class Router(RoundsMixin):
    def __init__(self, verifier: VerifierLink, drafter: DrafterLink | None, tokenizer, cfg: RouterConfig):
        self.verifier, self.drafter, self.tokenizer, self.cfg = verifier, drafter, tokenizer, cfg
        self.waiting: list[ServedRequest] = []
        self.running: list[ServedRequest] = []
        self.serving = True                      # the verifier answers
        self.drafter_up = drafter is not None
        self._wake = asyncio.Event()
        self._stopping = False   # stop(): the loop ends at its next turn even if the cancel is lost
        self._task: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._live: dict[str, ServedRequest] = {}   # request id -> the request using it (not yet done)
        self._admitted = 0
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
        self.counters = RouterCounters()
        self.kv = KvBudget(cfg, drafter is not None)
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
        for r in self.waiting + self.running:
            self._finish_failure(r, Failure("UNAVAILABLE", "the server is shutting down"))
        try:
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
        self._wake.set()
        return req

    def in_use(self, request_id: str) -> bool:
        """Whether a request that has not ended uses this id."""
        return request_id in self._live

    def _ended(self, r: ServedRequest) -> None:
        """Marks the request done: its id may be used again (admitted once the engines let it go)."""
        r.done = True
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
            req.cancelled = True
            self._ended(req)
            req.events.put_nowait(StreamEvent([], "", finish_reason="abort", stats=req.stats()))
            self._wake.set()

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        while not self._stopping:
            if not self.waiting and not self.running and not self._releases_due():
                self._wake.clear()
                await self._wake.wait()
                if self._stopping:
                    return
            try:
                await self._settle()
                await self._admit()
                await self._round()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a bug must not leave clients waiting forever
                log.exception("round failed")
                for r in self.running + self.waiting:
                    self._finish_failure(r, Failure("INTERNAL", f"round failed: {exc}"))
                await self._release(self.running)
                self.running, self.waiting = [], []
            await asyncio.sleep(0)

    def _releases_due(self) -> bool:
        """Whether an engine that answers still holds ids the router let go of."""
        return bool((self._release_v and self.serving) or (self._release_d and self.drafter_up))

    async def _settle(self) -> None:
        """Before admission: finished requests are released on both sides (a new request may reuse
        an id), and what an engine that answers still holds for the router is let go of."""
        finished = [r for r in self.running if r.done]
        if finished:
            self.running = [r for r in self.running if not r.done]
            await self._release(finished)
        if self._release_v and self.serving:
            ids = sorted(self._release_v)
            try:
                await asyncio.wait_for(self.verifier.release(ids), self.cfg.probe_interval * 5)
                self._release_v.difference_update(ids)
            except (EngineUnavailable, asyncio.TimeoutError) as exc:
                self._verifier_failed(self.running, exc)
                self.running = []
        if self._release_d and self.drafter_up:
            ids = sorted(self._release_d)
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

    async def _plan(self) -> None:
        """Preempts the latest-admitted running requests until the next round fits both pools."""
        while self.running and not self.kv.fits([r.committed_len for r in self.running]):
            if len(self.running) == 1:
                r = self.running[0]
                why = self.kv.never_fits(self.kv.need(r.committed_len)) or "the KV pools cannot hold it"
                self._finish_failure(r, Failure("RESOURCE_EXHAUSTED", why))
                self.running = []
                await self._release([r])
                return
            victim = max(self.running, key=lambda r: r.admit_seq)
            self.running.remove(victim)
            await self._release([victim], keep_draft=True)
            victim.epoch += 1
            victim.preempted = True
            self.counters.preemptions += 1
            first_new = next((i for i, w in enumerate(self.waiting) if not w.preempted), len(self.waiting))
            self.waiting.insert(first_new, victim)
            log.info("preempted %s at committed length %d (epoch %d)", victim.request_id, victim.committed_len,
                     victim.epoch)

    async def _admit(self) -> None:
        await self._forget_kept([r for r in self.waiting if r.cancelled])
        self.waiting = [r for r in self.waiting if not r.cancelled]
        held = self._release_v | {r.request_id for r in self.running}   # ids an engine still holds
        batch: list[ServedRequest] = []
        for r in list(self.waiting):
            if len(self.running) + len(batch) >= self.cfg.max_running:
                break
            need = self.kv.need(r.committed_len if r.preempted else len(r.prompt_ids) + 1)
            why = self.kv.never_fits(need)
            if why is not None:
                self.waiting.remove(r)
                self._finish_failure(r, Failure("RESOURCE_EXHAUSTED", why))
                await self._forget_kept([r])
                continue
            if r.request_id in held or not self.kv.fits([x.committed_len for x in self.running + batch], need):
                break  # first come, first served: later requests wait behind this one
            self.waiting.remove(r)
            batch.append(r)
        if not batch:
            return
        # "auto" settled on plain at this batch size: admit without the drafter (router/pipeline.py).
        detach = self.drafter is not None and self._modes.settled_plain(len(self.running) + len(batch))
        if detach != self._detaching:
            self._detaching = detach
            log.info("auto pipeline: new requests are admitted %s the drafter (%d running)",
                     "without" if detach else "with", len(self.running) + len(batch))
        batch, results = await self._prefill_verifier(batch, self.cfg.want_features and not detach)
        if not batch:
            return
        for r in batch:
            r.detached = detach
        if detach:
            self.counters.detached_admissions += len(batch)
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
            if r.preempted:  # resumed: nothing new to commit
                r.preempted = False
                self.counters.resumes += 1
                features[r.request_id] = res.features
            elif self._commit(r, [res.first_token_id]):
                features[r.request_id] = res.features
        live = [r for r in batch if not r.done]
        if self.drafter_up and live and not detach:
            await self._drafter_prefill(live, [features[r.request_id] for r in live])
        await self._release([r for r in batch if r.done])

    async def _prefill_verifier(self, batch: list[ServedRequest], want_features: bool):
        """-> (the requests the verifier took, its results in their order). A refusal (ValueError)
        of the batch is retried request by request, so that only the refused ones fail; an
        unavailable verifier fails them all (and everything waiting)."""
        def item(r: ServedRequest) -> VerifierPrefillItem:
            tag = Tag(r.request_id, r.epoch, r.committed_len if r.preempted else len(r.prompt_ids))
            return VerifierPrefillItem(tag, r.prompt_ids + r.tokens if r.preempted else r.prompt_ids, r.params,
                                       r.seed, resume=r.preempted)
        groups = [batch]
        taken, results = [], []
        while groups:
            group = groups.pop(0)
            try:
                out = await self.verifier.prefill([item(r) for r in group], want_features)
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
        items = [DrafterPrefillItem(r.tag(), r.prompt_ids + r.tokens[:-1], r.tokens[-1], r.params, r.seed, f)
                 for r, f in zip(reqs, features)]
        try:
            untaken = await asyncio.wait_for(self.drafter.prefill(items), self.cfg.drafter_timeout)
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

    # ---------------------------------------------------------------- helpers

    def _commit(self, r: ServedRequest, tokens: list[int]) -> bool:
        """Streams a round's tokens; returns True while the request goes on."""
        if r.done:
            return False
        n, reason = take_tokens(len(r.tokens), tokens, r.params, self.cfg.eos_token_ids,
                                r.committed_len + len(tokens), self.cfg.max_len)
        new = tokens[:n]
        r.tokens.extend(new)
        self._tokens_committed += len(new)
        text = r.detok.push(new)
        if r.detok.stopped and reason is None:
            reason = "stop"
        first = r.num_rounds == 0 and len(r.tokens) == len(new)
        self._emit("tokens", r, {"count": len(new), "first": first})
        if reason is None:
            r.events.put_nowait(StreamEvent(new, text, prompt_tokens=len(r.prompt_ids) if first else 0))
            return True
        text += r.detok.flush()
        self._ended(r)
        self.counters.requests_finished += 1
        self._emit("finished", r, reason)
        r.events.put_nowait(StreamEvent(new, text, finish_reason=reason, stats=r.stats(),
                                  prompt_tokens=len(r.prompt_ids) if first else 0))
        return False

    def _finish_failure(self, r: ServedRequest, failure: Failure) -> None:
        if not r.done:
            self.counters.requests_failed += 1
            self._emit("failed", r, failure.code)
            self._ended(r)
            r.events.put_nowait(failure)

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
        """Frees the requests on both sides; keep_draft (preemption): the drafter keeps each
        one's ready next tree for its resume. An engine that does not answer gets them again
        once it does (`_release_v`, `_release_d`)."""
        if keep_draft:   # in step first: a preempted request's drafter keeps its next tree
            await self._flush_backlog([r for r in reqs if r.on_drafter])
        ids_v = [r.request_id for r in reqs if r.on_verifier]
        ids_d = [r.request_id for r in reqs if r.on_drafter]
        for r in reqs:
            r.drafter_kept = keep_draft and r.on_drafter and self.drafter_up
            r.on_verifier = r.on_drafter = False
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None
        # Pending until confirmed, so that a call that fails, times out or is cancelled (stop)
        # leaves them to be released again.
        self._release_v.update(ids_v)
        if ids_v and self.serving:
            try:
                await asyncio.wait_for(self.verifier.release(ids_v), self.cfg.probe_interval * 5)
                self._release_v.difference_update(ids_v)
            except (EngineUnavailable, asyncio.TimeoutError):
                pass   # released by `_settle`, or by the watcher once the verifier answers
        if not ids_d:
            return
        if not (keep_draft and self.drafter_up):   # a kept tree is released when its request ends
            self._release_d.update(ids_d)
        if self.drafter_up:
            try:
                await asyncio.wait_for(self.drafter.release(ids_d, keep_draft), self.cfg.drafter_timeout)
                self._release_d.difference_update(ids_d)
            except (EngineUnavailable, asyncio.TimeoutError) as exc:
                self._release_d.update(ids_d)
                self._drafter_failed(exc)
