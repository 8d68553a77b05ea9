"""The router's plain multi-step rounds against a verifier that decodes ahead (serve
--decode-ahead: verifier/engine.py), behind the in-process link (router/local_base.py runs the
engine's after_call once a call has returned) and behind a real gRPC verifier service in this
process (verifier/service.py calls it once the reply is built). Real demo target, fp32 on the
CPU: tokens, text and finish reasons equal one-step plain decoding's (LocalSpeculator), with
max_tokens, eos and stop strings falling inside a chunk, requests of several lengths ending while
the others go on; the decodes ahead were taken (not only queued), and once every request has
ended the verifier holds no request and no KV block. And the router's hint (PlainItem.again),
on its own: the rows are marked where every request goes on alike into the next call; none
where a request ends in this call, while requests wait to be admitted, before a one-step call,
or at the end of an "auto" window."""

from __future__ import annotations

import asyncio

import pytest

from router.links_local import LocalVerifierLink
from router.loop import Router
from router.requests import RouterConfig
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.test_plain_steps import _serve, served
from verifier.engine import VerifierEngine

MAX_LEN = 256


@pytest.fixture(scope="module")
def plain():
    return LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=MAX_LEN)


def _workload(plain):
    prompts = [plain.tokenizer.encode(x).ids for x in PROMPT_TEXTS[:7]]
    params = ([SamplingParams(max_tokens=m) for m in (5, 13, 40, 1, 22)]
              + [SamplingParams(max_tokens=40, stop=["(self"]), SamplingParams(max_tokens=72)])
    plain_ones = [0, 1, 2, 3, 4, 6]
    want = [(c.token_ids, c.finish_reason) for c in plain.generate([prompts[i] for i in plain_ones],
                                                                      [params[i] for i in plain_ones])]
    reference = plain.generate([prompts[5]], [SamplingParams(max_tokens=40)])[0]
    full = plain.tokenizer.decode(reference.token_ids)
    assert "(self" in full, "the stop-string case needs a continuation that contains it"
    return prompts, params, want, full[: full.index("(self")]


def _router(link, plain) -> Router:
    router = Router(link, None, plain.tokenizer, RouterConfig(max_len=MAX_LEN, eos_token_ids=plain.eos_token_ids,
                                                              lookahead=1, want_features=False, plain_steps=4))
    router._modes.choose = lambda num_running, drafter_up: "plain"
    return router


def _check(got, want, stopped, plain, engine):
    others = got[:5] + got[6:]
    assert [(t, r) for t, _, r in others] == want
    for (toks, text, _), (wt, _) in zip(others, want):
        assert text == plain.tokenizer.decode(wt)
    assert got[5][2] == "stop" and got[5][1] == stopped
    assert engine.ahead_used >= 5, (engine.ahead_used, engine.ahead_dropped)
    assert not engine.requests and engine.kv_stats()["used_blocks"] == 0


def _ahead_engine(plain) -> VerifierEngine:
    """A verifier engine on the reference's runner (its KV pool; the reference holds nothing) that decodes ahead."""
    assert not plain.verifier.requests
    return VerifierEngine(plain.verifier.runner, 8, plain.verifier.vocab_size, decode_ahead=True)


def test_in_process_link(plain):
    prompts, params, want, stopped = _workload(plain)
    engine = _ahead_engine(plain)
    got = _serve(_router(LocalVerifierLink(engine), plain), prompts, params, [engine])
    _check(got, want, stopped, plain, engine)


def served_over_grpc(engine: VerifierEngine, plain, prompts, params, on_link=None):
    """The workload's requests through the router to `engine` behind a real gRPC verifier service
    in this process; `on_link(link)` may wrap the link's methods first."""
    from router.links_grpc import GrpcVerifierLink
    from verifier.service import start_verifier_server

    server = start_verifier_server(engine, "127.0.0.1", 0)

    async def main():
        link = GrpcVerifierLink(f"127.0.0.1:{server.port}")   # a grpc.aio channel: made in this loop
        if on_link is not None:
            on_link(link)
        try:
            return await served(_router(link, plain), prompts, params, [engine])
        finally:
            await link.close()
    try:
        return asyncio.run(main())
    finally:
        server.stop(0)


