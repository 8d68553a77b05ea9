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
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid

from router.capacity import KvBudget
from router.detok import Detokenizer
from router.links import DrafterLink, DrafterPrefillItem, EngineUnavailable, Tag, VerifierLink, VerifierPrefillItem
from router.pipeline import ModeChooser, SpeculationSwitch
from router.requests import Chunk, Failure, RouterConfig, RouterCounters, ServedRequest  # noqa: F401 (re-exported)
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
        self._last_probe = 0.0
        self._admitted = 0
        self._tokens_committed = 0
        self._modes = ModeChooser(cfg)
        self._mode = "sequential"
        self._switch = SpeculationSwitch(cfg)
        self._spec_off_until = 0          # round number until which speculation is off
        self.on_serving_change = None            # callback(bool), e.g. to update gRPC health
        # Requests the drafter held when the router stopped talking to it (slow or failed): if it
        # was only slow it still holds them, so they are released once it answers again.
        self._drafter_orphans: set[str] = set()
        self.counters = RouterCounters()
        self.kv = KvBudget(cfg, drafter is not None)
        # Listeners get (event, request, data): "admitted", "tokens" (data: number of new tokens,
        # the first time also {"first": True}), "finished" (data: finish reason),
        # "failed" (data: status code name), "cancelled". Metrics and logs hook in here.
        self.listeners: list = []

    # ---------------------------------------------------------------- public side

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
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
            self._finish_failure(r, Failure("UNAVAILABLE", "server is shutting down"))
        try:
            # A dying or restarting engine must not hold shutdown: the engines go away next anyway.
            await asyncio.wait_for(self._release([r for r in self.running if r.on_verifier or r.on_drafter]),
                                   self.cfg.probe_interval * 5)
        except asyncio.TimeoutError:
            log.warning("engines did not confirm releases at shutdown")

    def submit(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> ServedRequest:
        if not self.serving:
            raise EngineUnavailable("the verifier is not available")
        req = ServedRequest(request_id or uuid.uuid4().hex, list(prompt_ids), params, params.resolved_seed(),
                            Detokenizer(self.tokenizer, params.stop))
        self.waiting.append(req)
        self._wake.set()
        return req

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
            req.done = True
            req.events.put_nowait(Chunk([], "", finish_reason="abort", stats=req.stats()))
            self._wake.set()

    @property
    def num_active(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---------------------------------------------------------------- the loop

    async def _loop(self) -> None:
        while not self._stopping:
            if not self.waiting and not self.running:
                self._wake.clear()
                await self._wake.wait()
                if self._stopping:
                    return
            try:
                await self._probe()
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

    async def _probe(self) -> None:
        """Health probes of failed engines, at most every probe_interval."""
        now = time.monotonic()
        if (self.serving and (self.drafter_up or self.drafter is None)) or now - self._last_probe < self.cfg.probe_interval:
            return
        self._last_probe = now
        if not self.serving:
            try:
                await asyncio.wait_for(self.verifier.info(), self.cfg.probe_interval * 5)
                self._set_serving(True)
            except Exception:
                pass
        if self.drafter is not None and not self.drafter_up:
            try:
                await asyncio.wait_for(self.drafter.info(), self.cfg.drafter_timeout)
                self.drafter_up = True
                log.info("drafter is back; speculation resumes")
            except Exception:
                return
            live = {r.request_id for r in self.running}   # these are re-prefilled, which resets them
            orphans = sorted(self._drafter_orphans - live)
            self._drafter_orphans.clear()
            if orphans:
                try:
                    await asyncio.wait_for(self.drafter.release(orphans), self.cfg.drafter_timeout)
                except (EngineUnavailable, asyncio.TimeoutError) as exc:
                    self._drafter_failed(exc)

    def _set_serving(self, up: bool) -> None:
        if up != self.serving:
            self.serving = up
            log.warning("verifier %s", "is back" if up else "is unavailable")
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
            if not self.kv.fits([x.committed_len for x in self.running + batch], need):
                break  # first come, first served: later requests wait behind this one
            self.waiting.remove(r)
            batch.append(r)
        if not batch:
            return
        items = [VerifierPrefillItem(Tag(r.request_id, r.epoch, r.committed_len if r.preempted else len(r.prompt_ids)),
                                     r.prompt_ids + r.tokens if r.preempted else r.prompt_ids, r.params, r.seed,
                                     resume=r.preempted)
                 for r in batch]
        # "auto" settled on plain at this batch size: admit without the drafter (router/pipeline.py).
        detach = self.drafter is not None and self._modes.settled_plain(len(self.running) + len(batch))
        try:
            results = await self.verifier.prefill(items, self.cfg.want_features and not detach)
        except EngineUnavailable as exc:
            self._verifier_failed(batch, exc)
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

    async def _drafter_prefill(self, reqs: list[ServedRequest], features: list) -> None:
        items = [DrafterPrefillItem(r.tag(), r.prompt_ids + r.tokens[:-1], r.tokens[-1], r.params, r.seed, f)
                 for r, f in zip(reqs, features)]
        try:
            untaken = await asyncio.wait_for(self.drafter.prefill(items), self.cfg.drafter_timeout)
            for r in reqs:
                r.on_drafter = r.request_id not in untaken   # untaken: resynced before the next draft
                r.drafter_kept = False   # the prefill took the kept tree back, or dropped it
        except (EngineUnavailable, asyncio.TimeoutError, StaleMessage) as exc:
            self._drafter_failed(exc)

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
            r.events.put_nowait(Chunk(new, text, prompt_tokens=len(r.prompt_ids) if first else 0))
            return True
        text += r.detok.flush()
        r.done = True
        self.counters.requests_finished += 1
        self._emit("finished", r, reason)
        r.events.put_nowait(Chunk(new, text, finish_reason=reason, stats=r.stats(),
                                  prompt_tokens=len(r.prompt_ids) if first else 0))
        return False

    def _finish_failure(self, r: ServedRequest, failure: Failure) -> None:
        if not r.done:
            self.counters.requests_failed += 1
            self._emit("failed", r, failure.code)
            r.done = True
            r.events.put_nowait(failure)

    def _verifier_failed(self, reqs: list[ServedRequest], exc: Exception) -> None:
        log.error("verifier failed: %s", exc)
        for r in reqs + self.waiting:
            self._finish_failure(r, Failure("UNAVAILABLE", f"the verifier is unavailable: {exc}"))
        self.waiting = []
        self._set_serving(False)
        self._last_probe = time.monotonic()

    def _drafter_failed(self, exc: Exception) -> None:
        if self.drafter_up:
            log.warning("drafter unavailable (%s): decoding without drafts", exc)
        self.drafter_up = False
        self._last_probe = time.monotonic()
        for r in self.running:
            if r.on_drafter:
                self._drafter_orphans.add(r.request_id)
            r.on_drafter = False
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None

    async def _forget_kept(self, reqs: list[ServedRequest]) -> None:
        """Releases the drafter's kept trees of preempted requests that will not resume."""
        kept = [r for r in reqs if r.drafter_kept]
        for r in kept:
            r.drafter_kept = False
        if kept and not self.drafter_up:
            self._drafter_orphans.update(r.request_id for r in kept)
        elif kept:
            try:
                await asyncio.wait_for(self.drafter.release([r.request_id for r in kept]), self.cfg.drafter_timeout)
            except (EngineUnavailable, asyncio.TimeoutError):
                self._drafter_orphans.update(r.request_id for r in kept)
                self._drafter_failed(EngineUnavailable("release failed"))

    async def _release(self, reqs: list[ServedRequest], keep_draft: bool = False) -> None:
        """Frees the requests on both sides; keep_draft (preemption): the drafter keeps each
        one's ready next tree for its resume."""
        if keep_draft:   # in step first: a preempted request's drafter keeps its next tree
            await self._flush_backlog([r for r in reqs if r.on_drafter])
        ids_v = [r.request_id for r in reqs if r.on_verifier]
        ids_d = [r.request_id for r in reqs if r.on_drafter]
        for r in reqs:
            r.drafter_kept = keep_draft and r.on_drafter and self.drafter_up
            r.on_verifier = r.on_drafter = False
            r.backlog.clear()
            r.ahead_trees = r.next_tree = None
        if ids_v and self.serving:
            try:
                await self.verifier.release(ids_v)
            except EngineUnavailable:
                pass
        if ids_d and self.drafter_up:
            try:
                await asyncio.wait_for(self.drafter.release(ids_d, keep_draft), self.cfg.drafter_timeout)
            except (EngineUnavailable, asyncio.TimeoutError):
                self._drafter_orphans.update(ids_d)
                self._drafter_failed(EngineUnavailable("release failed"))
