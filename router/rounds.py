"""How one round runs over the router's running requests, in the mode router/pipeline.py
chooses: sequential (draft, verify, extend), ahead (the drafter fills its outcome cache while the
verifier verifies), ping-pong (two halves, the drafter on one while the verifier verifies the
other), short drafts or plain.

A round first releases finished requests, preempts until the next round fits (Router._plan) and
re-prefills the drafter with the requests it does not hold (`_resync`). Then, per group of
requests: `_draft` (a tree for the requests the drafter holds; the others decode plainly),
`_verify` (one batched verify of drafted and plain rows), `_apply` (commit and stream each
verdict, drop stale ones) and `_extend` (the drafter's catch-up). A drafter that fails or is too
slow only takes the drafts out of the round; a verifier that fails ends the round.
"""

from __future__ import annotations

import asyncio
import logging
import time

from router.links import DrafterLink, EngineUnavailable, VerifierLink
from spectandem.protocol import ExtendItem, PlainItem, Tag
from router.pipeline import LARGE_BATCH, ModeChooser, SpeculationSwitch
from router.requests import RouterConfig, RouterCounters, ServedRequest
from spectandem.messages import StaleMessage, trees_from_ready


log = logging.getLogger("spectandem.router")
AHEAD_UNANSWERED_ROUNDS = 3   # "ahead" rounds in a row without a hit or miss: the drafter does not draft ahead


