"""The in-process links of router/links.py: the engines of this process, each call run in a
worker thread so the event loop keeps streaming while a forward runs. The verifier's link also
chains verifies (VerifierEngine.arm_next) on a GPU."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time

from router.links import DraftHandle, EngineUnavailable, Tag


# In one process the router's event loop and the two engines' worker threads take turns at the
# Python lock. A thread waiting for it (the verifier's, back from its forward, with the next
# round's host work) gets it when the holder blocks or, at the latest, after the interpreter's
# switch interval: 5 ms by default, as long as a whole verify forward of the 8B target. In-process
# links shorten it (SPECTANDEM_SWITCH_INTERVAL_S; 0 keeps the interpreter's).
SWITCH_INTERVAL_S = float(os.environ.get("SPECTANDEM_SWITCH_INTERVAL_S", "0.0005"))
# How long an armed verify's call waits for stage_next. The router always stages (None when
# the drafter has nothing) once its draft-ahead call returns or times out: this only bounds a
# caller that arms and never stages. Past it the call ends without a launch.
STAGE_WAIT_S = 30.0


def _shorten_switch_interval() -> None:
    if 0 < SWITCH_INTERVAL_S < sys.getswitchinterval():
        sys.setswitchinterval(SWITCH_INTERVAL_S)


class _LocalLink:
    """One engine of this process: calls run one at a time in a worker thread.

    On a GPU each engine works on a CUDA stream of its own, and a call returns only once its
    stream is done (what it hands on is complete). The two engines' calls run concurrently; on
    the legacy default stream, one engine's work would break the other's CUDA graph capture.

    `busy_s[kind]`: seconds spent inside calls of that kind ("verify", "prefill", "draft", ...)
    since construction, each timed in the worker thread from the call's start until its stream
    is done: for a verify, the host's preparation, the forward, acceptance and the results on
    the host; not the wait for the lock or the thread. A verify whose forward a chained launch
    queued (LocalVerifierLink) counts from the end of the call that queued it: the verifier was
    busy with it from then. Calls of one link run one after another, so the calls that start
    and end within an interval are busy for at most its length."""

    role = "engine"

    def __init__(self, engine, model_name: str):
        self.engine, self.model_name = engine, model_name
        _shorten_switch_interval()
        self._lock = asyncio.Lock()
        self._stream = None
        self.busy_s: dict[str, float] = {}
        device = _engine_device(engine)
        if device is not None and device.type == "cuda":
            import torch

            self._stream = torch.cuda.Stream(device=device)

    def _call(self, kind: str, fn, *args, sync: bool = True):
        """`sync` False: `fn` synchronizes what it hands on itself (LocalVerifierLink._verify)."""
        t0 = time.perf_counter()
        try:
            if self._stream is None:
                return fn(*args)
            import torch

            with torch.cuda.stream(self._stream):
                out = fn(*args)
            if sync:
                self._stream.synchronize()
            return out
        finally:
            end = time.perf_counter()
            self.busy_s[kind] = self.busy_s.get(kind, 0.0) + end - self._busy_from(kind, t0)
            self._ended(kind, end)

    def _busy_from(self, kind: str, start: float) -> float:
        """When the call just ended began its work (its start, for most)."""
        return start

    def _ended(self, kind: str, end: float) -> None:
        return None

    async def _run(self, kind: str, fn, *args, sync: bool = True):
        async with self._lock:
            try:
                return await asyncio.to_thread(self._call, kind, fn, *args, sync=sync)
            except (ValueError, KeyError):  # bad input or a stale tag: the caller's to handle
                raise
            except Exception as exc:  # the engine itself failed: the router treats it as gone
                raise EngineUnavailable(f"{self.role} failed: {exc}") from exc


class LocalVerifierLink(_LocalLink):
    """`chain`: chained verifies (VerifierEngine.arm_next; router/rounds.py), by default where the
    engine computes on a GPU (unless SPECTANDEM_CHAINED_VERIFY=0). The armed verify's call, once
    it has the verdict, waits for `stage_next`'s trees (the router waits for the same draft-ahead
    call before it takes in the verdict) and queues the verdict's next tree's forward, which runs
    while the router takes in the verdict. That wait does not count as busy. On a CPU the
    forward runs in the launch itself (tests turn chaining on there to check the tokens)."""

    role = "verifier"

    def __init__(self, engine, model_name: str = "target", chain: bool | None = None):
        super().__init__(engine, model_name)
        if chain is None:   # SPECTANDEM_CHAINED_VERIFY=0 turns the default off (to compare)
            chain = self._stream is not None and os.environ.get("SPECTANDEM_CHAINED_VERIFY", "1") != "0"
        self.chains = chain
        self._chain_end: float | None = None   # when the call that queued a chained verify ended
        self._queued = False                   # the call now running queued one
        self._waited = 0.0                     # seconds the call now running waited for trees
        self.chained_launches = 0
        self._armed: _Staged | None = None     # the last arm_next's, for its verify
        self._staging: _Staged | None = None   # the same, for stage_next

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

    def arm_next(self, tags: list[Tag]) -> bool:
        """Before a verify of exactly `tags`: once its verdict is in and `stage_next` has given
        the next trees, the verifier starts the verdict's one. False: not chaining."""
        if not self.chains:
            return False
        self._armed = self._staging = _Staged([t.request_id for t in tags], [t.committed_len for t in tags])
        return True

    def stage_next(self, trees: list[dict | None] | None) -> None:
        """From the event loop, once per arm_next, while or after that verify runs: the
        draft-ahead trees per request (AheadReply.trees, in the armed tags' order), or None
        (none come)."""
        staging, self._staging = self._staging, None
        if staging is not None:
            staging.put(None if trees is None or all(t is None for t in trees) else trees)

    def _verify(self, armed, *args):
        """verifier_verify, its work synchronized. `armed` (a _Staged): the engine keeps the
        verdict, and this call then waits for the staged trees and queues the verdict's next
        tree (VerifierEngine.launch_next) before it returns. The router takes in the verdict
        only after the launch: its host work (and the drafter's next call, which it starts)
        would otherwise hold the Python lock the launch needs."""
        from verifier.service_core import verifier_verify

        if armed is not None:   # in this thread: the engine's last chained launch is done
            self.engine.arm_next(armed.request_ids, armed.committed_lens)
        out = verifier_verify(*args)
        if self._stream is not None:
            self._stream.synchronize()
        verdict = self.engine.take_verdict() if armed is not None else None
        if verdict is not None:
            t0 = time.perf_counter()
            trees = armed.wait(STAGE_WAIT_S)
            self._waited = time.perf_counter() - t0
            self._queued = trees is not None and self.engine.launch_next(verdict, trees)
            self.chained_launches += self._queued
        return out

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


