"""`spectandem bench` runs end to end on the CPU (tiny settings, every section; the llama8b ones at
`--llama8b-scale tiny`) and writes its table, JSON records and plot."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from drafter.controlled import expected_accept_length

COMMON = {"section", "workload", "method", "mode", "batch_size", "acceptance_rate", "tokens_per_s", "ms_per_token",
          "accept_length", "roofline_fraction"}
STEPS = 4            # --controlled-steps: drafts per chain
MAX_TOKENS = 16      # 1 token from the prefill + 3 rounds of STEPS + 1 at full acceptance
HAVE_MPL = importlib.util.find_spec("matplotlib") is not None


def _bench(*flags: str) -> subprocess.CompletedProcess:
    # One thread per process: the CPU machine is shared, and oversubscribed OpenMP spins.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "spectandem.cli", "bench", "--device", "cpu", *flags],
                          capture_output=True, text=True, timeout=600, env=env)


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    run = _bench("--sections", "demo,hf,assisted,temperature,llama8b,controlled,router8b,pipeline",
                 "--modes", "none,eagle3-chain", "--batch-sizes", "1,2", "--max-tokens", str(MAX_TOKENS),
                 "--prompts", "2", "--temperatures", "0,1.0", "--llama8b-scale", "tiny", "--llama8b-steps", "4",
                 "--llama8b-context", "32", "--acceptance-rates", "0,0.8,1", "--controlled-steps", str(STEPS),
                 "--pipeline-modes", "sequential,pingpong,ahead,no-such-mode", "--pipeline-batch-sizes", "2",
                 "--router8b-modes", "pingpong", "--router8b-batch-sizes", "2",
                 "--out", str(out))
    assert run.returncode == 0, run.stderr
    data = json.loads((out / "bench.json").read_text())
    return run, data, out


def _rows(data, **match):
    return [r for r in data["records"] if all(r.get(k) == v for k, v in match.items())]


def test_every_record_has_the_common_fields_and_the_table_is_printed(cpu_run):
    run, data, out = cpu_run
    assert data["gpu"] == "cpu" and data["copy_bandwidth"] > 1e8   # host memory, measured
    assert {r["section"] for r in data["records"]} == {"demo", "hf", "assisted", "temperature", "llama8b",
                                                       "controlled", "router8b", "pipeline"}
    for r in data["records"]:
        assert COMMON <= r.keys(), r
        assert r["tokens_per_s"] > 0 and r["ms_per_token"] > 0 and r["accept_length"] >= 1.0, r
        assert (r["acceptance_rate"] is None) == (r["method"] != "eagle3-controlled"), r
    assert "eagle3-chain" in run.stdout and "hf-assisted" in run.stdout and "transformers-generate" in run.stdout
    assert (out / "bench.txt").read_text().splitlines()[1].split()[:3] == ["section", "workload", "method"]


def test_demo_and_transformers_rows(cpu_run):
    _, data, _ = cpu_run
    demo = {(r["mode"], r["batch_size"]): r for r in _rows(data, section="demo")}
    assert set(demo) == {("none", 1), ("none", 2), ("eagle3-chain", 1), ("eagle3-chain", 2)}
    assert demo[("none", 1)]["accept_length"] == 1.0 and demo[("eagle3-chain", 1)]["accept_length"] > 1.0
    (hf,) = _rows(data, method="transformers-generate")
    (assisted,) = _rows(data, method="hf-assisted")
    assert hf["mode"] == "plain" and hf["batch_size"] == 1 and assisted["batch_size"] == 1
    # Two prompts of MAX_TOKENS tokens; the assisted target ran fewer forwards than tokens.
    assert assisted["target_forwards"] <= 2 * MAX_TOKENS
    assert assisted["accept_length"] == pytest.approx(2 * MAX_TOKENS / assisted["target_forwards"], abs=1e-3)


def test_temperature_table(cpu_run):
    _, data, _ = cpu_run
    rows = {(r["temperature"], r["drafts"]): r for r in _rows(data, section="temperature")}
    assert set(rows) == {(0.0, "sampled"), (0.0, "greedy"), (1.0, "sampled"), (1.0, "greedy")}
    # Greedy requests draft deterministically either way: the same rounds.
    assert rows[(0.0, "sampled")]["accept_length"] == rows[(0.0, "greedy")]["accept_length"] > 1.0


def test_controlled_acceptance_is_the_planned_one_and_output_stays_exact(cpu_run):
    _, data, _ = cpu_run
    plain = _rows(data, section="controlled", mode="engine-plain")
    assert [r["batch_size"] for r in plain] == [1, 2] and all(r["matches_plain"] for r in plain)
    spec = {(r["acceptance_rate"], r["batch_size"]): r for r in _rows(data, section="controlled", method="eagle3-controlled")}
    assert set(spec) == {(a, b) for a in (0.0, 0.8, 1.0) for b in (1, 2)}
    for (a, b), r in spec.items():
        assert r["matches_plain"] and r["diverged_requests"] == 0, r
        assert r["expected_accept_length"] == pytest.approx(expected_accept_length(a, STEPS), abs=1e-3)
        assert r["speedup"] > 0 and r["scale"] == "tiny"
    for b in (1, 2):
        assert spec[(1.0, b)]["accept_length"] == STEPS + 1 and spec[(1.0, b)]["draft_acceptance"] == 1.0
        assert spec[(0.0, b)]["accept_length"] == 1.0 and spec[(0.0, b)]["draft_acceptance"] == 0.0
        assert 1.0 < spec[(0.8, b)]["accept_length"] < STEPS + 1
    assert spec[(1.0, 1)]["ideal_tokens_per_s"] > 0 and spec[(1.0, 1)]["measured_over_ideal"] > 0
    v = data["verify_forward"]
    assert v["chain_nodes"] == STEPS + 1 and v["tree_nodes"] == 16
    assert v["tree16_over_decode"] == pytest.approx(v["tree16_ms"] / v["decode_ms"], rel=0.01)
    (roof,) = _rows(data, section="llama8b")
    # Against host memory's copy bandwidth on a CPU; the tiny model's weights may sit in the caches.
    assert roof["mode"] == "plain" and roof["roofline_fraction"] > 0
    weights_ms = 1000 * roof["weight_bytes"] / data["copy_bandwidth"]
    assert weights_ms < roof["roofline_ms"] < 2 * weights_ms   # the weights, and the small KV cache
    assert roof["roofline_fraction"] == pytest.approx(roof["roofline_ms"] / roof["ms_per_token"], rel=0.02, abs=1e-3)


def test_pipeline_rows_and_rejected_modes(cpu_run):
    run, data, _ = cpu_run
    rows = {r["mode"]: r for r in _rows(data, section="pipeline")}
    assert set(rows) == {"sequential", "pingpong", "ahead"}
    assert data["skipped_pipeline_modes"] == ["no-such-mode"] and "no-such-mode" in run.stdout
    for r in rows.values():
        assert r["batch_size"] == 2 and r["rounds_per_s"] > 0 and r["accept_length"] > 1.0
        assert r["placement"] == "one-device" and r["fallback_rounds"] == 0
    assert rows["ahead"]["draft_ahead_hits"] + rows["ahead"]["draft_ahead_misses"] > 0


def test_router8b_rows(cpu_run):
    _, data, _ = cpu_run
    rows = {(r["mode"], r["acceptance_rate"]): r for r in _rows(data, section="router8b")}
    assert set(rows) == {("plain", None), *(("pingpong", a) for a in (0.0, 0.8, 1.0))}
    for r in rows.values():   # one device here: --router8b-drafter-device auto finds no second GPU
        assert r["batch_size"] == 2 and r["matches_plain"] and r["placement"] == "one-device", r
        assert r["verify_busy_s"] > 0 and r["round_over_verify"] >= 0.99, r
    assert rows[("pingpong", 1.0)]["accept_length"] == STEPS + 1


def test_plot_is_drawn_or_its_skip_explained(cpu_run, tmp_path):
    run, _, out = cpu_run
    if not HAVE_MPL:
        assert "plot skipped" in run.stdout and "--plot-from" in run.stdout
        return
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    again = _bench("--plot-from", str(out / "bench.json"), "--plot", str(tmp_path / "again.png"))
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "again.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_full_size_llama8b_is_refused_on_cpu_before_anything_runs(capsys):
    from spectandem.cli import main

    assert main(["bench", "--device", "cpu", "--sections", "demo,controlled"]) == 2
    err = capsys.readouterr().err
    assert "need a CUDA device" in err and "--llama8b-scale tiny" in err
