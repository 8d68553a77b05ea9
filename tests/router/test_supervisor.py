"""router/supervisor.py with real child processes and real signals: a watched process that is
killed is reaped and started again with the same command line after the backoff, each exit
logged with its signal or code; restarts stop at the budget per window (on_give_up, an error);
no restart once stop_restarting was called; an engine that exits before it is ready raises
EngineStartError carrying its own stderr."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
import time

import pytest

from router.links import EngineStartError
from router.supervisor import EngineSupervisor, RestartPolicy

SLEEPER = [sys.executable, "-c", "import sys, time; print('engine up', file=sys.stderr, flush=True); time.sleep(60)"]
CRASHER = [sys.executable, "-c", "import sys; print('engine error: no KV room', file=sys.stderr); sys.exit(3)"]


def _gone(pid: int) -> bool:
    """No process (not even a zombie) with this pid is left."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "X"
    except FileNotFoundError:
        return True


async def _until(pred, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


def test_killed_engine_is_reaped_and_restarted_on_the_same_command_line(caplog):
    async def main():
        sup = EngineSupervisor(RestartPolicy(max_restarts=3, window_s=60, backoff_s=0.2))
        e = sup.start("drafter", SLEEPER)
        try:
            sup.watch()
            for n in range(2):
                old = e.pid
                e.send_signal(signal.SIGKILL)
                await _until(lambda: e.pid != old)
                assert _gone(old)                       # reaped: no zombie left behind
                assert e.popen.args == SLEEPER and e.poll() is None
                await _until(lambda: "engine up" in e.tail)
            assert len(e.restarts) == 2 and not e.gave_up
        finally:
            await sup.wait_stopped()
            e.stop()
        assert _gone(e.pid)

    with caplog.at_level(logging.WARNING, logger="spectandem.supervisor"):
        asyncio.run(asyncio.wait_for(main(), 60))
    exits = [r for r in caplog.records if "exited with signal SIGKILL" in r.getMessage()]
    assert len(exits) == 2 and all(r.levelno == logging.WARNING for r in exits)
    assert "restart 2 of at most 3" in exits[1].getMessage()


def test_restarts_stop_at_the_budget_per_window(caplog):
    given_up = []

    async def main():
        sup = EngineSupervisor(RestartPolicy(max_restarts=2, window_s=60, backoff_s=0.05), on_give_up=given_up.append)
        e = sup.start("verifier", SLEEPER)
        sup.watch()
        e.argv = CRASHER             # from the first restart on it fails at once
        e.send_signal(signal.SIGKILL)
        await _until(lambda: e.gave_up)
        pid = e.pid
        await asyncio.sleep(1.0)     # and stays down
        assert e.pid == pid and e.poll() == 3 and _gone(pid)
        await sup.wait_stopped()
        return e

    with caplog.at_level(logging.WARNING, logger="spectandem.supervisor"):
        e = asyncio.run(asyncio.wait_for(main(), 60))
    assert given_up == ["verifier"] and len(e.restarts) == 2
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "stays down" in errors[0].getMessage()
    assert "no KV room" in errors[0].getMessage() and "exit code 3" in errors[0].getMessage()


def test_no_restart_after_stop_restarting():
    async def main():
        sup = EngineSupervisor(RestartPolicy(max_restarts=5, window_s=60, backoff_s=0.5))
        e = sup.start("drafter", SLEEPER)
        sup.watch()
        pid = e.pid
        e.send_signal(signal.SIGTERM)
        await _until(lambda: e.poll() is not None)
        await asyncio.sleep(0.3)     # seen by the watcher, inside its backoff
        await sup.wait_stopped()
        await asyncio.sleep(1.0)
        assert e.pid == pid and e.restarts == type(e.restarts)() and _gone(pid)

    asyncio.run(asyncio.wait_for(main(), 60))


def test_exit_before_ready_raises_with_the_engines_own_error():
    sup = EngineSupervisor(RestartPolicy())
    e = sup.start("verifier", CRASHER)
    deadline = time.monotonic() + 30
    with pytest.raises(EngineStartError) as err:
        while time.monotonic() < deadline:
            e.check()
            time.sleep(0.05)
    msg = str(err.value)
    assert "the verifier exited with exit code 3 before it was ready" in msg and "engine error: no KV room" in msg
    assert _gone(e.pid) and not e.restarts


def test_restart_policy_refuses_bad_values():
    for kw in (dict(max_restarts=-1), dict(window_s=0), dict(backoff_s=-1), dict(backoff_s=40, max_backoff_s=30)):
        with pytest.raises(ValueError):
            RestartPolicy(**kw)
