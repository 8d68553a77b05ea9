"""The in-process links of router/links.py: the engines of this process, each call run in a
worker thread so the event loop keeps streaming while a forward runs. The verifier's link also
chains verifies (VerifierEngine.arm_next) on a GPU. What both share (a worker thread, a CUDA
stream, busy time) is router/local_base.py."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass

from router.link_handoffs import PreAhead, PreCalls, PreDraft, StagedTrees, item_key
from spectandem.protocol import DraftHandle, Tag
from router.local_base import _LocalLink


# How long an armed verify's call waits for stage_next. The router always stages (None when
# the drafter has nothing) once its draft-ahead call returns or times out: this only bounds a
# caller that arms and never stages. Past it the call ends without a launch.
STAGE_WAIT_S = 30.0


@dataclass(frozen=True, kw_only=True)
class LocalLinkTuning:
    """Timing choices of the in-process links on a GPU, given to both links by whoever builds
    them (on the CPU the engines compute inside the calls, so the holds and early launches are
    off there whatever these say; tests set the links' attributes to check them on the CPU).

    chained_verify: a verify armed with the next trees queues the verdict's next forward itself
    (LocalVerifierLink.arm_next; False: the router launches every verify).
    drafter_first_s: after a chained launch (or a miss) the verifier's worker starts the
    drafter's next call, then holds the verdict back from the router until that call's drafting
    is queued on the device, at most this long. The drafter's host work before its graph
    (catch-up bookkeeping, the graph's inputs) is on the round's critical path; the router's
    turn is not, and at the Python lock it would stretch the drafter's by its own length. 0: off.
    launch_first_s: the other way at the verdict: a pre-ahead whose trees went straight to an
    armed verify tells the router it is done only once that verify has launched from them (at
    most this long), so that the router's turn on its reply does not hold the Python lock
    between the verdict and the launch. 0: off.
    launch_missed: after a miss, the drafter's pre-draft gives its tree straight to the
    verifier, which launches it then and there (LocalVerifierLink._launch_missed); False leaves
    the launch to the router's verify call.
    launch_missed_early: that launch goes out as soon as the pre-draft's argmax chain is queued
    on the drafter's device, its token ids copied from there on the device
    (LocalVerifierLink._launch_missed_early), not once the host has them.
    ahead_after_miss: after a miss whose tree the verifier launched at once, the drafter's
    worker drafts ahead for that tree right away (a pre-ahead queued behind the pre-draft), not
    at the router's turn: the router's draft-ahead call of that round takes its reply.
    prepare_launch: the staged trees come before the verdict: the verifier packs the next
    verify's inputs for each outcome then (VerifierEngine.prepare_next, one request), and the
    verdict's launch only picks one; False packs them at the verdict.
    switch_interval_s: the interpreter's switch interval while both engines and the router share
    this process (router/local_base.py shorten_switch_interval; 0 keeps the interpreter's). A
    process-wide setting: the entry point that builds the links applies it, the links do not.

    The defaults are today's choices; benchmarks/results/README.md has the GPU comparisons that
    chose them. Whether each is still worth keeping is a GPU measurement (on and off in turn)."""

    chained_verify: bool = True
    drafter_first_s: float = 0.004
    launch_first_s: float = 0.01
    launch_missed: bool = True
    launch_missed_early: bool = True
    ahead_after_miss: bool = True
    prepare_launch: bool = True
    switch_interval_s: float = 0.0005

    def __post_init__(self):
        for name in ("drafter_first_s", "launch_first_s", "switch_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
        for name in ("chained_verify", "launch_missed", "launch_missed_early", "ahead_after_miss", "prepare_launch"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")

    @staticmethod
    def from_settings(settings: list[str]) -> "LocalLinkTuning":
        """NAME=VALUE strings (a flag's values) -> the tuning with those fields changed; an
        unknown name or a value of the wrong kind is refused."""
        fields = {f.name: f for f in dataclasses.fields(LocalLinkTuning)}
        changes: dict = {}
        for setting in settings:
            name, sep, text = setting.partition("=")
            name = name.strip().replace("-", "_")
            if not sep or name not in fields:
                raise ValueError(f"{setting!r}: expected NAME=VALUE with NAME one of {', '.join(fields)}")
            if isinstance(getattr(LocalLinkTuning(), name), bool):
                if text.strip().lower() not in ("0", "1", "true", "false", "on", "off"):
                    raise ValueError(f"{setting!r}: {name} takes 1/0 (true/false, on/off)")
                changes[name] = text.strip().lower() in ("1", "true", "on")
            else:
                try:
                    changes[name] = float(text)
                except ValueError:
                    raise ValueError(f"{setting!r}: {name} takes a number of seconds") from None
        return LocalLinkTuning(**changes)


class LocalVerifierLink(_LocalLink):
    """`chain`: chained verifies (VerifierEngine.arm_next; router/loop.py), by default where the
    engine computes on a GPU (unless `tuning.chained_verify` is off). The armed verify's call, once
    it has the verdict, waits for the staged trees (from the drafter's worker, `direct_stage`,
    or the router's `stage_next`, whichever first) and queues the verdict's next tree's forward,
    which runs while the router takes in the verdict; then it starts the drafter's next call
    (LocalDrafterLink.pre_ahead). That wait does not count as busy. On a CPU the forward runs in
    the launch itself (tests turn chaining on there to check the tokens)."""

    role = "verifier"

    def __init__(self, engine, model_name: str = "target", chain: bool | None = None,
                 tuning: LocalLinkTuning = LocalLinkTuning()):
        super().__init__(engine, model_name)
        if chain is None:
            chain = self._stream is not None and tuning.chained_verify
        self.prepare_launch = tuning.prepare_launch
        self.chains = chain
        self._chain_end: float | None = None   # when the call that queued a chained verify ended
        self._queued = False                   # the call now running queued one
        self._waited = 0.0                     # seconds the call now running waited for trees
        self.chained_launches = 0
        self.direct_staged = 0                 # trees staged by the drafter's worker (direct_stage)
        # A miss's tree launched as soon as the drafter's pre-draft has it (`_launch_missed`).
        self.launch_missed = chain and tuning.launch_missed
        self.missed_launches = 0
        self.launch_missed_early = tuning.launch_missed_early and getattr(getattr(engine, "runner", None), "takes_device_tokens", False)
        self.missed_early_launches = 0   # of missed_launches, from the drafter's device tokens
        self._armed: StagedTrees | None = None     # the last arm_next's, for its verify
        # On a GPU the verdict waits for the drafter's next call to queue its drafting
        # (tuning.drafter_first_s); on the CPU that call computes, so it does not (tests turn it on).
        self.drafter_first_s = tuning.drafter_first_s if self._stream is not None else 0.0
        self._staging: StagedTrees | None = None   # the same, for stage_next

    def _busy_from(self, kind: str, start: float) -> float:
        # A verify served by a chained launch was busy from the end of the call that queued it;
        # an armed verify was idle while it waited for the staged trees.
        if kind != "verify":
            return start
        if self._chain_end is not None and self.engine.last_chained:
            start = self._chain_end
        return start + self._waited

    def _ended(self, kind: str, end: float) -> None:
        if kind == "verify":
            self._chain_end, self._queued, self._waited = (end if self._queued else None), False, 0.0

    def arm_next(self, tags: list[Tag], then=None, missed=None) -> bool:
        """Before a verify of exactly `tags`: once its verdict is in and `stage_next` has given
        the next trees, the verifier starts the verdict's one, and then calls `then(results)`
        (the verify's Verdicts) from its worker; given trees but none for the verdict (a
        miss, or no room), it calls `missed(results)` instead. Where either returns a started
        drafter call (`wait_queued`), the verify's call returns once that call's drafting is
        queued (`drafter_first_s` at most). False: not chaining."""
        if not self.chains:
            return False
        ids, lens = [t.request_id for t in tags], [t.committed_len for t in tags]
        prepare = getattr(self.engine, "prepare_next", None) if self.prepare_launch else None
        self._armed = self._staging = StagedTrees(
            ids, lens, then, missed, None if prepare is None else lambda trees: prepare(ids, lens, trees))
        return True

    def stage_next(self, trees: list[dict | None] | None) -> None:
        """From the event loop, once per arm_next, while or after that verify runs: the
        draft-ahead trees per request (AheadReply.trees, in the armed tags' order), or None
        (none come)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.put_trees(trees)

    def direct_stage(self):
        """Stages the armed verify's trees from any thread (the first of it and stage_next
        wins), or None unarmed. `direct_staged` counts the stagings it won."""
        staging = self._staging
        if staging is None:
            return None

        def stage(trees) -> StagedTrees | None:
            """-> the staging, when these trees are the ones it holds."""
            if staging.put_trees(trees):
                self.direct_staged += 1    # one drafter worker at a time calls it
                return staging
            return None
        return stage

    def _verify(self, armed, *args):
        """verifier_verify(*args), its work synchronized. `armed` (a StagedTrees): the engine
        keeps the verdict and, from inside the verify, once the round's work is queued and before
        its outputs are built, calls `_launch_next`: it waits for the staged trees, queues the
        verdict's next tree and starts the drafter's next call (the armed `then`, the router's
        pre-ahead; after a miss, `missed`, its pre-draft). The router takes in the verdict only
        after that: its host work would otherwise hold the Python lock the launch and the
        drafter's call need."""
        from verifier.service_core import verifier_verify

        staged = []      # the trees the launch had (or None), once the engine's verdict hook ran
        self._started = None
        if armed is not None:   # in this thread: the engine's last chained launch is done
            _, tree, tags, _, want_features, *_ = args
            self.engine.arm_next(armed.request_ids, armed.committed_lens,
                                 lambda: staged.append(self._launch_next(armed, want_features)))
        out = verifier_verify(*args)
        if self._stream is not None and not staged:   # (the verdict hook synchronized its round's work)
            self._stream.synchronize()
        started, self._started = self._started, None
        if self.drafter_first_s > 0 and hasattr(started, "wait_queued"):
            t0 = time.perf_counter()   # the drafter's host work first (drafter_first_s)
            started.wait_queued(self.drafter_first_s)
            self._waited += time.perf_counter() - t0
        return out

    def _launch_missed(self, tree) -> None:
        """From the drafter's worker, once a miss's pre-draft has its tree: its forward is queued
        now (VerifierEngine.launch), not after the router's turn; the router's verify of that
        tree, which follows, takes it. The verifier is idle: its last call ended with the miss.
        Where `_launch_missed_early` launched it already, that launch is confirmed instead.
        -> whether it launched."""
        with self._engine_lock:
            if self.engine.confirm_launch(tree):
                return True
            if self._on_stream(self.engine.launch, tree):   # busy from here (_busy_from), as after a chained launch
                self._chain_end = time.perf_counter()
                self.missed_launches += 1
                return True
        return False

    def _launch_missed_early(self, tree, tokens, ready) -> bool:
        """From the drafter's worker, as soon as a miss's pre-draft has queued its argmax chain
        on the drafter's device (PreDraft.on_device): the tree's forward is queued now, its
        token ids copied from the drafter's device behind that drafting (VerifierEngine.launch's
        device_tokens), so the host's wait for the chain and its bookkeeping overlap the
        drafting; `_launch_missed` confirms it once the host has the tree. -> whether it launched."""
        with self._engine_lock:
            if self._on_stream(self.engine.launch, tree, False, None, (tokens, ready)):
                self._chain_end = time.perf_counter()
                self.missed_launches += 1
                self.missed_early_launches += 1
                return True
        return False

    def _launch_next(self, armed, want_features: bool):
        """The engine's verdict hook of an armed verify (VerifierEngine.arm_next): waits for the
        staged trees and queues the verdict's next tree (VerifierEngine.launch_next; made already
        where its inputs were prepared); then, once that round's own work is done (the engine's
        `round_done`), starts the drafter's next call (`_follow`) -> the trees (None: none came)."""
        verdict = self.engine.take_verdict()
        t0 = time.perf_counter()
        trees = armed.wait(STAGE_WAIT_S)
        self._waited = time.perf_counter() - t0
        try:
            self._queued = trees is not None and self.engine.launch_next(verdict, trees)
            self.chained_launches += self._queued
            if self._stream is not None:   # what the results hand on (the features) is complete
                (self.engine.round_done or self._stream).synchronize()
            self._started = self._follow(armed, trees, want_features)
        finally:
            armed.taken()
        return trees

    def _follow(self, armed, trees, want_features: bool):
        """From the verdict hook: the drafter's next call, with this verdict's results (the
        verify's own, built early: VerifierEngine.verdict_outputs). After a chained launch the
        armed `then` (a pre-ahead); after a verdict whose trees came but held none for it (a
        miss) `missed` (a pre-draft), whose tree the verifier launches as soon as it has it
        (`_launch_missed`). -> what it returned (None: neither). Given to the armed handoff
        (`StagedTrees.follower`): the pre-ahead that staged the trees holds its reply back from
        the router until this call's drafting is queued (router/link_handoffs.py)."""
        from verifier.service_core import handed_on

        fn = armed.then if self._queued else (armed.missed if trees is not None else None)
        if fn is None:
            return None
        started = fn(handed_on(self.engine.verdict_outputs(), want_features))
        if not self._queued and self.launch_missed and hasattr(started, "on_ready"):
            if self.launch_missed_early and hasattr(started, "on_device"):
                started.on_device(self._launch_missed_early)
            started.on_ready(self._launch_missed)
        armed.follower = started
        return started

    async def prefill(self, items, want_features):
        from verifier.service_core import verifier_prefill

        return await self._run("prefill", verifier_prefill, self.engine, items, want_features)

    async def verify(self, draft, plain, want_features, on_launch=None):
        """`on_launch()`: from the worker thread, once the forward is queued (VerifierEngine.verify)."""
        armed, self._armed = self._armed, None
        return await self._run("verify", self._verify, armed, self.engine, draft.payload if draft else None,
                               [d for d in (draft.tags if draft else [])], plain, want_features, None, on_launch,
                               sync=False)

    async def features(self, tag):
        from verifier.service_core import verifier_features

        return await self._run("features", verifier_features, self.engine, tag)

    async def release(self, request_ids):
        await self._run("release", lambda: [self.engine.release(r) for r in request_ids])

    async def info(self):
        from verifier.service_core import verifier_info

        return verifier_info(self.engine, self.model_name)

    async def close(self):
        return None


class LocalDrafterLink(PreCalls, _LocalLink):
    """`pre_ahead`: the verifier link, having launched a chained verify, starts the drafter's next
    draft-ahead call itself (its arguments are the verdict's), so the drafter does not wait for
    the router's turn; the router's own call of the same arguments takes its reply. `pre_draft`:
    the same for a verdict that did not chain (a miss): the catch-up and the next draft."""

    role = "drafter"

    def __init__(self, engine, model_name: str = "draft", tuning: LocalLinkTuning = LocalLinkTuning()):
        super().__init__(engine, model_name)
        self._init_pre_calls()
        self.pre_ahead_used = 0                       # draft_ahead calls answered by a pre-ahead
        self.pre_draft_used = 0                       # draft calls answered by a pre-draft
        self.pre_drafts = 0                           # pre-drafts started
        self.ahead_after_miss_used = 0                # draft_ahead calls answered by a pre-draft's pre-ahead
        # A pre-draft's tree launched at once gets its draft-ahead next, from this link's worker
        # (tuning.ahead_after_miss); on the CPU that launch runs the forward, so it does not (tests turn it on).
        self.ahead_after_miss = tuning.ahead_after_miss and self._stream is not None
        # On a GPU a pre-ahead's reply waits for the verifier's launch (tuning.launch_first_s); on
        # the CPU that launch runs the forward, so it does not (tests turn it on).
        self.launch_first_s = tuning.launch_first_s if self._stream is not None else 0.0

    def pre_ahead(self, tags: list[Tag], extend: list) -> PreAhead:
        """From any thread: starts draft_ahead(tags, extend) now, in this link's pre-call thread
        (one engine call at a time, as every call). The next draft_ahead whose tags and catch-up
        items it covers returns its reply; any other call first waits for it and skips the items
        it absorbed (extend, draft_ahead). -> the started call (`wait_queued`)."""
        return self._start(PreAhead(list(tags), list(extend)))

    def pre_draft(self, tags: list[Tag], extend: list) -> PreDraft:
        """From any thread: starts extend(extend) then draft(tags) now, in the same thread as
        pre_ahead. The next draft of exactly these tags (configured depth) returns its tree;
        any other call first waits for it and skips the items it absorbed. With
        `ahead_after_miss`, a pre-ahead of the same tags follows it in that thread, for the tree
        the verifier launches from it at once (PreAhead.after); the next draft_ahead of these
        tags returns its reply."""
        self.pre_drafts += 1
        job = PreDraft(list(tags), list(extend))
        if not self.ahead_after_miss:
            return self._start(job)
        return self._start(job, PreAhead(list(tags), [], after=job))

    async def _run(self, kind: str, fn, *args, sync: bool = True):
        # A pre-call the verifier's worker started (before the router had that verdict) goes
        # first: the router's calls that follow the verdict see its effects.
        job = self._last_pre
        if job is not None and not job.done:
            await job.result()
        return await super()._run(kind, fn, *args, sync=sync)

    async def prefill(self, items):
        from drafter.service_core import drafter_prefill

        return await self._run("prefill", drafter_prefill, self.engine, items)

    async def draft(self, tags, num_steps=None, extend=()):
        """`extend` and the trees in one worker call; with pre-calls pending, `extend` as its own
        call first (a pre-draft, pre_draft, covers the two in turn)."""
        if extend and not self._pending:
            tree, known, unknown = await self._run("draft", self._extend_and_draft, tags, num_steps, list(extend))
            return DraftHandle(known, tree, unknown)
        unknown = await self.extend(list(extend)) if extend else []
        if unknown:
            keep = [i for i, t in enumerate(tags) if t.request_id not in unknown]
            tags, num_steps = [tags[i] for i in keep], [num_steps[i] for i in keep] if num_steps else None
            if not tags:
                return DraftHandle([], None, unknown)
        job = self._claim(PreDraft, tags, num_steps)
        if job is not None:
            async with self._lock:
                tree = await job.result()
            if tree is not None:
                self.pre_draft_used += 1
                return DraftHandle(tags, tree, unknown)
        return DraftHandle(tags, await self._run("draft", self._draft, tags, num_steps), unknown)

    def _extend_and_draft(self, tags, num_steps, extend):
        from drafter.service_core import drafter_extend_and_draft

        return drafter_extend_and_draft(self.engine, tags, num_steps, self._unabsorbed(extend))

    def _draft(self, tags, num_steps):
        from drafter.service_core import drafter_draft

        self._raise_pre_failure()   # any pre-call is done: this call has the engine
        return drafter_draft(self.engine, tags, num_steps)

    async def draft_ahead(self, tags, extend=(), on_trees=None):
        """`on_trees(reply.trees)` from the worker, once the trees are on the host (the
        verifier link's direct_stage: the verifier gets them before the router's turn)."""
        job = self._claim(PreAhead, tags, extend)
        if job is not None:
            async with self._lock:
                reply = await job.result(on_trees)
            if reply is None:
                self._raise_pre_failure()
            if reply is not None:   # (None: it skipped its work, PreAhead.skipped; the call below)
                self.pre_ahead_used += job.after is None
                self.ahead_after_miss_used += job.after is not None
                self._absorbed.difference_update(item_key(i) for i in extend)
                return job.restricted(reply, tags)
        return await self._run("draft_ahead", self._draft_ahead, on_trees, tags, list(extend))

    def _draft_ahead(self, on_trees, tags, extend):
        from drafter.service_core import drafter_draft_ahead

        return drafter_draft_ahead(self.engine, tags, self._unabsorbed(extend), on_trees=on_trees)

    def ready_handle(self, tree, tags):
        return DraftHandle(list(tags), tree)

    async def extend(self, items):
        from drafter.service_core import drafter_extend

        items = list(items)
        job = self._absorbing(items)
        if job is not None:   # a miss's pre-draft absorbs them: its end, not the pre-ahead queued behind it
            async with self._lock:
                await job.result()
            items = self._unabsorbed(items)
            if not items:
                return []
        return await self._run("extend", lambda: drafter_extend(self.engine, self._unabsorbed(items)))

    async def release(self, request_ids, keep_draft=False):
        from drafter.service_core import drafter_release

        def release():
            self._absorbed = {a for a in self._absorbed if a[0] not in request_ids}
            return drafter_release(self.engine, request_ids, keep_draft)
        await self._run("release", release)

    async def info(self):
        from drafter.service_core import drafter_info

        return drafter_info(self.engine, self.model_name)

    async def close(self):
        return None


class LocalChain:
    """Chained verifies (router/links.py `ChainedVerifies`) over the in-process pair of links: the
    verifier link arms and launches (VerifierEngine.arm_next, launch_next), the drafter link starts
    the calls that follow (pre_ahead, pre_draft), and its draft ahead stages the trees on the
    verifier straight from its worker."""

    def __init__(self, verifier: LocalVerifierLink, drafter: LocalDrafterLink):
        self.verifier, self.drafter = verifier, drafter

    def arm_next(self, tags, then=None, missed=None) -> bool:
        return self.verifier.arm_next(tags, then, missed)

    def stage_next(self, trees) -> None:
        self.verifier.stage_next(trees)

    async def draft_ahead(self, tags, extend=()):
        return await self.drafter.draft_ahead(tags, extend, self.verifier.direct_stage())

    def pre_ahead(self, tags, extend) -> PreAhead:
        return self.drafter.pre_ahead(tags, extend)

    def pre_draft(self, tags, extend) -> PreDraft:
        return self.drafter.pre_draft(tags, extend)
