"""Decoding ahead on the GPU (verifier/engine.py `after_call`: the next plain decode queued on
the device without a wait) on serve's fast path (CUDA graphs, Triton paged attention), bf16:
decodes that take a decode ahead give the tokens and features, bit for bit, of an engine that
never decodes ahead, chunk after chunk and after a cut chunk; and the router's plain rounds
through the in-process link (the engine's stream, after_call in its worker thread) give the
tokens of the same router on an engine without it, the decodes ahead taken."""

from __future__ import annotations

import pytest
import torch

from router.links_local import LocalVerifierLink
from router.loop import Router
from router.requests import RouterConfig
from spectandem.checkpoint import load_tokenizer
from spectandem.config import SamplingParams
from spectandem.demo import demo_paths
from spectandem.modeling.llama import load_llama
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.test_plain_steps import _serve
from verifier.engine import VerifierEngine
from verifier.runner import NativeRunner

pytestmark = pytest.mark.gpu

AUX = (2, 4, 5)
MAX_LEN = 256
FAST = dict(cuda_graphs=True, triton_attention=True)


@pytest.fixture(scope="module", autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.fail("the gpu marker needs a CUDA device")


@pytest.fixture(scope="module")
def target():
    path, _ = demo_paths("none")
    return load_llama(path, torch.bfloat16, "cuda"), load_tokenizer(path)


def _engine(model, ahead: bool, slots: int = 8) -> VerifierEngine:
    return VerifierEngine(NativeRunner(model, AUX, max_slots=slots, max_len=MAX_LEN, **FAST), slots, 4096,
                          decode_ahead=ahead)


def test_decodes_taken_from_ahead_equal_plain_decodes(target):
    model, tokenizer = target
    prompts = [tokenizer.encode(t).ids for t in PROMPT_TEXTS[:4]]
    ids = ["a", "b", "c", "d"]
    engines = [_engine(model, True), _engine(model, False)]
    for eng in engines:
        eng.prefill(ids, prompts, [SamplingParams(max_tokens=200)] * 4, [0] * 4)
    for steps in (4, 4, 4, 3, 4, 4):
        outs = []
        for eng in engines:
            got = eng.decode(ids, [eng.requests[i].committed_len for i in ids], steps)
            eng.after_call()
            outs.append(got)
        got, want = outs
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert torch.equal(g.features, w.features)
    # Every decode took the one queued after the last, but the 4-step one after the 3-step
    # one, which asked for more steps than were queued.
    assert (engines[0].ahead_used, engines[0].ahead_dropped) == (4, 1)


def test_router_plain_rounds_over_the_link(target):
    model, tokenizer = target
    prompts = [tokenizer.encode(PROMPT_TEXTS[i % len(PROMPT_TEXTS)]).ids for i in range(8)]
    params = [SamplingParams(max_tokens=m) for m in (64, 40, 64, 17, 64, 33, 64, 50)]

    def run(engine):
        router = Router(LocalVerifierLink(engine), None, tokenizer,
                        RouterConfig(max_len=MAX_LEN, eos_token_ids=(), lookahead=1, want_features=False,
                                     plain_steps=4))
        router._modes.choose = lambda num_running, drafter_up: "plain"
        return [toks for toks, _, _ in _serve(router, prompts, params, [engine])]

    ahead, plain = _engine(model, True), _engine(model, False)
    got, want = run(ahead), run(plain)
    assert got == want and [len(t) for t in got] == [p.max_tokens for p in params]
    assert ahead.ahead_used > 0 and not ahead.requests and ahead.kv_stats()["used_blocks"] == 0
