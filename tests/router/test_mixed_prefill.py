"""Mixed prefill (router/loop.py `_mixes`, `_verify_with_prefill`; serve --mixed-prefill, on by
default): requests that arrive while others run are prefilled in the step of the round's verify
(VerifierLink.verify_prefill) and join the running batch after it; while speculation runs,
admission beside the draft (--overlap-admission) goes first. Fake engines first
(tests/router/fakes.py: the verifier's verify_prefill is its prefill then its verify), then
`spectandem serve` on the demo pair with each backend, over the public gRPC API."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from router.requests import Failure
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.fakes import OracleVerifier, reference
from tests.router.test_admit_beside_draft import EARLY, LATE, SlowDrafter, _serve_staggered
from tests.router.test_router_fakes import assert_clean, config, run
from tests.router.conftest import RAY_CLUSTERS, Served, collect as collect_rpc, request


class SlowVerifier(OracleVerifier):
    """Verifies take a couple of milliseconds, so that the early requests still run when the late arrive."""

    async def verify(self, draft, plain, want_features, on_launch=None):
        await asyncio.sleep(0.002)
        return await super().verify(draft, plain, want_features, on_launch)


def _late_mixed(verifier) -> list[str]:
    return [rid for ids in verifier.mixed for rid in ids if rid.startswith("late-")]


@pytest.mark.parametrize("drafter", [SlowDrafter, None], ids=["speculating", "plain"])
def test_late_requests_prefill_in_the_verify_step_and_stay_exact(drafter):
    drafter = drafter() if drafter else None
    verifier = OracleVerifier() if drafter else SlowVerifier()
    cfg = config(mixed_prefill=True, admit_beside_draft=False, plain_steps=3)
    router, early, late = run(_serve_staggered(verifier, drafter, cfg))
    for (tokens, _, reason), p in zip(early + late, EARLY + LATE):
        assert tokens == reference(p, 40) and reason == "length", p
    assert sorted(_late_mixed(verifier)) == sorted(f"late-{i}" for i in range(len(LATE)))
    assert router.counters.mixed_prefills == len(LATE)
    assert not any(rid.startswith("early-") for ids in verifier.mixed for rid in ids)   # nothing ran to ride on
    assert_clean(verifier, drafter)


@pytest.mark.parametrize("cfg", [dict(mixed_prefill=False, admit_beside_draft=False),
                                 dict(mixed_prefill=True, admit_beside_draft=True)], ids=["off", "beside-draft"])
def test_no_verify_carries_a_prefill_when_off_or_beside_a_draft(cfg):
    """Negative controls: the same run with the setting off, and with admission beside the draft
    on while speculation runs (it goes first)."""
    drafter, verifier = SlowDrafter(), OracleVerifier()
    router, early, late = run(_serve_staggered(verifier, drafter, config(**cfg)))
    for (tokens, _, _), p in zip(early + late, EARLY + LATE):
        assert tokens == reference(p, 40), p
    assert verifier.mixed == [] and router.counters.mixed_prefills == 0
    assert router.counters.draft_tokens > 0
    assert_clean(verifier, drafter)


def test_a_refused_prompt_fails_alone():
    """The verifier refuses one new request: the round is verified without the prefill, the new
    requests are admitted on their own (only the refused one fails), the rest are exact."""
    drafter, verifier = SlowDrafter(), OracleVerifier()
    verifier.refuse = {"late-1"}
    _, early, late = run(_serve_staggered(verifier, drafter, config(mixed_prefill=True, admit_beside_draft=False)))
    for (tokens, _, reason), p in zip(early, EARLY):
        assert tokens == reference(p, 40) and reason == "length"
    for i, ((tokens, _, reason), p) in enumerate(zip(late, LATE)):
        if i == 1:
            assert isinstance(reason, Failure) and reason.code == "INVALID_ARGUMENT" and tokens == []
        else:
            assert tokens == reference(p, 40) and reason == "length", p
    assert_clean(verifier, drafter)


def test_the_verifier_failing_in_a_mixed_step_fails_every_request():
    drafter, verifier = SlowDrafter(), OracleVerifier()
    prefill = verifier.prefill

    async def failing(items, want_features):
        if any(i.tag.request_id.startswith("late-") for i in items):
            verifier.down = True
        return await prefill(items, want_features)

    verifier.prefill = failing
    router, early, late = run(_serve_staggered(verifier, drafter, config(mixed_prefill=True, admit_beside_draft=False)))
    assert verifier.mixed
    for _, _, reason in early + late:
        assert isinstance(reason, Failure) and reason.code == "UNAVAILABLE"
    assert not router.serving and router.running == [] and router.waiting == []
    assert drafter.errors == [] and verifier.errors == []


def _staggered(server, prompts, params):
    got: dict[int, list[int]] = {}

    def one(i):
        got[i] = collect_rpc(server.stub, request(ids=prompts[i], **params[i]))[0]

    threads = []
    for i in range(len(prompts)):   # each arrives while the earlier ones run
        threads.append(threading.Thread(target=one, args=(i,)))
        threads[-1].start()
        time.sleep(0.05)
    for t in threads:
        t.join(180)
    return [got.get(i) for i in range(len(prompts))]


@pytest.mark.parametrize("backend", ["local", "grpc", pytest.param("ray", marks=RAY_CLUSTERS)])
def test_serve_prefills_in_the_verify_step_with_every_backend(backend):
    """`spectandem serve` (CPU, demo pair; admission beside the draft off, so that the speculating
    rounds carry the prefills): requests arriving while others run are prefilled in verify
    steps; greedy outputs equal plain greedy decoding of the target, sampled ones their seed's
    tokens, over the public gRPC API."""
    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=8, max_len=512)
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=512)
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:6]]
    params = [dict(max_tokens=40, ignore_eos=True) if i % 3 else
              dict(max_tokens=40, ignore_eos=True, temperature=0.8, seed=50 + i) for i in range(6)]
    sp = [SamplingParams(**p) for p in params]
    expected = [(plain if s.greedy else spec).generate([p], [s])[0].token_ids for p, s in zip(prompts, sp)]
    server = Served(["--backend", backend, "--max-len", "512", "--no-overlap-admission"]).wait_ready(300)
    try:
        assert _staggered(server, prompts, params) == expected
        assert server.state["router"].counters.mixed_prefills > 0
    finally:
        server.close()


def test_serve_plain_decoding_prefills_in_the_decode_step_by_default():
    """`spectandem serve --method none` with default flags: the multi-step plain decode carries
    the new prompts; `--no-mixed-prefill` turns that off. Both equal plain greedy decoding."""
    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=512)
    prompts = [plain.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:6]]
    params = [dict(max_tokens=40, ignore_eos=True)] * 6
    expected = [c.token_ids for c in plain.generate(prompts, [SamplingParams(**p) for p in params])]
    for flags, mixes in (([], True), (["--no-mixed-prefill"], False)):
        server = Served(["--backend", "local", "--max-len", "512", "--method", "none", *flags]).wait_ready()
        try:
            assert _staggered(server, prompts, params) == expected
            assert (server.state["router"].counters.mixed_prefills > 0) is mixes
        finally:
            server.close()
