"""router/loop.py `_within`: an engine call with a deadline goes out before the callbacks already
queued run (the streams a commit woke), where `asyncio.wait_for` on Python 3.11 starts it after
them; a call past its deadline still raises asyncio.TimeoutError."""

from __future__ import annotations

import asyncio
import sys

import pytest

from router.loop import _within


async def _order(wrap) -> list[str]:
    order = []

    async def call():
        order.append("call")
        await asyncio.sleep(0)
        return 7

    asyncio.get_running_loop().call_soon(order.append, "queued")
    assert await wrap(call()) == 7
    return order


def test_the_call_starts_before_queued_callbacks():
    order = asyncio.run(_order(lambda c: _within(c, 1.0)))
    if hasattr(asyncio, "timeout"):
        assert order == ["call", "queued"]
    else:   # Python 3.10: plain wait_for
        assert sorted(order) == ["call", "queued"]


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the control shows Python 3.11's wait_for")
def test_control_wait_for_on_311_starts_the_call_after_them():
    assert asyncio.run(_order(lambda c: asyncio.wait_for(c, 1.0))) == ["queued", "call"]


def test_a_call_past_its_deadline_raises_timeout_and_is_cancelled():
    cancelled = []

    async def slow():
        try:
            await asyncio.sleep(1.0)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    async def main():
        with pytest.raises(asyncio.TimeoutError):
            await _within(slow(), 0.01)
        assert await _within(asyncio.sleep(0, "ok"), None) == "ok"   # no deadline

    asyncio.run(main())
    assert cancelled == [True]