def test_grpc_verifier_service(plain):
    prompts, params, want, stopped = _workload(plain)
    engine = _ahead_engine(plain)
    got = served_over_grpc(engine, plain, prompts, params)
    _check(got, want, stopped, plain, engine)


def test_negative_control_without_decoding_ahead(plain):
    """The same run on an engine that does not decode ahead takes none: `_check`'s count of
    decodes taken from ahead is the feature's, not the workload's."""
    prompts, params, want, stopped = _workload(plain)
    engine = VerifierEngine(plain.verifier.runner, 8, plain.verifier.vocab_size)
    got = _serve(_router(LocalVerifierLink(engine), plain), prompts, params, [engine])
    assert [(t, r) for t, _, r in got[:5] + got[6:]] == want
    assert engine.ahead_used == 0
    with pytest.raises(AssertionError):
        _check(got, want, stopped, plain, engine)


# ----------------------------------------------------------------------------------------------
# The router's hint (PlainItem.again): which plain rows it expects to decode again next call


def _rows_router(max_tokens: list[int], generated: int, **cfg) -> Router:
    from router.detok import Detokenizer
    from router.requests import RequestStatus, ServedRequest
    from tests.router.fakes import Tokenizer

    router = Router(None, None, Tokenizer(), RouterConfig(max_len=MAX_LEN, eos_token_ids=(0,), lookahead=1,
                                                          want_features=False, plain_steps=4, **cfg))
    for i, m in enumerate(max_tokens):
        r = ServedRequest(f"r{i}", [5, 6], SamplingParams(max_tokens=m), 0, Detokenizer(Tokenizer()),
                          status=RequestStatus.RUNNING, on_verifier=True)
        r.tokens = [7] * generated
        router.running.append(r)
    return router


def _again(router: Router) -> tuple[int, list[bool]]:
    items, _ = router._verify_rows([], router.running)
    return items[0].steps, [p.again for p in items]


def test_again_for_requests_that_go_on_alike():
    # 10 generated: max_tokens 30 and 40 go on for chunks of 4.
    assert _again(_rows_router([30, 40], 10)) == (4, [True, True])
    # 14 ends with this call: its client's next request would change the next call.
    assert _again(_rows_router([30, 40, 14], 10)) == (4, [False, False, False])
    # 13 ends inside this call's steps (it keeps 3 of the 4): the others' steps are not cut.
    assert _again(_rows_router([13, 40], 10)) == (4, [False, False])
    # Every request ends within the steps: the call decodes what the longest still wants.
    assert _again(_rows_router([12, 13], 10)) == (3, [False, False])
    # The next call would be one step (a verify: nothing a decode ahead serves).
    assert _again(_rows_router([30, 15], 10)) == (4, [False, False])
    # The next call two steps: the first two of a decode ahead of four.
    assert _again(_rows_router([30, 16], 10)) == (4, [True, True])


def test_no_again_while_requests_wait_to_be_admitted():
    router = _rows_router([40, 40, 40], 10)
    router.waiting.append(router.running.pop())
    assert _again(router) == (4, [False, False])
    full = _rows_router([40, 40], 10, max_running=2)      # the running batch is full: none can be admitted
    full.waiting.append(_rows_router([40], 0).running[0])
    assert _again(full) == (4, [True, True])


def test_no_again_when_auto_ends_its_phase():
    from router.pipeline import ModeChooser

    router = _rows_router([40, 40], 10)
    router.drafter_up, router._mode = True, "plain"
    router._modes = ModeChooser(router.cfg)
    router._modes.choose(2, True)            # measures its first candidate for a window
    router._modes._state.left = 2
    assert _again(router)[1] == [True, True]
    router._modes._state.left = 1            # this round is the window's last: the next may be another mode
    assert _again(router)[1] == [False, False]
