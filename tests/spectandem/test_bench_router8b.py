"""`spectandem bench --sections router8b` at the tiny llama8b scale on the CPU (fp32): the router's
modes at controlled acceptance, ping-pong included, with the verifier's busy time per row
(benchmarks/bench/router8b.py), and the flags that choose modes and the drafter's device."""

import statistics

import pytest
import torch

from benchmarks.bench.llama8b import SHAPES, ControlledRuns, llama8b_spec, random_eagle3_head, random_target
from benchmarks.bench.router8b import bench_router8b

STEPS = 4            # drafts per chain
MAX_TOKENS = 16      # 1 token from the prefill + 3 rounds of STEPS + 1 at full acceptance
BATCH = 4


@pytest.fixture(scope="module")
def runs():
    model = random_target(llama8b_spec("tiny"), "cpu", torch.float32, 0)
    head = random_eagle3_head(model, SHAPES["tiny"]["draft_vocab_size"], "cpu", torch.float32, 0)
    return ControlledRuns(model, head, "cpu", BATCH, 2, 16, MAX_TOKENS, STEPS, 0)


@pytest.fixture(scope="module")
def rows(runs):
    return {r["mode"]: r for r in bench_router8b(runs, [1.0], ["sequential", "pingpong"], [BATCH])}


@pytest.fixture(scope="module")
def repeated(runs):
    return bench_router8b(runs, [1.0], ["sequential"], [BATCH], repeats=3)


def test_plain_sequential_and_pingpong_rows_match_the_targets_tokens(rows):
    assert set(rows) == {"plain", "sequential", "pingpong"}
    for r in rows.values():
        # bench_router8b raises if any request's tokens differ from the target's greedy continuation.
        assert r["matches_plain"] and r["batch_size"] == BATCH and r["tokens_per_s"] > 0, r
        assert r["placement"] == "one-device" and r["verifier_device"] == r["drafter_device"] == "cpu", r
    assert rows["plain"]["accept_length"] == 1.0 and rows["plain"]["acceptance_rate"] is None
    for mode in ("sequential", "pingpong"):
        # a = 1: every round accepts the whole chain, so drafts really were verified in both modes.
        assert rows[mode]["accept_length"] == STEPS + 1 and rows[mode]["speedup"] > 0
    # Each request needs 3 rounds; ping-pong verifies the batch as two halves, one verify each.
    assert rows["sequential"]["rounds"] == 3 and rows["pingpong"]["rounds"] == 6
    assert rows["plain"]["rounds"] == MAX_TOKENS - 1


def test_every_row_has_the_verifiers_busy_time(rows):
    for r in rows.values():
        assert r["verify_busy_s"] > 0 and r["prefill_busy_s"] > 0, r
        # Busy time is measured inside the timed batch and the link runs one call at a time.
        assert r["round_over_verify"] >= 0.99, r
    assert rows["plain"]["drafter_busy_s"] is None
    assert rows["sequential"]["drafter_busy_s"] > 0 and rows["pingpong"]["drafter_busy_s"] > 0
    # Against the sequential row's verify calls: the sequential row itself gives its own ratio.
    seq, pp = rows["sequential"], rows["pingpong"]
    assert seq["over_verify_alone"] == pytest.approx(seq["round_over_verify"], abs=0.01)
    assert pp["over_verify_alone"] == pytest.approx((pp["wall_s"] - pp["prefill_busy_s"]) / seq["verify_busy_s"],
                                                    rel=0.01)
    assert rows["plain"]["over_verify_alone"] is None


def test_a_second_placement_gets_its_own_proposer_and_shares_the_target_engines(runs):
    other = runs.with_drafter_device("cpu")
    assert other.inner is not runs.inner   # same device: the head's weights, not a copy
    assert all(a is b for a, b in zip(other.inner.head.parameters(), runs.inner.head.parameters()))
    assert other.verifier is runs.verifier and other.truths is runs.truths
    assert other.placement() == dict(placement="one-device", verifier_device="cpu", drafter_device="cpu")


def _plan(*flags):
    from benchmarks.bench.command import BenchPlan
    from spectandem.cli import build_parser

    args = build_parser().parse_args(["bench", "--sections", "router8b", "--llama8b-scale", "tiny", *flags])
    return BenchPlan.from_args(args, "cpu")


def test_router8b_flags():
    plan = _plan("--router8b-modes", "sequential,pingpong,auto", "--router8b-batch-sizes", "4,8")
    assert plan.router8b_modes == ("sequential", "pingpong", "auto") and plan.router8b_batch_sizes == (4, 8)
    assert plan.router8b_drafter_device is None            # auto: no second GPU here
    assert _plan("--router8b-drafter-device", "none").router8b_drafter_device is None
    assert _plan("--router8b-modes", "sequential,ahead").router8b_modes == ("sequential", "ahead")
    with pytest.raises(ValueError, match="unknown.*short:1"):
        _plan("--router8b-modes", "sequential,short:1")
    with pytest.raises(ValueError, match="--router8b-drafter-device"):
        _plan("--router8b-drafter-device", "cuda:1")


def test_rows_are_the_median_of_repeated_batches(runs, repeated):
    for r in repeated:
        assert r["repeats"] == 3 and len(r["tokens_per_s_runs"]) == 3, r
        # The row's rate is the middle one of its three batches.
        assert r["tokens_per_s"] == sorted(r["tokens_per_s_runs"])[1], r
    with pytest.raises(ValueError, match="repeats"):
        bench_router8b(runs, [1.0], ["sequential"], [BATCH], repeats=0)
    with pytest.raises(ValueError, match="--router8b-repeats"):
        _plan("--router8b-repeats", "0")


def test_speculating_rows_have_plain_batches_timed_between_their_own(rows, repeated):
    from benchmarks.bench.command import _note

    speculating = [(r, n) for section, n in ((rows.values(), 1), (repeated, 3))
                   for r in section if r["mode"] != "plain"]
    assert len(speculating) == 3
    for r, repeats in speculating:
        got = r["paired_plain_runs"]
        assert r["repeats"] == repeats and len(got) == repeats and min(got) > 0, r
        assert r["paired_plain_tokens_per_s"] == statistics.median(got), r
        assert r["speedup_paired"] == pytest.approx(r["tokens_per_s"] / r["paired_plain_tokens_per_s"], abs=1e-3), r
        assert f"paired {r['speedup_paired']:.2f}x" in _note(r)
    # The plain rows are the baseline, paired with nothing.
    assert "paired_plain_runs" not in rows["plain"] and "paired_plain_runs" not in repeated[0]