class RoundsMixin:
    """The rounds of `Router` (router/scheduler.py), which holds the state they work on (below)
    and the helpers they call: `_release`, `_plan` (preemption), `_commit` (stream a verdict's
    tokens), `_drafter_prefill`, `_drafter_failed` and `_verifier_failed`."""

    verifier: VerifierLink
    drafter: DrafterLink | None
    cfg: RouterConfig
    running: list[ServedRequest]
    waiting: list[ServedRequest]
    drafter_up: bool
    counters: RouterCounters
    _modes: ModeChooser
    _mode: str
    _switch: SpeculationSwitch
    _tokens_committed: int
    _ahead_unanswered: int = 0
    _staged: bool = False          # the last round staged every request's next trees on the verifier
    _from_ready: bool = False      # this round's tree is the router's own (every request hit)
    _capped_plain: bool = False    # this round's plain steps were cut by the requests' ends
    _drafted_any: bool = False     # this round drafted for some request
    _draft_failed: frozenset = frozenset()   # ids whose draft this round came back unusable (stale)

    async def _round(self) -> None:
        finished = [r for r in self.running if r.done]
        self.running = [r for r in self.running if not r.done]
        await self._release(finished)
        await self._plan()
        if not self.running:
            return
        await self._resync()
        mode = self._mode = self._modes.choose(len(self.running), self.drafter_up)
        t0, before = time.perf_counter(), self._tokens_committed
        self._capped_plain = self._drafted_any = False
        self._draft_failed = frozenset()
        if mode == "pingpong":
            await self._pingpong_round()
        else:
            await self._sequential_round(ahead=mode == "ahead")
        # A plain round whose steps were cut by the requests' ends decodes fewer tokens than the
        # mode does: the batch's tail, not plain decoding's rate. It does not count as a measurement,
        # nor does a speculating round that drafted for no request (all detached: router/pipeline.py).
        detached_only = not self._drafted_any and any(r.detached for r in self.running)
        if not self._capped_plain and (mode == "plain" or not detached_only):
            self._modes.record(mode, self._tokens_committed - before, time.perf_counter() - t0)

    async def _sequential_round(self, ahead: bool = False) -> None:
        """Draft, verify, extend. `ahead`: while the verifier verifies, the drafter prepares the
        next trees for the likeliest outcomes; on a hit the next draft call returns at once and
        the catch-up with the real features runs while the verifier is busy again."""
        draft, drafted = await self._draft(self.running)
        # The verifier started this round's tree itself (the last round staged its trees, and
        # the router holds every request's tree for the verdict): its host work is done, the
        # drafter goes at once. Otherwise the drafter's turn comes once the forward is queued.
        started, self._staged = self._staged and self._from_ready, False
        gate = ahead and drafted and not started
        launched = asyncio.get_running_loop().create_future() if gate else None
        chain = ahead and self._chains(drafted) and self.verifier.arm_next([r.tag() for r in drafted],
                                                                            then=self._pre_ahead,
                                                                            missed=self._pre_draft)
        verify = asyncio.ensure_future(self._verify(draft, drafted, self.running, launched))
        try:
            if launched is not None:   # the drafter's turn once the verify forward is queued
                await asyncio.wait([launched, verify], return_when=asyncio.FIRST_COMPLETED)
            cached = [r for r in drafted if self._cached(r, ahead)]
            if cached:   # with their held-back catch-ups (the last verdict's, if it hit), in one call
                # Chaining, the trees go straight to the verifier where the link can (the same
                # order: every drafted request is cached); the router stages them too, below.
                direct = self.verifier.direct_stage() if chain and cached == drafted else None
                await self._draft_ahead(cached, self._take_backlog(cached), direct)
        finally:
            if chain:   # the verifier starts the verdict's next tree itself, if it has one
                trees = [r.ahead_trees[1] if r.ahead_trees is not None else None for r in drafted]
                self._staged = all(t is not None for t in trees)
                self.verifier.stage_next(trees)
            results = await verify
        if results is not None:
            extend = self._apply(results, drafted, self.running)
            ready = {r.request_id for r in drafted if r.next_tree is not None}
            if extend and ahead and all(i.tag.request_id in ready for i in extend):
                # Every drafted request hit and the router holds its next tree: the next round's
                # verify goes out first, and this catch-up rides with its draft-ahead call.
                by_id = {r.request_id: r for r in drafted}
                for item in extend:
                    by_id[item.tag.request_id].backlog.append(item)
            elif extend:   # after what the requests still hold back, in order
                await self._extend(self._take_backlog(drafted) + extend)

    def _pre_ahead(self, results):
        """From the verifier link's worker, once it has launched a chained verify (every request
        hit): the drafter's next draft-ahead call starts now with the arguments the router's
        next round gives it (this verdict's catch-ups), where the drafter link can
        (DrafterLink.pre_ahead). Its reply answers that call. -> what pre_ahead returns."""
        return self.drafter.pre_ahead(*_next_call_args(results))

    def _pre_draft(self, results):
        """From the verifier link's worker, when an armed verify's verdict did not chain (a miss):
        the drafter's catch-up and the next round's draft start now, with the arguments the
        router's next calls give (DrafterLink.pre_draft). Its tree answers that draft call.
        -> what pre_draft returns."""
        return self.drafter.pre_draft(*_next_call_args(results))

    def _cached(self, r: ServedRequest, ahead: bool) -> bool:
        """Whether this ahead round drafts ahead for `r` (its next tree may be held for the router)."""
        return (ahead and r.on_drafter and self.drafter_up
                and (self.cfg.pipeline == "ahead" or self._invisible_when_plain(r)))

    def _chains(self, drafted: list[ServedRequest]) -> bool:
        """Whether this ahead round's verify may chain (VerifierLink.arm_next): every running
        request is drafted and drafted ahead, none waits to be admitted, none can reach its
        max_tokens in this round (it commits fewer than lookahead tokens) and the next tree fits
        the context, so the next round verifies the same requests with the trees draft ahead
        returns for this verdict. Else a chained verify would be dropped, its forward wasted
        (a request that stops on EOS or a stop string still wastes one)."""
        k = self.cfg.lookahead
        return (bool(drafted) and len(drafted) == len(self.running) and not self.waiting
                and all(self._cached(r, True) and r.params.max_tokens - len(r.tokens) > k
                        and r.committed_len + 2 * k <= self.cfg.max_len for r in drafted))

    async def _draft_ahead(self, reqs: list[ServedRequest], extend: list[ExtendItem] = (),
                           on_trees=None) -> None:
        """Draft ahead for `reqs`, after the catch-up `extend` (held back by the last round).
        `on_trees`: the verifier link's direct_stage, for the drafter link."""
        try:
            reply = await asyncio.wait_for(self.drafter.draft_ahead([r.tag() for r in reqs], extend, on_trees),
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
        return r.params.greedy or r.params.temperature < self.cfg.draft_sampling_min_temperature

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
        fits = lambda r: r.committed_len - 1 + self.cfg.lookahead <= self.cfg.max_len
        spec_off = self._switch.off(self.counters.rounds) or self._mode == "plain"
        drafted = [r for r in group if self.drafter_up and r.on_drafter and fits(r)
                   and not (spec_off and self._invisible_when_plain(r))]
        ready = [r.next_tree for r in drafted]
        self._from_ready = False
        for r in group:
            r.next_tree = None       # a ready tree serves this round or none
        if drafted and all(t is not None and t[0] == r.committed_len for t, r in zip(ready, drafted)):
            # Draft ahead hit for every drafted request: the trees the router holds are those the
            # drafter would return (drafter/engine.py makes both from the same rows).
            tree = trees_from_ready([r.request_id for r in drafted], [r.committed_len for r in drafted],
                                    [t[1] for t in ready])
            self.counters.ready_trees += len(drafted)
            self._drafted_any = self._from_ready = True
            return self.drafter.ready_handle(tree, [r.tag() for r in drafted]), drafted
        if not drafted:
            return None, []
        self._drafted_any = True
        backlog = self._take_backlog(drafted)
        if backlog:   # held-back catch-ups (plain rounds, a hit's): the drafter must be in step first
            await self._extend(backlog)
            drafted = [r for r in drafted if r.on_drafter and self.drafter_up]
            if not drafted:
                return None, []
        steps = None
        if self._mode.startswith("short:"):   # shorter trees where the tree does not decide the tokens
            cap = int(self._mode.split(":")[1])
            steps = [cap if self._invisible_when_plain(r) else None for r in drafted]
        try:
            draft = await asyncio.wait_for(self.drafter.draft([r.tag() for r in drafted], steps),
                                           self.cfg.drafter_timeout)
        except (EngineUnavailable, asyncio.TimeoutError, StaleMessage) as exc:
            self._drafter_failed(exc)
            return None, []
        if list(draft.tags) != [r.tag() for r in drafted]:
            self.counters.stale_dropped += 1   # a draft of another epoch or length: never verified
            self._draft_failed = self._draft_failed | {r.request_id for r in drafted}
            return None, []
        return draft, drafted

    async def _verify(self, draft, drafted: list[ServedRequest], group: list[ServedRequest], launched=None):
        """One batched verify of the group (drafted rows, then plain rows); None if the verifier
        failed. `launched` (a future): resolved once the verifier's forward is queued (VerifierLink.verify's
        on_launch)."""
        steps = self._plain_steps(group) if not drafted else 1
        plain = [PlainItem(r.tag(), r.tokens[-1], steps) for r in group if r not in drafted]
        # No features for a round of detached requests only: no drafter will catch up on them.
        want = self.cfg.want_features and (any(r.on_drafter for r in group) or not any(r.detached for r in group))
        try:
            if launched is not None:
                loop = asyncio.get_running_loop()
                done = lambda: loop.call_soon_threadsafe(lambda: launched.done() or launched.set_result(None))
                return await self.verifier.verify(draft, plain, want, on_launch=done)
            return await self.verifier.verify(draft, plain, want)
        except EngineUnavailable as exc:
            self._verifier_failed(list(self.running), exc)
            self.running = []
            return None

    def _plain_steps(self, group: list[ServedRequest]) -> int:
        """Tokens per request of a round without drafts: cfg.plain_steps when every request is
        greedy, at most what each may still generate (max_tokens, the context). Sets
        `_capped_plain` when the requests' ends cut it."""
        k = self.cfg.plain_steps
        if k <= 1 or not all(r.params.greedy for r in group):
            return 1
        for r in group:
            k = min(k, r.params.max_tokens - len(r.tokens), self.cfg.max_len - r.committed_len + 1)
        self._capped_plain = self._capped_plain or k < self.cfg.plain_steps
        return max(k, 1)

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
                if self.drafter_up and (r.on_drafter or r.detached) and r.request_id not in self._draft_failed:
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
            unknown = await asyncio.wait_for(self.drafter.extend(items), self.cfg.drafter_timeout)
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
                 and not (r.detached and large)]
        for r in stale:
            r.detached = False
        if not stale:
            return
        feats = []
        try:
            for r in stale:
                feats.append(await self.verifier.features(r.tag()) if self.cfg.want_features else None)
        except EngineUnavailable as exc:
            self._verifier_failed(list(self.running), exc)
            self.running = []
            return
        await self._drafter_prefill(stale, feats)


def _next_call_args(results) -> tuple[list, list[ExtendItem]]:
    """A verdict's RoundResults -> the tags and catch-up items of the drafter's next call."""
    return [res.tag for res in results], [ExtendItem(res.tag, res.token_ids, res.features) for res in results]
