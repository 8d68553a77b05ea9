"""benchmarks/idle_core.py runs end to end on the CPU: every idle mode (or those `--modes` names)
times the same number of drafts (a smoke test; the figures it prints are measured on the 2-core CPU, not asserted)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_idle_core_times_every_mode():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "idle_core.py"), "--idle-ms", "1", "--repeats", "1",
                          "--prompts", "1", "--max-tokens", "12"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("repeat 1"))
    drafts = int(re.search(r"\((\d+) drafts a run\)", line).group(1))
    assert drafts >= 1
    from benchmarks.idle_core import MODES
    for mode in MODES:
        assert re.search(rf"(?:: |; ){re.escape(mode)}: draft \d+\.\d\d, verify \d+\.\d\d", line), (mode, line)


def test_idle_core_runs_the_modes_asked():
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "idle_core.py"), "--idle-ms", "1", "--repeats", "1",
                          "--prompts", "1", "--max-tokens", "12", "--modes", "back to back", "asleep, then spinning"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    line = next(l for l in out.stdout.splitlines() if l.strip().startswith("repeat 1"))
    assert re.findall(r"(?:: |; )([a-z, ]+): draft", line) == ["back to back", "asleep, then spinning"], line
