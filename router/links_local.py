"""The in-process links of router/links.py: the engines of this process, each call run in a
worker thread (each engine's own, or one both share on the CPU) so the event loop keeps
streaming while a forward runs. What both share (a worker
thread, a CUDA stream, busy time) is router/local_base.py.

Where each engine has a worker thread of its own (on GPUs), the two links can share a
TreeHandOff (spectandem/channel/trees.py), the tree channel of one process: a draft call with a
round to post hands its trees to the verifier's thread as soon as its stream is done, and a
verify whose handle is that round's TreeRoute takes them there, so a sequential round sends its
draft and its verify together and the verify starts without a turn of the event loop between
them.

The other way, a verifier link given its drafter link (`drafter=`) hands a verify's verdicts
straight to the drafter's thread where the router asks for it (`verify(draft_next=...)`): the
drafter catches up and drafts the next round's trees while the router commits the round, and
hands them back through the hand-off at once as early trees after the verify's tree round
(`TreeHandOff.post_early`), which the next round's verify takes without a draft call where they
hold its requests (`TreeRoute.early_after`); a draft call finds them made (drafter/next_trees.py)."""

from __future__ import annotations

from dataclasses import replace

from spectandem.channel.trees import rows_held
from spectandem.protocol import DraftHandle, DrafterPrefillItem, ExtendItem, TreeRoute
from router.local_base import _LocalLink


def _tree_round(draft) -> int:
    """The tree round of a verify's handle (0: its trees do not come over the hand-off)."""
    return draft.payload.round_id if draft is not None and isinstance(draft.payload, TreeRoute) else 0


def _check_trees(trees, thread) -> None:
    if trees is not None and thread is not None:
        raise ValueError("a tree hand-off needs a worker thread for each engine: a verify waiting for its trees "
                         "on a shared thread would keep the draft that posts them from running")


class LocalVerifierLink(_LocalLink):
    role = "verifier"

    def __init__(self, engine, model_name: str = "target", thread=None, trees=None, drafter=None):
        """`trees`: the TreeHandOff this link's verifies take a TreeRoute's trees from (None: a
        TreeRoute finds no trees). `drafter`: the LocalDrafterLink (a thread of its own) that a
        verify with `draft_next` hands its verdicts to."""
        _check_trees(trees, thread)
        if drafter is not None and (thread is not None or not drafter._own_thread):
            raise ValueError("handing verdicts to the drafter needs a worker thread for each engine")
        super().__init__(engine, model_name, thread)
        self.trees = trees
        self.drafter = drafter

    @property
    def hands_verdicts(self) -> bool:
        """Whether `verify` takes `draft_next` (router/links.py VerifierLink)."""
        return self.drafter is not None

    def _routed(self, fn):
        """`fn(engine, tree, tags, *rest)` for the worker thread, whose tree and tags, where the
        handle is a TreeRoute, are those the drafter hands off for its round, or, where the route
        names early trees (`early_after`), the rows of those it drafted on the last verdicts (none:
        the verify goes on with its plain rows)."""
        def run(engine, tree, tags, *rest):
            if isinstance(tree, TreeRoute):
                route = tree
                with self.clock.timing("verify.tree_wait"):
                    if self.trees is None:
                        taken = None
                    elif route.early_after:
                        want = list(route.early_tags)
                        taken = self.trees.take_early(route.round_id, route.wait_s, route.early_after, want,
                                                      lambda entry: rows_held(entry, want))
                    else:
                        taken = self.trees.take(route.round_id, route.wait_s)
                tree, tags = taken if taken is not None else (None, [])
            return fn(engine, tree, tags, *rest)
        return run

    async def prefill(self, items, want_features):
        from verifier.service_core import verifier_prefill

        return await self._run("prefill", verifier_prefill, self.engine, items, want_features)

    async def verify(self, draft, plain, want_features, on_launch=None, draft_next=None):
        """`on_launch()`: from the worker thread, once the forward is queued (VerifierEngine.verify).
        `draft_next` (request id -> committed length): the verdicts of these requests go to the
        drafter from this link's thread as soon as they are on the host; it catches up with them
        and drafts the next trees of those whose new committed length is below their bound."""
        from verifier.service_core import verifier_verify

        fn = self._routed(verifier_verify)
        if draft_next and self.drafter is not None:
            fn = self._handing_on(fn, dict(draft_next), _tree_round(draft))
        return await self._run("verify", fn, self.engine, draft.payload if draft else None,
                               list(draft.tags) if draft else [], plain, want_features, None, on_launch)

    def _handing_on(self, fn, bounds: dict[str, int], tree_round: int = 0, verdicts_of=lambda out: out,
                    prefills_of=lambda out: []):
        """`fn` (a verify for the worker thread), its verdicts (`verdicts_of` its result) of
        `bounds`' requests handed to the drafter once this engine's stream is done (their features
        complete), with the drafter prefills (`prefills_of` its result) of the requests its step
        prefilled that `bounds` names. The verdicts handed on come back marked `to_drafter`, the
        prefills `with_verdicts`. `tree_round`: the verify's tree round (0: none), whose verdicts
        the tree hand-off notes and whose early trees the drafter posts there."""
        def run(*args):
            outs = fn(*args)
            verdicts = [v for v in verdicts_of(outs) if v.tag.request_id in bounds and v.features is not None]
            prefills = [p for p in prefills_of(outs) if p.tag.request_id in bounds and p.features is not None]
            if not (verdicts or prefills):
                return outs
            if self._stream is not None:
                self._stream.synchronize()
            went = {v.tag.request_id for v in verdicts}
            early = tree_round if self.trees is not None else 0
            if early:
                self.trees.note_verdicts(early, went | {p.tag.request_id for p in prefills})
            self.drafter.draft_next(verdicts, bounds, prefills, early)
            from verifier.service_core import with_prefilled

            marked = [replace(v, to_drafter=True) if v.tag.request_id in went else v for v in verdicts_of(outs)]
            if prefills:   # a verify step's results: (verdicts, prefill results), the handed ones marked
                return marked, with_prefilled(outs[1], {p.tag.request_id for p in prefills})
            return marked
        return run

    async def verify_prefill(self, draft, plain, want_features, items, prefill_features, on_launch=None,
                             draft_next=None):
        """`verify` with `items` prefilled in the same step (the verdicts handed on as there)."""
        from verifier.service_core import verifier_verify_prefill

        fn = self._routed(verifier_verify_prefill)
        if draft_next and self.drafter is not None:
            def prefills_of(out):   # the drafter prefills, as the router's would carry them
                return [DrafterPrefillItem(res.tag, list(item.prompt_ids), res.first_token_id, item.params, item.seed,
                                           res.features) for item, res in zip(items, out[1]) if not item.resume]
            fn = self._handing_on(fn, dict(draft_next), _tree_round(draft), lambda out: out[0], prefills_of)
        return await self._run("verify", fn, self.engine,
                               draft.payload if draft else None,
                               list(draft.tags) if draft else [], plain, want_features, list(items),
                               prefill_features, None, on_launch)

    async def features(self, tag):
        from verifier.service_core import verifier_features

        return await self._run("features", verifier_features, self.engine, tag)

    async def release(self, request_ids):
        await self._run("release", lambda: [self.engine.release(r) for r in request_ids])

    async def info(self):
        from verifier.service_core import verifier_info

        info = verifier_info(self.engine, self.model_name)
        if self.trees is not None:
            info.extra.update(tree_channel=self.trees.state, early_trees_taken=self.trees.early_taken)
        info.calls = self.clock.stats()
        return info

    async def close(self):
        self.close_thread()


