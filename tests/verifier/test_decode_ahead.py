"""Decoding ahead (`VerifierEngine(decode_ahead=True)`, verifier/engine.py): after a plain
multi-step decode, `after_call` queues the next one; a decode of those requests takes its tokens
from there, any other call forgets it. On the demo target in fp32 on the CPU, every result is
compared token for token (and feature for feature) with an engine that never decodes ahead, run
through the same calls, and so is the KV pool's use after each call (small blocks, so that every
decode ahead takes blocks of its own). A decode of some of the queued requests takes their rows
of a wider batch: the same tokens, features equal up to the last bits (as any other batching).
The negative control: tokens of a decode ahead that went wrong reach the caller, and the
comparison catches them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spectandem.config import SamplingParams
from spectandem.messages import root_only_tree
from spectandem.modeling.llama import load_llama
from verifier.engine import VerifierEngine
from verifier.runner import NativeRunner

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo" / "target"
AUX = (2, 4, 5)
MAX_LEN = 96
BLOCK = 4
# The demo tokenizer's ids of "def fibonacci(n):\n", "import os\nimport sys\n", "    for i in range(len(".
PROMPTS = [[482, 288, 1550, 270, 1161, 495, 8, 78, 309, 199], [775, 653, 199, 775, 801, 199],
           [259, 379, 274, 310, 1723, 8, 537, 8]]
IDS = ["a", "b", "c"]
GREEDY = SamplingParams(max_tokens=64)
pytestmark = pytest.mark.usefixtures("single_thread")   # tests/verifier/conftest.py


@pytest.fixture(scope="module")
def model():
    return load_llama(DEMO)


def _engine(model, ahead: bool, kv_blocks: int = 96) -> VerifierEngine:
    runner = NativeRunner(model, AUX, max_slots=4, max_len=MAX_LEN, kv_blocks=kv_blocks, block_size=BLOCK)
    eng = VerifierEngine(runner, max_slots=4, vocab_size=4096, decode_ahead=ahead)
    eng.prefill(IDS, PROMPTS, [GREEDY] * len(IDS), [0] * len(IDS))
    return eng


class Pair:
    """An engine that decodes ahead and one that never does, driven through the same calls."""

    def __init__(self, model, kv_blocks: int = 96):
        self.ahead, self.plain = _engine(model, True, kv_blocks), _engine(model, False, kv_blocks)

    def decode(self, ids: list[str], steps: int, features: bool = True, same_batch: bool = True):
        outs = []
        for eng in (self.ahead, self.plain):
            got = eng.decode(ids, [eng.requests[i].committed_len for i in ids], steps, features)
            eng.after_call()
            outs.append(got)
        self.check(*outs, exact=same_batch)
        return outs[0]

    def verify(self, ids: list[str]):
        outs = [eng.verify(root_only_tree(ids, [eng.requests[i].committed_len for i in ids],
                                          [eng.requests[i].token_ids[-1] for i in ids]))
                for eng in (self.ahead, self.plain)]
        self.check(*outs)

    def check(self, got, want, exact: bool = True) -> None:
        assert [o.request_id for o in got] == [o.request_id for o in want]
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        for g, w in zip(got, want):
            assert g.committed_len == w.committed_len
            assert (g.features is None) == (w.features is None)
            if w.features is not None:
                torch.testing.assert_close(g.features, w.features, **({"rtol": 0, "atol": 0} if exact else {}))
        self.check_state()

    def check_state(self) -> None:
        """Same requests, tokens and slots; the pool holds the same blocks, less what a queued
        decode ahead reserved past the committed entries."""
        a, p = self.ahead, self.plain
        assert {r: q.token_ids for r, q in a.requests.items()} == {r: q.token_ids for r, q in p.requests.items()}
        extra = 0
        if a._ahead is not None:
            bs = BLOCK
            for rid, (_, committed) in a._ahead.rows.items():
                c = committed - 1
                extra += -(-(c + a._ahead.steps) // bs) - -(-c // bs)
        assert a.kv_stats()["used_blocks"] - extra == p.kv_stats()["used_blocks"]


def test_decodes_take_the_decode_ahead_token_for_token(model):
    pair = Pair(model)
    for _ in range(6):
        pair.decode(IDS, 4)
    assert pair.ahead.ahead_used == 5 and pair.ahead.ahead_dropped == 0
    assert pair.ahead._ahead is not None     # the seventh chunk is queued already


def test_some_of_the_requests_and_the_ones_released(model):
    pair = Pair(model)
    pair.decode(IDS, 3)
    for eng in (pair.ahead, pair.plain):
        eng.release("b")          # ended: its row of the decode ahead is dropped, the others stay
    pair.check_state()
    pair.decode(["c", "a"], 3, same_batch=False)    # another order, without "b"
    pair.decode(["a"], 3, same_batch=False)         # "c" not asked: its KV past the committed entries goes
    # Not queued for "c": a decode of its own (their KV holds entries of other batches: not exact).
    pair.decode(["a", "c"], 3, same_batch=False)
    assert pair.ahead.ahead_used == 2


def test_fewer_steps_take_the_first_ones(model):
    pair = Pair(model)
    pair.decode(IDS, 4)
    pair.decode(IDS, 3)           # a chunk cut short (a request's max_tokens): the first 3 of the 4 queued
    pair.decode(IDS, 1)
    pair.decode(IDS, 4)           # more than queued: a decode of its own
    pair.decode(IDS, 4)
    assert (pair.ahead.ahead_used, pair.ahead.ahead_dropped) == (3, 1)


@pytest.mark.parametrize("then", ["verify", "more steps", "prefill", "features wanted"])
def test_any_other_call_forgets_the_decode_ahead(model, then):
    pair = Pair(model)
    pair.decode(IDS, 4, features=False)
    assert pair.ahead._ahead is not None
    if then == "verify":
        pair.verify(IDS)
    elif then == "more steps":
        pair.decode(IDS, 5)
    elif then == "features wanted":      # queued without features: cannot give them
        pair.decode(IDS, 4, features=True)
    else:
        for eng in (pair.ahead, pair.plain):
            eng.prefill(["d"], [PROMPTS[0][:5]], [GREEDY], [0])
        pair.check_state()
        pair.decode(IDS + ["d"], 4)
    assert pair.ahead.ahead_dropped == 1
    # After the prefill the chunk queued holds "d" too: the rows this decode takes for IDS come
    # from a batch of four, the other engine's from one of three (tokens equal, features to the
    # last bits on CPUs whose GEMM depends on the batch).
    pair.decode(IDS, 4, same_batch=then != "prefill")


def test_new_prompts_in_the_decode_are_prefilled_apart(model):
    """A decode that also prefills new requests (mixed prefill) takes the queued chunk for the
    others and prefills the new ones on their own (the engine without it mixes them into the
    first step: the same tokens, features up to the last bits); the next decode ahead holds them."""
    from verifier.engine import NewRequests

    pair = Pair(model)
    pair.decode(IDS, 4)
    outs = []
    for eng in (pair.ahead, pair.plain):
        got, pre = eng.decode_with_prefill(IDS, [eng.requests[i].committed_len for i in IDS], 4,
                                           NewRequests(["d"], [PROMPTS[1][:4]], [GREEDY], [0]))
        eng.after_call()
        outs.append((got, [(p.request_id, p.first_token_id) for p in pre]))
    assert outs[0][1] == outs[1][1]
    pair.check(outs[0][0], outs[1][0], exact=False)
    pair.decode(IDS + ["d"], 4, same_batch=False)
    assert (pair.ahead.ahead_used, pair.ahead.ahead_dropped) == (2, 0)


def test_a_full_pool_queues_nothing(model):
    # Room for the prompts and one decode; no block is left for a decode ahead of every request.
    need = sum(-(-(len(p) + 4) // BLOCK) for p in PROMPTS)
    pair = Pair(model, kv_blocks=need + 1)
    pair.decode(IDS, 4)
    assert pair.ahead._ahead is None
    pair.check_state()


def test_the_context_end_queues_nothing(model):
    pair = Pair(model)
    while max(q.committed_len for q in pair.plain.requests.values()) - 1 + 8 <= MAX_LEN:
        pair.decode(IDS, 4)
    pair.decode(IDS, 4)
    assert pair.ahead._ahead is None


def test_negative_control_wrong_tokens_ahead_are_caught(model):
    pair = Pair(model)
    pair.decode(IDS, 4)
    pair.ahead._ahead.tokens[1, 2] += 1     # what a decode ahead from the wrong token would give
    with pytest.raises(AssertionError):
        pair.decode(IDS, 4)
