"""benchmarks/serve_matrix.py's --append and --plain-outputs (one matrix measured over several
invocations), its `exact` against the plain outputs, a server that does not come up, and the
engine loop reference's prompts at batch 1."""

from __future__ import annotations

import socket

import pytest

from benchmarks.serve_matrix import Server, _load_plain, _save_plain, appended, check_machine, matches_plain


def _rec(backend, method, rate, conc, tps):
    return {"backend": backend, "method": method, "acceptance_rate": rate, "concurrency": conc,
            "output_tokens_per_s": tps}


def test_append_replaces_the_same_cell_and_keeps_the_rest():
    first = {"gpu": "H100", "command": "serve_matrix.py --backends local", "failures": [{"backend": "ray"}],
             "records": [_rec("local", "none", None, 1, 100.0), _rec("local", "eagle3", 0.8, 1, 200.0)],
             "engine_reference": [{"method": "none", "acceptance_rate": None, "batch_size": 1, "tokens_per_s": 110.0}]}
    second = {"gpu": "H100", "command": "serve_matrix.py --backends local,grpc --append", "failures": [],
              "records": [_rec("local", "eagle3", 0.8, 1, 210.0), _rec("grpc", "eagle3", 0.8, 1, 150.0)],
              "engine_reference": []}
    merged = appended(first, second)
    assert [(r["backend"], r["method"], r["output_tokens_per_s"]) for r in merged["records"]] == [
        ("local", "none", 100.0), ("local", "eagle3", 210.0), ("grpc", "eagle3", 150.0)]
    assert merged["engine_reference"] == first["engine_reference"]   # none measured this time: kept
    assert merged["command"].splitlines() == [first["command"], second["command"]]
    assert merged["failures"] == [{"backend": "ray"}]
    # A server that failed before and ran again this time: its old failure goes.
    failed = dict(first, failures=[{"backend": "grpc", "method": "eagle3", "acceptance_rate": 0.8,
                                    "concurrency": 1, "error": "x"}, {"backend": "ray"}])
    assert appended(failed, second)["failures"] == [{"backend": "ray"}]
    fresh_reference = [{"method": "none", "acceptance_rate": None, "batch_size": 1, "tokens_per_s": 120.0}]
    assert appended(first, dict(second, engine_reference=fresh_reference))["engine_reference"] == fresh_reference


def test_append_refuses_another_machine():
    with pytest.raises(ValueError, match="H200"):
        appended({"gpu": "H200", "records": []},
                 {"gpu": "H100", "command": "x", "records": [], "failures": [], "engine_reference": []})
    with pytest.raises(ValueError, match="this machine is 'H100'"):   # what main checks before measuring
        check_machine({"gpu": "H200"}, "H100")
    check_machine({"gpu": "H200"}, "H200")
    check_machine({"gpu": "H200"}, None)   # a partial write: the machine not named yet


def test_plain_outputs_round_trip(tmp_path):
    path = tmp_path / "plain.json"
    assert _load_plain(str(path)) == {} and _load_plain(None) == {}
    stored = {"local": {0: [5, 6, 7], 12: [1]}, "grpc": {3: [9]}}
    _save_plain(str(path), stored)
    assert _load_plain(str(path)) == stored


def test_exact_is_unknown_where_the_plain_outputs_lack_a_prompt():
    plain = {0: [5, 6, 7], 1: [8, 9]}
    assert matches_plain({0: [5, 6, 7], 1: [8, 9]}, plain) is True
    assert matches_plain({0: [5, 6, 7], 1: [8, 10]}, plain) is False
    assert matches_plain({0: [5, 6, 7], 2: [1]}, plain) is None   # prompt 2 has no plain output
    assert matches_plain({}, plain) is None


def test_a_server_that_does_not_come_up_leaves_its_stacks_in_its_log(tmp_path):
    """serve pointed at engine services that accept connections and never answer does not come
    up: it is stopped at the start timeout, and its log holds every thread's stack from then."""
    log = tmp_path / "serve.log"
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        with pytest.raises(RuntimeError, match="did not come up"):
            Server(["--backend", "grpc", "--verifier-address", address, "--drafter-address", address,
                    "--http-port", "0", "--metrics-port", "0"], log, timeout=10)
    text = log.read_text()
    assert f"waiting for the verifier at {address} and the drafter at {address}" in text
    assert "most recent call first" in text   # faulthandler's dump of the threads


def test_the_engine_loop_at_batch_1_runs_as_many_prompts_as_the_served_run(monkeypatch):
    """The engine reference at batch 1 runs `num_prompts` prompts in turn (the served run's count
    at concurrency 1), not only as many as the largest batch: one prompt's accept length is one
    draw. Larger batches run one batch of their size. The tiny 8B-shaped pair on the CPU."""
    import dataclasses

    import torch

    from benchmarks.bench import llama8b
    from benchmarks.serve_matrix import engine_reference_llama8b

    spec = dataclasses.replace(llama8b.llama8b_spec("tiny"), vocab_size=4096, eos_token_ids=(0,))
    target = llama8b.random_target(spec, "cpu", torch.float32, 0)
    head = llama8b.random_eagle3_head(target, 2048, "cpu", torch.float32, 0)
    runs, run = [], llama8b.ControlledRuns.run

    def counted(self, batch_size, rate, tag):
        out = run(self, batch_size, rate, tag)
        runs.append((batch_size, rate, len(out["completions"])))
        return out

    monkeypatch.setattr(llama8b.ControlledRuns, "run", counted)
    reference = engine_reference_llama8b(target, head, "cpu", [0.8], [1, 2], 6, 0, None, num_prompts=3)
    assert set(runs) == {(1, None, 3), (1, 0.8, 3), (2, None, 2), (2, 0.8, 2)}
    assert [(r["method"], r["batch_size"]) for r in reference] == [("none", 1), ("none", 2), ("eagle3", 1), ("eagle3", 2)]
    assert all(r["exact"] for r in reference)
    runs.clear()
    engine_reference_llama8b(target, head, "cpu", [], [1, 2], 6, 0)   # no count given: the largest batch's
    assert set(runs) == {(1, None, 2), (2, None, 2)}