class LocalDrafterLink(_LocalLink):
    role = "drafter"

    def __init__(self, engine, model_name: str = "draft", thread=None, trees=None):
        """`trees`: the TreeHandOff a draft with a round to post hands its trees to."""
        _check_trees(trees, thread)
        super().__init__(engine, model_name, thread)
        self.trees = trees
        from drafter.calls import DrafterCalls

        self.drafter = DrafterCalls(engine)   # called in the worker thread only

    def draft_next(self, verdicts, bounds: dict[str, int], prefills=(), early_after: int = 0) -> None:
        """From the verifier's worker thread (LocalVerifierLink `draft_next`): queues, in this
        link's thread, the prefills, the catch-up of these verdicts and the next trees of the
        requests whose new committed length is below `bounds[request id]` (drafter/next_trees.py).
        `early_after`: the verify's tree round, after which the trees made go to the tree hand-off
        at once as early trees (`TreeHandOff.post_early`; none where it is 0). Returns at once."""
        items = [ExtendItem(v.tag, list(v.token_ids), v.features) for v in verdicts]
        post = self._posting_early(early_after) if early_after and self.trees is not None else None
        self._thread.submit(self._call, "draft_next", self.drafter.draft_on, items, dict(bounds), None, post,
                            list(prefills))

    def _posting_early(self, after_round: int):
        """NextTrees.draft_on's `post`: the trees made to the tree hand-off as early trees after
        `after_round`, complete on the device first."""
        def post(tree, tags):
            if tree is not None and self._stream is not None:
                self._stream.synchronize()
            self.trees.post_early(after_round, tree, tags)
        return post

    async def prefill(self, items):
        return await self._run("prefill", self.drafter.prefill, list(items))

    async def draft(self, tags, num_steps=None, extend=(), post_round=0):
        """`extend` and the trees in one worker call; with `post_round`, the trees handed to the
        verifier's thread as that round once this engine's stream is done (the handle then carries
        none)."""
        if not post_round or self.trees is None:
            # Without a hand-off nothing is posted (the router then drafts apart for a while), but the
            # catch-up is absorbed all the same, as an engine service without its channel does.
            tree, known, unknown = await self._run("draft", self.drafter.draft, list(tags), num_steps, list(extend))
            return DraftHandle(known, tree, unknown)

        def drafted_and_handed(tags, num_steps, extend):
            try:
                tree, known, unknown = self.drafter.draft(tags, num_steps, extend)
                if self._stream is not None:
                    self._stream.synchronize()   # the trees are complete before the verifier reads them
            except BaseException as exc:
                self.trees.post(post_round, None, reason=f"the draft failed: {type(exc).__name__}: {exc}")
                raise
            if tree is None:
                return known, unknown, self.trees.post(post_round, None, reason="no request left to draft for")
            return known, unknown, self.trees.post(post_round, tree, known)

        known, unknown, posted = await self._run("draft", drafted_and_handed, list(tags), num_steps, list(extend))
        return DraftHandle(known, None, unknown, posted)

    async def draft_ahead(self, tags, extend=()):
        return await self._run("draft_ahead", self.drafter.draft_ahead, list(tags), list(extend))

    def ready_handle(self, tree, tags):
        return DraftHandle(list(tags), tree)

    async def extend(self, items):
        return await self._run("extend", self.drafter.extend, list(items))

    async def release(self, request_ids, keep_draft=False, outputs=None):
        await self._run("release", self.drafter.release, list(request_ids), keep_draft, outputs)

    async def info(self):
        info = self.drafter.info(self.model_name)
        if self.trees is not None:
            info.extra["tree_channel"] = self.trees.state
        info.calls = self.clock.stats()
        return info

    async def close(self):
        self.close_thread()
