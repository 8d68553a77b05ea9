"""The soak of "nothing lost, nothing stuck": `spectandem serve --backend grpc` (real processes,
real signals, real gRPC) under 300 mixed requests at concurrency 16 while the drafter is killed
twice and stalled once and the verifier killed once; then the five invariants of
benchmarks/soak.py. The checker's own tests feed it fabricated runs, each with one defect it must
report (negative controls), and one clean run it must pass."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "soak.py"
_spec = importlib.util.spec_from_file_location("soak", _PATH)
soak = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("soak", soak)
_spec.loader.exec_module(soak)

Planned, Record, FaultEvent = soak.Planned, soak.Record, soak.FaultEvent

REF = [11, 12, 13, 14, 15, 16, 17, 18]
USAGE = {"router": {"running": 0, "waiting": 0, "verifier_kv_used": 0, "drafter_kv_used": 0},
         "verifier": {"used_slots": 0, "kv_used_blocks": 0}, "drafter": {"used_slots": 0, "kv_used_blocks": 0}}
END = {"health": "SERVING", "usage": USAGE, "engines": {"verifier": 1, "drafter": 2},
       "fresh_request": {"ok": True, "finish_reason": "length"}}


def _clean():
    """A fabricated run with one request of each shape, every one as it should be."""
    plan = [Planned(0, "greedy_stream", 0, 8), Planned(1, "greedy", 0, 5, streamed=False),
            Planned(2, "cancel", 0, 8, cancel_after=1), Planned(3, "short_deadline", 0, 8, timeout=0.2,
                                                                 short_deadline=True),
            Planned(4, "greedy_stream", 0, 8), Planned(5, "dup_id", 0, 8, request_id="d"),
            Planned(6, "sampled_stream", 0, 4, temperature=0.9, seed=1)]
    recs = [Record(0, 1, 2, chunks=[[11, 12], [13], [14, 15, 16, 17, 18]], finishes=[(2, "length")]),
            Record(1, 1, 2, chunks=[[11, 12, 13, 14, 15]], finishes=[(0, "length")], unary=True),
            Record(2, 1, 2, chunks=[[11, 12]], client_cancelled=True),
            Record(3, 1, 2, chunks=[[11]], code="DEADLINE_EXCEEDED"),
            Record(4, 10, 12, chunks=[[11, 12]], code="UNAVAILABLE"),       # during the verifier's fault
            Record(5, 1, 2, chunks=[REF], finishes=[(0, "length")], response_ids=["d"], unary=True),
            Record(6, 1, 2, chunks=[[1, 2], [3, 4]], finishes=[(1, "length")])]
    faults = [FaultEvent("verifier-kill", 3, t_signal=11.0, t_recovered=15.0), FaultEvent("drafter-kill", 1, 0.5)]
    return plan, recs, {(0, 0.0, None): REF}, faults


def _check(plan, recs, refs, faults, end=END, baseline=USAGE):
    return soak.check(plan, recs, refs, faults, end, baseline)


def _invariants(fig):
    return sorted({v["invariant"] for v in fig["violations"]})


def test_checker_passes_a_clean_run():
    fig = _check(*_clean())
    assert fig["violations"] == []
    assert (fig["completed"], fig["failed"], fig["client_cancelled"], fig["checked_completions"]) == (4, 2, 1, 3)
    assert fig["failed_by_code"] == {"DEADLINE_EXCEEDED": 1, "UNAVAILABLE": 1}


def test_checker_reports_a_repeated_chunk():
    plan, recs, refs, faults = _clean()
    recs[0].chunks = [[11, 12], [11, 12], [13, 14, 15, 16]]
    fig = _check(plan, recs, refs, faults)
    assert fig["repeated_chunks"] == 1 and "stream" in _invariants(fig)


def test_checker_reports_a_chunk_taken_back():
    plan, recs, refs, faults = _clean()
    recs[2].chunks = [[11, 12], [12, 99]]           # a partial (cancelled) stream that rewrites a token
    fig = _check(plan, recs, refs, faults)
    assert fig["taken_back_chunks"] == 1 and "stream" in _invariants(fig)


def test_checker_reports_a_wrong_token():
    plan, recs, refs, faults = _clean()
    recs[1].chunks = [[11, 12, 13, 99, 15]]
    fig = _check(plan, recs, refs, faults)
    assert fig["wrong_tokens"] == 1 and _invariants(fig) == ["tokens"]


def test_checker_reports_a_short_completion():
    plan, recs, refs, faults = _clean()
    recs[0].chunks, recs[0].finishes = [[11, 12], [13]], [(1, "stop")]
    assert "tokens" in _invariants(_check(plan, recs, refs, faults))


@pytest.mark.parametrize("defect", ["no_end", "two_finishes", "chunk_after_finish", "hung", "stuck",
                                    "unavailable_outside_fault", "internal"])
def test_checker_reports_a_request_without_exactly_one_end(defect):
    plan, recs, refs, faults = _clean()
    r = recs[0]
    if defect == "no_end":
        r.finishes = []
    elif defect == "two_finishes":
        r.chunks.append([])
        r.finishes.append((3, "length"))
    elif defect == "chunk_after_finish":
        r.chunks, r.finishes = [[11, 12], [13, 14, 15, 16, 17, 18], []], [(1, "length")]
    elif defect == "hung":
        r.finishes, r.hung = [], True
    elif defect == "stuck":
        r.finishes, r.code = [], "DEADLINE_EXCEEDED"
    elif defect == "unavailable_outside_fault":
        r.finishes, r.code = [], "UNAVAILABLE"         # t 1-2 s; the verifier fault was 11-15 s
    else:
        r.finishes, r.code = [], "INTERNAL"
    fig = _check(plan, recs, refs, faults)
    assert _invariants(fig) in (["terminal"], ["stream", "terminal"], ["stream"]) and fig["violations"]
    if defect in ("stuck", "unavailable_outside_fault", "internal"):
        assert fig["unexplained_failures"] == 1


def _finished_then_deadline(t_end: float, t_finish: float = 1.19):
    """Request 3 (deadline 0.2 s, sent at 1 s) gets all its tokens and its finish, then a
    DEADLINE_EXCEEDED status at `t_end`."""
    plan, recs, refs, faults = _clean()
    recs[3] = Record(3, 1.0, t_end, chunks=[[11, 12, 13], [14, 15, 16, 17, 18]], chunk_times=[1.1, t_finish],
                     finishes=[(1, "length")], code="DEADLINE_EXCEEDED")
    return plan, recs, refs, faults


def test_checker_counts_a_finish_whose_status_came_at_the_deadline_once():
    fig = _check(*_finished_then_deadline(t_end=1.2))
    assert fig["violations"] == []
    assert (fig["finished_at_deadline"], fig["completed"], fig["checked_completions"]) == (1, 5, 4)
    assert fig["failed_by_code"] == {"UNAVAILABLE": 1}


def test_checker_counts_a_finish_read_after_the_deadline_once():
    """The client's loop read the finish chunk (received in time) after the deadline had passed."""
    fig = _check(*_finished_then_deadline(t_end=1.31, t_finish=1.3))
    assert fig["violations"] == [] and fig["finished_at_deadline"] == 1


