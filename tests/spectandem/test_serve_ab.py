"""benchmarks/serve_ab.py end to end on the CPU with the demo pair: two real servers measured in
alternation, every run's greedy outputs checked against arm A's first run. The B arm serves
another target (the demo draft LM, plainly): its outputs differ and the tool says so, while arm
A's second run matches its first."""

import json
import subprocess
import sys

from benchmarks.profile_serve import ROOT


def test_runs_alternate_and_an_arm_serving_other_tokens_is_caught(tmp_path):
    out = tmp_path / "ab.json"
    other = f"--backend local --method none --target {ROOT / 'models/demo/draft-lm'}"
    proc = subprocess.run([sys.executable, "benchmarks/serve_ab.py", "--pair", "demo", "--device", "cpu",
                           "--concurrency", "1", "--repeats", "2", "--min-prompts", "2", "--prompts-per-slot", "2",
                           "--max-tokens", "12", "--a", "--backend local", "--b", other, "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 1, log
    runs = json.loads(out.read_text())["runs"]
    assert [(r["arm"], r["repeat"], r["exact"]) for r in runs] == [
        ("A", 0, True), ("B", 0, False), ("A", 1, True), ("B", 1, False)], log
    assert all(r["output_tokens_per_s"] > 0 for r in runs)
    assert runs[0]["accept_length"] > 1.0 and runs[1]["accept_length"] == 1.0   # A speculates, B decodes plainly
    assert "B/A" in log and "outputs differ" in log