class LocalDrafterLink(_LocalLink):
    role = "drafter"

    def __init__(self, engine, model_name: str = "draft"):
        super().__init__(engine, model_name)

    async def prefill(self, items):
        from drafter.service_core import drafter_prefill

        return await self._run("prefill", drafter_prefill, self.engine, items)

    async def draft(self, tags, num_steps=None):
        from drafter.service_core import drafter_draft

        return DraftHandle(tags, await self._run("draft", drafter_draft, self.engine, tags, num_steps))

    async def draft_ahead(self, tags, extend=()):
        from drafter.service_core import drafter_draft_ahead

        return await self._run("draft_ahead", drafter_draft_ahead, self.engine, tags, list(extend))

    def ready_handle(self, tree, tags):
        return DraftHandle(list(tags), tree)

    async def extend(self, items):
        from drafter.service_core import drafter_extend

        return await self._run("extend", drafter_extend, self.engine, items)

    async def release(self, request_ids, keep_draft=False):
        from drafter.service_core import drafter_release

        await self._run("release", drafter_release, self.engine, request_ids, keep_draft)

    async def info(self):
        from drafter.service_core import drafter_info

        return drafter_info(self.engine, self.model_name)

    async def close(self):
        return None


class _Staged:
    """One armed verify's handoff: its tags, and the trees stage_next gives (any thread)."""

    def __init__(self, request_ids: list[str], committed_lens: list[int]):
        self.request_ids, self.committed_lens = request_ids, committed_lens
        self._given = threading.Event()
        self._trees = None

    def put(self, trees) -> None:
        if not self._given.is_set():
            self._trees = trees
            self._given.set()

    def wait(self, timeout: float):
        """The trees (None: none came, or not within `timeout` seconds)."""
        return self._trees if self._given.wait(timeout) else None


def _engine_device(engine):
    """The torch device an in-process engine computes on (None: none, e.g. n-gram drafting)."""
    runner = getattr(engine, "runner", None)
    proposer = getattr(engine, "proposer", None)
    device = getattr(runner, "device", None) or getattr(proposer, "device", None)
    if device is None:
        return None
    import torch

    return torch.device(device)
