"""benchmarks/after_forward.py runs end to end on the CPU: the draft-sized workload timed alone and
after the target-sized one in this process and in another (a smoke test; the figures it prints
are measured on the 2-core CPU, not asserted)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_after_forward_times_each_arrangement():
    core = min(os.sched_getaffinity(0))
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "after_forward.py"), "--core", str(core),
                          "--calls", "3", "--repeats", "2"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {m.group(1).strip(): m.group(2).split() for m in re.finditer(r"^  (\D+?)\s+([\d. ]+)$", out.stdout, re.M)}
    assert set(rows) == {"alone", "after the target, this process", "after the target, another process"}, out.stdout
    assert all(len(v) == 2 and all(float(x) > 0 for x in v) for v in rows.values()), rows
