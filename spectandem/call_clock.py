"""How long an engine spends in each kind of call: what its link's info reports as
EngineInfo.calls (a gRPC service's GetInfo, a Ray actor's info, an in-process link's info), so
that a caller can tell the engine's own time from the transport's (benchmarks/profile_serve.py)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext


class CallClock:
    """Seconds inside, and the number of, each kind of call ("verify", "draft", ...). The engine
    services also time parts of a call, as "kind.part" ("verify.engine", "verify.tree_wait",
    "draft.catch_up", ...): that time is inside the call's own too."""

    def __init__(self):
        self.busy_s: dict[str, float] = {}
        self.count: dict[str, int] = {}
        self._lock = threading.Lock()   # info may read while a call ends on another thread

    def add(self, kind: str, seconds: float) -> None:
        with self._lock:
            self.busy_s[kind] = self.busy_s.get(kind, 0.0) + seconds
            self.count[kind] = self.count.get(kind, 0) + 1

    @contextmanager
    def timing(self, kind: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(kind, time.perf_counter() - t0)

    def stats(self) -> dict:
        """{"busy_s": {kind: seconds}, "count": {kind: calls}} (EngineInfo.calls)."""
        with self._lock:
            return {"busy_s": dict(self.busy_s), "count": dict(self.count)}


def timed(clock: CallClock | None, kind: str):
    """`clock.timing(kind)`, or nothing where there is no clock (the in-process links time whole
    calls only)."""
    return clock.timing(kind) if clock is not None else nullcontext()
