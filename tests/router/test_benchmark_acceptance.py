"""`spectandem serve --benchmark-acceptance-rate A` (drafter/controlled.py): a warm-up pass
teaches the drafter each prompt's greedy output; a later greedy pass then drafts it with each
draft right at rate A, through the real server, and the output stays the target's greedy output."""

from __future__ import annotations

import math
import subprocess
import sys
import threading

import pytest

from spectandem.config import SpecConfig
from spectandem.demo import demo_paths
from spectandem.v1 import generation_pb2
from tests.router.conftest import Served, collect, request

# The demo tree at --topk 1: chains as deep as its head states.
NUM_STEPS = SpecConfig(method="eagle3").for_draft(demo_paths("eagle3")[1]).num_steps
MEASURED = 96                # the first token, then rounds of NUM_STEPS + 1 tokens at rate 1
WARM = MEASURED + 16         # truths past every position the measured pass drafts


def _served(rate, *flags, backend="local", pipeline="sequential") -> Served:
    return Served(["--backend", backend, "--max-len", "512", "--pipeline", pipeline,
                   "--benchmark-acceptance-rate", str(rate), *flags]).wait_ready()


def _pass(s: Served, prompts, max_tokens: int):
    return [collect(s.stub, request(ids=p, max_tokens=max_tokens, ignore_eos=True)) for p in prompts]


def _accept_length(results) -> float:
    """Committed tokens per drafted round over these completions (rounds without a draft left out)."""
    drafted = sum(st.draft_tokens for *_, st in results) / NUM_STEPS
    return 1 + sum(st.accepted_tokens for *_, st in results) / drafted


@pytest.fixture(scope="module")
def reference(prompts):
    """Plain greedy decoding of each prompt (`--method none`)."""
    s = Served(["--backend", "local", "--max-len", "512", "--method", "none"]).wait_ready()
    try:
        return [toks for toks, *_ in _pass(s, prompts, WARM)]
    finally:
        s.close()


def _check_outputs(results, reference, n):
    for (toks, _, reason, _), ref in zip(results, reference):
        assert reason == "length" and toks == ref[:n]


def test_rate_one_accepts_every_draft(prompts, reference, caplog):
    s = _served(1.0)
    try:
        warned = [r for r in caplog.records if r.name == "spectandem.serve" and r.levelname == "WARNING"]
        assert any("benchmark mode: drafts follow outputs seen before at acceptance rate 1; not for production"
                   in r.getMessage() for r in warned)
        info = s.stub.GetModelInfo(generation_pb2.GetModelInfoRequest())
        assert info.HasField("benchmark_acceptance_rate") and info.benchmark_acceptance_rate == 1.0
        first = _pass(s, prompts, WARM)              # no truth yet: the real head drafts
        _check_outputs(first, reference, WARM)
        measured = _pass(s, prompts, MEASURED)
        _check_outputs(measured, reference, MEASURED)
        for *_, st in measured:
            assert st.plain_rounds == st.fallback_rounds == 0
            assert st.accepted_tokens == st.draft_tokens == NUM_STEPS * st.num_rounds
            assert st.accept_length == NUM_STEPS + 1
    finally:
        s.close()


def test_rate_zero_accepts_no_draft(prompts, reference):
    s = _served(0.0)
    try:
        _check_outputs(_pass(s, prompts, WARM), reference, WARM)
        measured = _pass(s, prompts, MEASURED)
        _check_outputs(measured, reference, MEASURED)
        assert sum(st.draft_tokens for *_, st in measured) > 0
        assert all(st.accepted_tokens == 0 for *_, st in measured)
        assert _accept_length(measured) == 1.0
    finally:
        s.close()


def _band(a: float, rounds: float, sigmas: float = 6.0) -> tuple[float, float]:
    """Where the mean accept length of `rounds` independent rounds of M = NUM_STEPS drafts at
    rate a lies but for a chance far below 1e-6: 1 + E[K] +- sigmas standard errors, K the
    accepted drafts of one round (P(K >= j) = a^j for j <= M)."""
    mean = sum(a ** j for j in range(1, NUM_STEPS + 1))
    var = sum((2 * j - 1) * a ** j for j in range(1, NUM_STEPS + 1)) - mean ** 2
    half = sigmas * math.sqrt(var / rounds)
    return 1 + mean - half, 1 + mean + half


@pytest.mark.parametrize("pipeline", ["sequential", "ahead"])
def test_rate_point_eight_is_measured_within_its_band(prompts, reference, pipeline):
    s = _served(0.8, pipeline=pipeline)
    try:
        _check_outputs(_pass(s, prompts, WARM), reference, WARM)
        measured = _pass(s, prompts, MEASURED)
        _check_outputs(measured, reference, MEASURED)
        rounds = sum(st.draft_tokens for *_, st in measured) / NUM_STEPS
        low, high = _band(0.8, rounds)
        assert rounds >= 80 and 1.0 < low < _accept_length(measured) < high < NUM_STEPS + 1
    finally:
        s.close()


def test_a_batch_mixes_planned_unplanned_and_sampled_requests(prompts, reference):
    s = _served(0.8, "--max-running", "8")
    try:
        seen, unseen = prompts[:3], prompts[3]
        _pass(s, seen, WARM)
        out: dict = {}

        def run(key, p, **params):
            try:
                out[key] = collect(s.stub, request(ids=p, max_tokens=MEASURED, ignore_eos=True, **params))
            except Exception as exc:   # surfaced below
                out[key] = exc
        jobs = [(i, p, {}) for i, p in enumerate(seen)] + [("unseen", unseen, {}),
                                                           ("sampled", seen[0], dict(temperature=0.8, seed=5))]
        threads = [threading.Thread(target=run, args=(k, p), kwargs=kw) for k, p, kw in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        _check_outputs([out[i] for i in range(3)] + [out["unseen"]], reference, MEASURED)
        toks, _, reason, _ = out["sampled"]
        assert reason == "length" and len(toks) == MEASURED
    finally:
        s.close()


def test_grpc_engine_process_gets_the_rate(prompts, reference):
    s = _served(1.0, backend="grpc")
    try:
        _pass(s, prompts[:1], WARM)
        measured = _pass(s, prompts[:1], MEASURED)
        _check_outputs(measured, reference, MEASURED)
        assert all(st.accept_length == NUM_STEPS + 1 and st.plain_rounds == 0 for *_, st in measured)
    finally:
        s.close()


@pytest.mark.parametrize("flags, message", [
    (["--method", "ngram"], "needs an EAGLE head"),
    (["--topk", "2", "--num-draft-tokens", "8"], "needs topk 1"),
    (["--fused", "--num-draft-tokens", "2"], "fused mode"),
])
def test_refused_combinations(flags, message):
    with pytest.raises(ValueError, match=f"benchmark_acceptance_rate {message}|{message}"):
        Served(["--backend", "local", "--benchmark-acceptance-rate", "0.5", *flags]).wait_ready()


def test_rate_outside_zero_one_is_refused(capsys):
    with pytest.raises(SystemExit):
        Served(["--backend", "local", "--benchmark-acceptance-rate", "1.5"])
    assert "--benchmark-acceptance-rate: must be a number in [0, 1], got '1.5'" in capsys.readouterr().err


def test_drafter_process_refuses_a_rate_without_an_eagle_head():
    done = subprocess.run([sys.executable, "-m", "drafter", "--method", "ngram", "--benchmark-acceptance-rate", "0.5",
                           "--port", "0"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "benchmark_acceptance_rate needs an EAGLE head" in done.stderr
