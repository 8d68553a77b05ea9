"""benchmarks/core_share.py's reading of `perf sched timehist`: each core's busy share and its
threads, named by role, from the scheduler's slices (the recording itself needs perf and root,
which CI lacks; the figures are measured on the 2-core CPU, not asserted)."""

from __future__ import annotations

from benchmarks.core_share import report

# perf sched timehist's columns: time, [cpu], task[tid/pid], wait time, sched delay, run time (ms).
TIMEHIST = """\
           time    cpu  task name                       wait time  sch delay   run time
                        [tid/pid]                          (msec)     (msec)     (msec)
--------------- ------  ------------------------------  ---------  ---------  ---------
   100.001000 [0001]  python3.11[11/10]                 0.000      0.000    400.000
   100.002000 [0001]  python3.11[21/20]                 0.100      0.250    300.000
   100.003000 [0000]  spectandem[31/30]                 0.000      0.000    150.000
   100.004000 [0001]  python3.11[11/10]                 0.000      0.500    100.000
   100.005000 [0000]  <idle>                            0.000      0.000    850.000
   100.006000 [0000]  kworker/0:1[99]                   0.000      0.010      5.000
"""


def test_report_adds_up_each_core_by_thread():
    names = {"11": "verifier:spectandem-engines_0", "21": "drafter:tree-poster", "31": "router:MainThread"}
    out = report(TIMEHIST, names, seconds=1.0, top=8, timeline_ms=0).splitlines()
    assert out[0] == "core 0: ran something 16% of the 1 s"   # 150 + 5 ms: the idle task is not counted
    assert "     150.0        1             0.0  router:MainThread" in out
    assert "       5.0        1             0.0  other:kworker/0:1" in out
    core1 = out[out.index("core 1: ran something 80% of the 1 s"):]
    assert core1[2] == "     500.0        2             0.5  verifier:spectandem-engines_0"
    assert core1[3] == "     300.0        1             0.2  drafter:tree-poster"


def test_report_lists_the_timeline_when_asked():
    out = report(TIMEHIST, {"11": "verifier:engine"}, seconds=1.0, top=1, timeline_ms=10).splitlines()
    switches = [line for line in out if line.startswith("  core ")]
    assert switches and all(float(line.split()[2]) >= 0 for line in switches)
    assert any(line.endswith("verifier:engine") for line in switches)
