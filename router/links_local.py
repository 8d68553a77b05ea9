"""The in-process links of router/links.py: the engines of this process, each call run in a
worker thread (each engine's own, or one both share on the CPU) so the event loop keeps
streaming while a forward runs. What both share (a worker
thread, a CUDA stream, busy time) is router/local_base.py."""

from __future__ import annotations

from spectandem.protocol import DraftHandle
from router.local_base import _LocalLink


class LocalVerifierLink(_LocalLink):
    role = "verifier"

    def __init__(self, engine, model_name: str = "target", thread=None):
        super().__init__(engine, model_name, thread)

    async def prefill(self, items, want_features):
        from verifier.service_core import verifier_prefill

        return await self._run("prefill", verifier_prefill, self.engine, items, want_features)

    async def verify(self, draft, plain, want_features, on_launch=None):
        """`on_launch()`: from the worker thread, once the forward is queued (VerifierEngine.verify)."""
        from verifier.service_core import verifier_verify

        return await self._run("verify", verifier_verify, self.engine, draft.payload if draft else None,
                               list(draft.tags) if draft else [], plain, want_features, None, on_launch)

    async def verify_prefill(self, draft, plain, want_features, items, prefill_features, on_launch=None):
        from verifier.service_core import verifier_verify_prefill

        return await self._run("verify", verifier_verify_prefill, self.engine, draft.payload if draft else None,
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
        info.calls = self.clock.stats()
        return info

    async def close(self):
        self.close_thread()


class LocalDrafterLink(_LocalLink):
    role = "drafter"

    def __init__(self, engine, model_name: str = "draft", thread=None):
        super().__init__(engine, model_name, thread)

    async def prefill(self, items):
        from drafter.service_core import drafter_prefill

        return await self._run("prefill", drafter_prefill, self.engine, items)

    async def draft(self, tags, num_steps=None, extend=(), post_round=0):
        """`extend` and the trees in one worker call."""
        from drafter.service_core import drafter_extend_and_draft

        if post_round:
            raise ValueError("the in-process drafter has no tree channel: its trees go with the handle")
        tree, known, unknown = await self._run("draft", drafter_extend_and_draft, self.engine, list(tags), num_steps,
                                               list(extend))
        return DraftHandle(known, tree, unknown)

    async def draft_ahead(self, tags, extend=()):
        from drafter.service_core import drafter_draft_ahead

        return await self._run("draft_ahead", drafter_draft_ahead, self.engine, list(tags), list(extend))

    def ready_handle(self, tree, tags):
        return DraftHandle(list(tags), tree)

    async def extend(self, items):
        from drafter.service_core import drafter_extend

        return await self._run("extend", drafter_extend, self.engine, list(items))

    async def release(self, request_ids, keep_draft=False, outputs=None):
        from drafter.service_core import drafter_release

        await self._run("release", drafter_release, self.engine, list(request_ids), keep_draft, outputs)

    async def info(self):
        from drafter.service_core import drafter_info

        info = drafter_info(self.engine, self.model_name)
        info.calls = self.clock.stats()
        return info

    async def close(self):
        self.close_thread()
