"""Router.stop ends the loop even when the cancel is lost: on Python 3.11 an `asyncio.wait_for`
whose inner call finishes as the cancel arrives drops the cancel (a hang seen in CI). Here the
verifier link swallows the cancel itself; real engines behind in-process links."""

from __future__ import annotations

import asyncio

from router.links_local import LocalVerifierLink
from router.requests import RouterConfig
from router.loop import Router
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator


class SwallowingVerifier(LocalVerifierLink):
    """Each verify first waits a little; a cancel landing there is dropped, as wait_for may."""

    def __init__(self, engine):
        super().__init__(engine)
        self.in_verify = asyncio.Event()
        self.swallowed = 0

    async def verify(self, draft, plain, want_features, on_launch=None):
        self.in_verify.set()
        try:
            await asyncio.sleep(0.05)
        except asyncio.CancelledError:
            self.swallowed += 1
        return await super().verify(draft, plain, want_features, on_launch)


def test_stop_ends_the_loop_when_a_call_swallows_the_cancel():
    spec = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=2, max_len=256)

    async def main():
        vlink = SwallowingVerifier(spec.verifier)
        router = Router(vlink, None, spec.tokenizer, RouterConfig(
            max_len=256, eos_token_ids=(), lookahead=1, want_features=False, pipeline="sequential"))
        router.start()
        req = router.submit(spec.tokenizer.encode("def f(x):").ids, SamplingParams(max_tokens=200, ignore_eos=True))
        await asyncio.wait_for(vlink.in_verify.wait(), 30)
        await asyncio.wait_for(router.stop(), 20)      # hung for ever before the stop flag
        events = []
        while not req.events.empty():
            events.append(req.events.get_nowait())
        return vlink.swallowed, events

    swallowed, events = asyncio.run(main())
    assert swallowed == 1, "the cancel should have landed inside the verify call"
    assert events and events[-1].__class__.__name__ == "Failure" and events[-1].code == "UNAVAILABLE", events[-1:]
