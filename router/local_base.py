"""The in-process links' common part (router/links_local.py): an engine of this process whose
calls run one at a time in a worker thread, on a CUDA stream of its own on a GPU, timed per kind."""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from router.links import EngineUnavailable
from spectandem.devices import engine_stream, on_stream


def shorten_switch_interval(seconds: float) -> None:
    """For an entry point that runs both engines and the router in this process (the whole
    process is affected, so no constructor does it). In one process the router's event loop and
    the two engines' worker threads take turns at the Python lock. A thread waiting for it (the
    verifier's, back from its forward, with the next round's host work) gets it when the holder
    blocks or, at the latest, after the interpreter's switch interval: 5 ms by default, as long
    as a whole verify forward of the 8B target. `seconds` (LocalLinkTuning.switch_interval_s)
    shortens it; 0, or one no shorter than the interpreter's, keeps the interpreter's."""
    if 0 < seconds < sys.getswitchinterval():
        sys.setswitchinterval(seconds)


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
        self._lock = asyncio.Lock()
        self._engine_lock = threading.Lock()
        self.busy_s: dict[str, float] = {}
        self._stream = engine_stream(engine)

    def _call(self, kind: str, fn, *args, sync: bool = True):
        """`sync` False: `fn` synchronizes what it hands on itself (LocalVerifierLink._verify).
        One call at a time on the engine: a drafter's pre-ahead (LocalDrafterLink.pre_ahead)
        runs outside the event loop's turns; a call waiting for it does not count as busy."""
        with self._engine_lock:
            return self._timed_call(kind, fn, *args, sync=sync)

    def _timed_call(self, kind: str, fn, *args, sync: bool = True):
        t0 = time.perf_counter()
        try:
            out = self._on_stream(fn, *args)
            if sync and self._stream is not None:
                self._stream.synchronize()
            return out
        finally:
            end = time.perf_counter()
            self.busy_s[kind] = self.busy_s.get(kind, 0.0) + end - self._busy_from(kind, t0)
            self._ended(kind, end)

    def _on_stream(self, fn, *args):
        """fn(*args) with this engine's CUDA stream current (as it is, without one)."""
        return on_stream(self._stream, fn, *args)

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