@pytest.mark.parametrize("defect", ["status_before_deadline", "chunk_after_finish", "generous_deadline"])
def test_checker_reports_a_finish_and_a_deadline_that_are_two_ends(defect):
    if defect == "status_before_deadline":
        plan, recs, refs, faults = _finished_then_deadline(t_end=1.1, t_finish=1.05)
    elif defect == "chunk_after_finish":
        plan, recs, refs, faults = _finished_then_deadline(t_end=1.2)
        recs[3].finishes = [(0, "length")]
    else:
        plan, recs, refs, faults = _finished_then_deadline(t_end=1.2)
        plan[3] = Planned(3, "greedy_stream", 0, 8, timeout=0.2)
    fig = _check(plan, recs, refs, faults)
    assert fig["finished_at_deadline"] == 0 and "terminal" in _invariants(fig)


def test_checker_reports_a_duplicate_id_mixup():
    plan, recs, refs, faults = _clean()
    recs[5].response_ids = ["d", "other"]
    assert _invariants(_check(plan, recs, refs, faults)) == ["stream"]


@pytest.mark.parametrize("side,key", [("verifier", "kv_used_blocks"), ("drafter", "used_slots"),
                                      ("router", "running")])
def test_checker_reports_a_leak(side, key):
    plan, recs, refs, faults = _clean()
    usage = {k: dict(v) for k, v in USAGE.items()}
    usage[side][key] = 3
    fig = _check(plan, recs, refs, faults, end=dict(END, usage=usage))
    assert _invariants(fig) == ["leaks"] and side in fig["leaked"]


