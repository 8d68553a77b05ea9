"""The in-process links' common part (router/links_local.py): an engine of this process whose
calls run one at a time in a worker thread of its own, on a CUDA stream of its own on a GPU,
timed per kind."""

from __future__ import annotations

import asyncio
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from router.links import EngineUnavailable
from spectandem.call_clock import CallClock
from spectandem.devices import engine_stream, on_stream

# The switch interval the entry points that run everything in one process set (serve --backend
# local, the bench's router sections): a thread back from the GPU waits at most this for the lock.
DEFAULT_SWITCH_INTERVAL_S = 0.0005


def shorten_switch_interval(seconds: float) -> None:
    """For an entry point that runs both engines and the router in this process (the whole
    process is affected, so no constructor does it). In one process the router's event loop and
    the two engines' worker threads take turns at the Python lock. A thread waiting for it (the
    verifier's, back from its forward, with the next round's host work) gets it when the holder
    blocks or, at the latest, after the interpreter's switch interval: 5 ms by default, as long
    as a whole verify forward of the 8B target. `seconds` (serve's --switch-interval-ms)
    shortens it; 0, or one no shorter than the interpreter's, keeps the interpreter's."""
    if 0 < seconds < sys.getswitchinterval():
        sys.setswitchinterval(seconds)


class _LocalLink:
    """One engine of this process: calls run one at a time in a worker thread of its own, the
    same thread every call (on the CPU both engines share one: spectandem/devices.py
    cpu_engine_thread, the process's only OpenMP team).

    On a GPU each engine works on a CUDA stream of its own, and a call returns only once its
    stream is done (what it hands on is complete). The two engines' calls run concurrently; on
    the legacy default stream, one engine's work would break the other's CUDA graph capture.

    `busy_s[kind]`: seconds spent inside calls of that kind ("verify", "prefill", "draft", ...)
    since construction, each timed in the worker thread from the call's start until its stream
    is done: for a verify, the host's preparation, the forward, acceptance and the results on
    the host; not the wait for the lock or the thread. Calls of one link run one after another,
    so the calls that start and end within an interval are busy for at most its length.

    An engine with an `after_call` (VerifierEngine: the decode ahead) gets it after a call that
    wants it (`ahead_wanted`), once the call's stream is done: in the worker thread, before the
    results go back, while the event loop waits for them. It queues device work and returns
    without waiting for it. Run beside the router's handling of the results instead (sharing
    the interpreter lock with its commits and streams), the queueing took 20.5 ms of wall time a
    call on one H100 at 64 running requests; what held it up was not established."""

    role = "engine"

    def __init__(self, engine, model_name: str, thread: ThreadPoolExecutor | None = None):
        """`thread`: a one-worker executor this link shares with the other engine's
        (`cpu_engine_thread`); by default one of its own."""
        self.engine, self.model_name = engine, model_name
        self._lock = asyncio.Lock()
        self.clock = CallClock()   # busy_s, and EngineInfo.calls as the engine services report them
        self._stream = engine_stream(engine)
        self._own_thread = thread is None
        self._thread = thread or ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"spectandem-{self.role}")

    @property
    def busy_s(self) -> dict[str, float]:
        return self.clock.busy_s

    def close_thread(self) -> None:
        if self._own_thread:
            self._thread.shutdown(wait=False)

    def _call(self, kind: str, fn, *args):
        t0 = time.perf_counter()
        try:
            out = on_stream(self._stream, fn, *args)
            if self._stream is not None:
                self._stream.synchronize()
        finally:
            self.clock.add(kind, time.perf_counter() - t0)
        if getattr(self.engine, "ahead_wanted", False):
            self._call_after()
        return out

    def _call_after(self) -> None:
        """The engine's after_call on its stream, not waited for on the device."""
        t0 = time.perf_counter()
        try:
            on_stream(self._stream, self.engine.after_call)
        finally:
            self.clock.add("after_call", time.perf_counter() - t0)

    async def _run(self, kind: str, fn, *args):
        async with self._lock:
            try:
                return await asyncio.get_running_loop().run_in_executor(self._thread, self._call, kind, fn, *args)
            except (ValueError, KeyError):  # bad input or a stale tag: the caller's to handle
                raise
            except Exception as exc:  # the engine itself failed: the router treats it as gone
                raise EngineUnavailable(f"{self.role} failed: {exc}") from exc
