"""Draft ahead over the controlled proposer, behind the real router (tiny 8B-shaped target and
EAGLE-3 head on the CPU, fp32): the tokens stay the target's greedy continuation, and the outcome
cache hits exactly where the plan's guesses say it must (drafter/controlled.py)."""

import pytest
import torch

from drafter.controlled import plan_drafts
from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target
from benchmarks.bench.router8b import bench_router8b

STEPS = 4
MAX_TOKENS = 40
PROMPT_LEN = 16


@pytest.fixture(scope="module")
def runs():
    model = random_target(llama8b_spec("tiny"), "cpu", torch.float32, 0)
    head = random_eagle3_head(model, SHAPES["tiny"]["draft_vocab_size"], "cpu", torch.float32, 0)
    return ControlledRuns(model, head, "cpu", 2, 1, PROMPT_LEN, MAX_TOKENS, STEPS, 0)


def _expected(runs, rate: float, seconds_count: bool = True) -> tuple[int, int]:
    """(hits, misses) the router must report for one request of prompt 0: each round's outcome
    (the accepted drafts and the target's next token) is cached when it is the drafter's guess;
    a round's hit is reported by the next round, so the last round's never is."""
    plan = plan_drafts(runs.truths[0], PROMPT_LEN, rate, runs.vocab_size, f"{runs.seed}:0")
    truth, n, flags = plan.truth, PROMPT_LEN + 1, []
    while n - PROMPT_LEN < MAX_TOKENS:
        k = 0
        while k < STEPS and plan.drafts[n + k] == truth[n + k]:
            k += 1
        p = n + k                                  # the position of the bonus or the correction
        guess = plan.drafts[p] if k == STEPS else (plan.seconds[p] if seconds_count else -1)
        flags.append(guess == truth[p])
        n += k + 1
    flags = flags[:-1]
    return sum(flags), len(flags) - sum(flags)


@pytest.mark.parametrize("rate", [0.6, 0.8])
def test_ahead_hits_where_the_plan_says(runs, rate):
    rows = {r["mode"]: r for r in bench_router8b(runs, [rate], ["sequential", "ahead"], [1])}
    # bench_router8b raises when a request's tokens differ from the target's greedy continuation.
    seq, ahead = rows["sequential"], rows["ahead"]
    assert seq["matches_plain"] and ahead["matches_plain"]
    assert ahead["accept_length"] == seq["accept_length"] and ahead["rounds"] == seq["rounds"]
    hits, misses = _expected(runs, rate)
    assert (ahead["ahead_hits"], ahead["ahead_misses"]) == (hits, misses)
    # One request: every hit's next round went out with the tree the router held, no draft call.
    assert ahead["ready_trees"] == hits and seq["ready_trees"] == 0
    assert hits > 0 and (misses > 0 or rate > 0.6)   # this seed's a = 0.8 request never misses
    # Negative control: with first guesses only (no second guess ever right) the count differs,
    # so the equality above sees the second guesses.
    assert _expected(runs, rate, seconds_count=False)[0] < hits
    assert seq["ahead_hits"] == seq["ahead_misses"] == 0
    assert ahead["expected_ahead_hit_rate"] == pytest.approx(rate ** 5 + (1 - rate ** 4) * rate, abs=1e-3)
