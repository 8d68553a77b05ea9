"""The engine processes `spectandem serve --backend grpc` starts itself: started with their
stderr passed through (and its last lines kept), checked while serve waits for them, then
watched and restarted.

Before serve has seen an engine ready, its exit is a start failure (`check` raises
EngineStartError with the engine's own last lines): restarting a configuration that cannot start
would only loop. Once watched, an engine that exits is reaped at once (no zombie) and started
again with the same command line, so on the same port and the router's links stay valid, after
an exponential backoff (`backoff_s`, doubled per restart inside the window, at most
`max_backoff_s`). At most `max_restarts` restarts per `window_s` seconds; past that the engine is
left down, an error is logged and `on_give_up(role)` is called. Each exit is logged at warning
with its exit code or signal.

`stop_restarting()` ends the watching (shutdown calls it first, so an engine that a group signal
ended is not started again); `EngineProcess.stop()` then terminates the current process.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import Callable

from router.links import EngineStartError

log = logging.getLogger("spectandem.supervisor")


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    max_restarts: int = 5       # restarts per window; 0: never restart
    window_s: float = 300.0
    backoff_s: float = 1.0      # delay before the first restart of a window, doubled for each next one
    max_backoff_s: float = 30.0

    def __post_init__(self):
        if self.max_restarts < 0:
            raise ValueError(f"--engine-restarts must be >= 0, got {self.max_restarts}")
        if not self.window_s > 0:
            raise ValueError(f"--engine-restart-window must be > 0 seconds, got {self.window_s}")
        if not 0 <= self.backoff_s <= self.max_backoff_s:
            raise ValueError(f"need 0 <= backoff ({self.backoff_s}) <= max backoff ({self.max_backoff_s})")


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class EngineProcess:
    """One engine's command line and its current process."""

    TAIL_LINES = 40

    def __init__(self, role: str, argv: list[str], env: dict[str, str] | None = None):
        """`env`: the engine's whole environment, made by the entry point (None: this process's)."""
        self.role, self.argv, self.env = role, list(argv), env
        self.popen: subprocess.Popen | None = None
        self.tail: collections.deque[str] = collections.deque(maxlen=self.TAIL_LINES)
        self.restarts: collections.deque[float] = collections.deque()   # times of restarts
        self.gave_up = False
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.tail.clear()
        self.popen = subprocess.Popen(self.argv, stderr=subprocess.PIPE, env=self.env)
        self._reader = threading.Thread(target=self._pass_stderr, args=(self.popen.stderr,), daemon=True,
                                        name=f"{self.role}-stderr")
        self._reader.start()

    def _pass_stderr(self, pipe) -> None:
        """Copies the engine's stderr to ours line by line, keeping the last lines."""
        for raw in iter(pipe.readline, b""):
            line = raw.decode("utf-8", "replace")
            self.tail.append(line.rstrip("\n"))
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):
                pass
        pipe.close()

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code once the process has ended (reaping it), else None."""
        return self.popen.poll()

    def send_signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def last_output(self, wait_s: float = 2.0) -> str:
        """The engine's last stderr lines (after waiting up to `wait_s` for the pipe to drain)."""
        if self._reader is not None:
            self._reader.join(wait_s)
        return "\n".join(self.tail)

    def check(self) -> None:
        """Raises EngineStartError when the process has ended (serve is waiting for it to be ready)."""
        code = self.poll()
        if code is not None:
            tail = self.last_output()
            raise EngineStartError(f"the {self.role} exited with {describe_exit(code)} before it was ready"
                                   + (f"; its last output:\n{tail}" if tail else " (no output)"))

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminates the current process (SIGTERM, then SIGKILL after `timeout_s`) and reaps it."""
        p = self.popen
        if p is None or p.poll() is not None:
            return
        p.terminate()
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout_s)


class EngineSupervisor:
    """Starts engine processes and, once `watch()` is called, restarts them per the policy."""

    POLL_S = 0.2

    def __init__(self, policy: RestartPolicy, on_give_up: Callable[[str], None] | None = None):
        self.policy, self.on_give_up = policy, on_give_up
        self.engines: dict[str, EngineProcess] = {}
        self._task: asyncio.Task | None = None
        self._stopping: asyncio.Event | None = None

    def start(self, role: str, argv: list[str], env: dict[str, str] | None = None) -> EngineProcess:
        e = EngineProcess(role, argv, env)
        e.start()
        self.engines[role] = e
        return e

    def watch(self) -> None:
        """Starts watching (from the running event loop): exits from now on are restarts."""
        self._stopping = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._watch())

    def stop_restarting(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def wait_stopped(self) -> None:
        self.stop_restarting()
        if self._task is not None:
            await self._task

    async def _watch(self) -> None:
        pending: dict[str, asyncio.Task] = {}
        try:
            while not self._stopping.is_set():
                for role, e in self.engines.items():
                    if e.gave_up or role in pending:
                        continue
                    code = e.poll()
                    if code is not None:
                        pending[role] = asyncio.get_running_loop().create_task(self._restart(e, code))
                for role in [r for r, t in pending.items() if t.done()]:
                    pending.pop(role).result()
                try:
                    await asyncio.wait_for(self._stopping.wait(), self.POLL_S)
                except asyncio.TimeoutError:
                    pass
        finally:
            for t in pending.values():
                t.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)

    async def _restart(self, e: EngineProcess, code: int) -> None:
        p, now = self.policy, time.monotonic()
        while e.restarts and e.restarts[0] < now - p.window_s:
            e.restarts.popleft()
        how = describe_exit(code)
        if len(e.restarts) >= p.max_restarts:
            e.gave_up = True
            log.error("the %s (pid %d) exited with %s; it was restarted %d times within %.0f s "
                      "(--engine-restarts %d, --engine-restart-window %.0f): it stays down. Its last output:\n%s",
                      e.role, e.pid, how, len(e.restarts), p.window_s, p.max_restarts, p.window_s, e.last_output())
            if self.on_give_up is not None:
                self.on_give_up(e.role)
            return
        delay = min(p.backoff_s * 2 ** len(e.restarts), p.max_backoff_s)
        log.warning("the %s (pid %d) exited with %s; restarting it in %.1f s (restart %d of at most %d "
                    "within %.0f s)", e.role, e.pid, how, delay, len(e.restarts) + 1, p.max_restarts, p.window_s)
        try:
            await asyncio.wait_for(self._stopping.wait(), delay)
            return   # shutting down: no restart
        except asyncio.TimeoutError:
            pass
        e.restarts.append(time.monotonic())
        e.start()
        log.warning("the %s restarted as pid %d", e.role, e.pid)