@pytest.mark.parametrize("defect", ["not_serving", "no_drafter", "fresh_failed", "fault_skipped"])
def test_checker_reports_a_server_not_serving_at_the_end(defect):
    plan, recs, refs, faults = _clean()
    end = dict(END)
    if defect == "not_serving":
        end["health"] = "NOT_SERVING"
    elif defect == "no_drafter":
        end["engines"] = {"verifier": 1}
    elif defect == "fresh_failed":
        end["fresh_request"] = {"ok": False, "error": "UNAVAILABLE"}
    else:
        faults[1].skipped = "no live drafter process serving within 60 s"
    assert _invariants(_check(plan, recs, refs, faults, end=end)) == ["serving"]


def test_an_unrecovered_verifier_explains_unavailable_to_the_end_only_with_serving_failing():
    plan, recs, refs, faults = _clean()
    faults[0].t_recovered = None
    recs[0].finishes, recs[0].code, recs[0].t_start, recs[0].t_end = [], "UNAVAILABLE", 30.0, 31.0
    end = dict(END, health="NOT_SERVING")
    fig = soak.check(plan, recs, refs, faults, end, USAGE, t_end=40.0)
    assert fig["unexplained_failures"] == 0 and _invariants(fig) == ["serving"]


def test_plan_and_schedule_cover_the_issue():
    plan = soak.plan_requests(300, 24, seed=0)
    kinds = {p.kind for p in plan}
    assert len(plan) == 300 and kinds == set(soak.KINDS)
    assert sum(p.checked for p in plan) > 200
    faults = soak.fault_schedule(300, 2, 1, 1)
    assert sorted(f.action for f in faults) == ["drafter-kill", "drafter-kill", "drafter-stall", "verifier-kill"]
    assert all(0 < f.at_ended < 300 for f in faults) and faults == sorted(faults, key=lambda f: f.at_ended)


@pytest.mark.slow
def test_soak_grpc_300_requests_with_kills_and_a_stall(tmp_path):
    cfg = soak.SoakConfig(requests=300, concurrency=16, drafter_kills=2, drafter_stalls=1, verifier_kills=1,
                          stall_seconds=6.0, drafter_timeout=2.0, restart_wait=60.0, settle_seconds=30.0,
                          max_seconds=150.0)
    fig = soak.run_soak(cfg, str(tmp_path))
    report = soak.summary(fig)
    (tmp_path / "soak.json").write_text(json.dumps(fig, indent=1, default=str))
    print(report)
    assert fig["violations"] == [], report
    # Not vacuous: everything was sent, most of it checked token for token, and the faults hit
    # requests in flight (rounds decoded without the drafter).
    assert fig["sent"] == 300, report
    assert fig["checked_completions"] >= 150, report
    assert fig["client_cancelled"] > 0 and fig["fallback_rounds"] > 0, report
    assert all(f["t_signal"] > 0 for f in fig["faults"]), report
    assert fig["stall_progress"] and all(w["open_requests"] > 0 for w in fig["stall_progress"]), report


def test_checker_reports_rounds_stalled_by_a_stopped_drafter():
    plan, recs, refs, faults = _clean()
    faults.append(FaultEvent("drafter-stall", 2, t_signal=20.0, t_resume=28.0))
    recs[0].t_start, recs[0].t_end, recs[0].chunk_times = 19.0, 29.0, [19.5, 28.5, 28.9]
    fig = _check(plan, recs, refs, faults)
    assert _invariants(fig) == ["terminal"] and fig["stall_progress"][0]["chunks"] == 0
    recs[0].chunk_times = [19.5, 25.0, 28.9]       # a chunk while it was stopped: rounds went on
    assert _check(plan, recs, refs, faults)["violations"] == []
