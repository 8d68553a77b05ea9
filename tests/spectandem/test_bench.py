"""`spectandem bench` runs end to end on the CPU (tiny settings) and writes its JSON records."""

import json
import subprocess
import sys


def test_bench_demo_on_cpu(tmp_path):
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "spectandem.cli", "bench", "--workloads", "demo", "--device", "cpu",
                          "--modes", "none,eagle3-chain", "--batch-sizes", "1,2", "--max-tokens", "8",
                          "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    data = json.loads(out.read_text())
    modes = {(r["mode"], r["batch_size"]) for r in data["records"]}
    assert {("none", 1), ("none", 2), ("eagle3-chain", 1), ("eagle3-chain", 2), ("plain", 1)} <= modes
    for r in data["records"]:
        assert r["tokens_per_s"] > 0 and r["accept_length"] >= 1.0
        assert {"workload", "method", "mode", "batch_size", "acceptance_rate", "ms_per_token"} <= r.keys()
    assert next(r for r in data["records"] if r["mode"] == "eagle3-chain")["accept_length"] > 1.0
    assert "eagle3-chain" in run.stdout and "hf-generate" in run.stdout
