"""benchmarks/engine_traces.py on hand-made torch.profiler traces: the drafter's kernels group
into bursts by their gaps, the verifier's busy time inside them is counted, and the engine loop's
kernels are told apart by the function that launched them."""

import json

from benchmarks.engine_traces import _bursts, loop_report, served_report


def _kernel(ts, dur, name="k", corr=None):
    return {"ph": "X", "cat": "kernel", "ts": ts, "dur": dur, "name": name, "args": {"correlation": corr, "device": 0}}


def test_bursts_split_at_gaps_and_sum_their_busy_time():
    spans = [(0, 100), (150, 300), (250, 400), (2000, 2100)]
    assert _bursts(spans, 300.0) == [(0, 400, 350, 3), (2000, 2100, 100, 1)]


def test_served_report_counts_the_verifier_inside_the_drafter_s_bursts(tmp_path):
    drafter = [_kernel(0, 600), _kernel(700, 500), _kernel(5000, 1200), _kernel(6300, 100)]
    verifier = [_kernel(900, 1000), _kernel(9000, 50)]
    (tmp_path / "trace-drafter-1.json").write_text(json.dumps({"traceEvents": drafter}))
    (tmp_path / "trace-verifier-2.json").write_text(json.dumps({"traceEvents": verifier}))
    text = served_report(tmp_path)
    assert "2 bursts" in text
    assert "bursts of 1 ms or more: 2" in text
    # Inside [0, 1200] the verifier is busy 300 µs, inside [5000, 6400] not at all: 300 of 2,600 µs.
    assert "(11.5% of their spans)" in text


def test_loop_report_tells_the_drafter_s_kernels_by_their_launcher(tmp_path):
    events = []
    for i, (who, ts) in enumerate([("verifier/engine.py(10): verify", 0), ("drafter/engine.py(20): draft", 1000),
                                   ("drafter/engine.py(20): draft", 1100), ("verifier/engine.py(10): verify", 2000)]):
        events += [{"ph": "X", "cat": "python_function", "name": who, "ts": ts - 5, "dur": 20, "tid": 1},
                   {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "tid": 1,
                    "args": {"correlation": i}},
                   _kernel(ts + 10, 50, corr=i)]
    path = tmp_path / "loop.json"
    path.write_text(json.dumps({"traceEvents": events}))
    text = loop_report(str(path))
    assert "'drafter': 2" in text and "'verifier': 2" in text
    assert "between verifier kernels: 1" in text
    assert "span median 0.15 ms" in text
