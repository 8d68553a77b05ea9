"""`spectandem bench serve` against a real served demo pair (`--backend local`), over the gRPC API
and the OpenAI HTTP front: the JSON's fields and counts, outputs equal to the SDK's, warm-ups not
counted, request-rate mode, held-out corpus prompts, failures counted, and one-line errors."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from benchmarks.bench import datasets
from benchmarks.bench.serve import ServeBenchConfig, measured_prompts, run
from spectandem.cli import main
from spectandem.client import Client
from spectandem.config import SamplingParams
from spectandem.v1 import generation_pb2
from router.serve import free_port
from tests.router.conftest import Served

HAVE_MPL = importlib.util.find_spec("matplotlib") is not None
FIELDS = {"label", "date", "api", "endpoint", "model", "dataset", "settings", "max_concurrency", "request_rate",
          "num_prompts", "completed", "failed", "first_error", "duration_s", "total_input_tokens",
          "total_output_tokens", "request_throughput", "output_throughput", "total_token_throughput",
          "mean_tokens_per_chunk", "acceptance_source", "acceptance_length", "server_acceptance_length",
          "server_counters", "requests", "warmups", "warmup_failed", "warmup_first_error",
          *(f"{s}_{m}_ms" for s in ("mean", "p50", "p90", "p99") for m in ("ttft", "tpot", "itl", "e2el")),
          *(f"{s}_acceptance_length" for s in ("mean", "p50", "p90", "p99"))}


@pytest.fixture(scope="module")
def server():
    http = free_port()
    s = Served(["--backend", "local", "--max-len", "512", "--max-running", "8", "--http-port", str(http)]).wait_ready()
    s.base_url = f"http://localhost:{http}"
    yield s
    s.close()


def _cli(*flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "spectandem.cli", "bench", "serve", *flags],
                          capture_output=True, text=True, timeout=120, env=env)


def _finished(server) -> int:
    return server.stub.GetServerStats(generation_pb2.GetServerStatsRequest()).requests_finished


def _sdk_tokens(server, prompt: str, **params) -> list[int]:
    with Client(server.address, timeout=60) as client:
        return client.generate(prompt, SamplingParams(temperature=0.0, **params)).token_ids


def test_grpc_run_writes_every_field_and_the_sdks_tokens(server, tmp_path):
    out, png = tmp_path / "run.json", tmp_path / "run.png"
    before = _finished(server)
    r = _cli("--address", server.address, "--num-prompts", "5", "--max-tokens", "8", "--ignore-eos",
             "--num-warmups", "2", "--max-concurrency", "2", "--save-outputs", "--label", "grpc run",
             "--result-file", str(out), "--plot", str(png))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert FIELDS <= set(res), FIELDS - set(res)
    assert "Serving Benchmark Result" in r.stdout and "bench 5/5 requests" in r.stderr
    assert (res["label"], res["api"], res["max_concurrency"]) == ("grpc run", "grpc", 2)
    assert (res["num_prompts"], res["completed"], res["failed"], res["first_error"]) == (5, 5, 0, None)
    assert res["total_output_tokens"] == 5 * 8 and [q["output_tokens"] for q in res["requests"]] == [8] * 5
    assert res["total_input_tokens"] == sum(q["prompt_tokens"] for q in res["requests"]) > 0
    # warm-ups were sent (7 requests finished on the server) but only the 5 measured ones count
    assert _finished(server) - before == 7 and res["server_counters"]["requests_finished"] == 5
    modes = res["server_counters"]["mode_rounds"]   # the measured rounds, by pipeline mode
    assert modes and sum(modes.values()) == res["server_counters"]["rounds"], modes
    assert (res["warmups"], res["warmup_failed"]) == (2, 0)
    assert res["acceptance_source"] == "grpc-stream-stats" and res["acceptance_length"] >= 1
    assert res["server_acceptance_length"] == res["acceptance_length"]   # no other client meanwhile
    for q in res["requests"]:
        assert q["ttft_ms"] <= q["e2el_ms"] and len(q["itl_ms"]) == q["chunks"] - 1
        assert q["output_token_ids"] == _sdk_tokens(server, q["prompt"], max_tokens=8, ignore_eos=True)
    # what an engine-loop reference of the same run replays (benchmarks/serve_matrix.py)
    assert [q["prompt"] for q in res["requests"]] == measured_prompts(datasets.DEFAULT_DATASET, 5)
    if HAVE_MPL:
        assert png.stat().st_size > 0
    else:
        assert "plot skipped: matplotlib is not installed" in r.stdout and not png.exists()


def test_openai_run_returns_the_sdks_tokens(server, tmp_path):
    out = tmp_path / "run.json"
    r = _cli("--api", "openai", "--base-url", server.base_url, "--address", server.address, "--num-prompts", "4",
             "--max-tokens", "12", "--max-concurrency", "4", "--num-warmups", "-1", "--save-outputs", "--no-progress",
             "--result-file", str(out))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert FIELDS <= set(res)
    assert (res["api"], res["completed"], res["failed"], res["warmups"]) == ("openai", 4, 0, 4)  # -1: each prompt once
    assert res["acceptance_source"].startswith("server-stats-delta") and res["acceptance_length"] >= 1
    assert all(q["prompt_tokens"] > 0 for q in res["requests"])
    for q in res["requests"]:
        assert q["output_token_ids"] == _sdk_tokens(server, q["prompt"], max_tokens=12)
    assert res["total_output_tokens"] == sum(len(q["output_token_ids"]) for q in res["requests"])


def _corpus(path: Path, n: int = 40) -> Path:
    """n documents named f000..f039, each naming itself on every line: the last 5% (f038, f039)
    are held out."""
    docs = [f"# file: f{i:03d}\n" + "".join(f"def doc_{i:03d}_line_{k}(x): return x + {k}\n" for k in range(30))
            for i in range(n)]
    path.write_text("\n<|endoftext|>\n".join(docs) + "\n")
    return path


def test_request_rate_run_on_a_corpus_uses_only_held_out_documents(server, tmp_path):
    corpus = _corpus(tmp_path / "corpus.txt")
    res = run(ServeBenchConfig(api="openai", base_url=server.base_url, dataset=str(corpus), num_prompts=4,
                               max_tokens=8, request_rate=20.0, save_outputs=True, progress=False))
    assert (res["completed"], res["failed"], res["max_concurrency"], res["request_rate"]) == (4, 0, None, 20.0)
    # no --address with the HTTP API: the acceptance length is unknown, and says so
    assert res["acceptance_source"] is None and res["acceptance_length"] is None
    for q in res["requests"]:
        assert q["source"].split("@")[0] in ("f038", "f039")
        names = set(re.findall(r"doc_(\d{3})_", q["prompt"]))
        assert names and names <= {"038", "039"}


def test_corpus_prompts_are_deterministic_held_out_slices(tmp_path):
    from drafter.data import split_documents

    corpus = _corpus(tmp_path / "corpus.txt")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert datasets.main(["--corpus", str(corpus), "--out", str(a), "--count", "20"]) == 0
    assert datasets.main(["--corpus", str(corpus), "--out", str(b), "--count", "20"]) == 0
    assert a.read_bytes() == b.read_bytes()
    held = dict(split_documents(corpus)[1])
    prompts = datasets.load_prompts(a)
    assert len(prompts) == 20
    for p in prompts:
        name, span = p.source.split("@")
        start, end = map(int, span.split(":"))
        assert held[name][start:end] == p.text


def test_shipped_prompts_file():
    path = datasets.DEFAULT_DATASET
    assert path.stat().st_size < 300_000
    prompts = datasets.load_prompts(path)
    assert len(prompts) == datasets.GENERATED_PROMPTS and all(p.text for p in prompts)


def test_failed_requests_are_counted_and_reported(server, tmp_path, capsys):
    """max_tokens past the served context: every request is refused; the run counts them, prints
    the first error and exits 1."""
    out = tmp_path / "run.json"
    rc = main(["bench", "serve", "--address", server.address, "--num-prompts", "2", "--max-tokens", "600",
               "--num-warmups", "1", "--no-progress", "--result-file", str(out)])
    err = capsys.readouterr().err
    res = json.loads(out.read_text())
    assert rc == 1 and (res["completed"], res["failed"], res["warmups"], res["warmup_failed"]) == (0, 2, 1, 1)
    assert "max_tokens" in res["first_error"] and "max_tokens" in res["warmup_first_error"]
    assert "1 of 1 warm-up requests failed" in err and "2 of 2 requests failed" in err and "max_tokens" in err


def test_unreachable_server_is_one_line_and_exit_1():
    r = _cli("--address", f"localhost:{free_port()}", "--ready-timeout", "1", "--no-progress")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("spectandem: error: cannot reach the gRPC server") and r.stderr.count("\n") == 1


@pytest.mark.parametrize("flags, says", [
    (["--api", "openai", "--base-url", "localhost:8000"], "--base-url: expected http(s)://HOST:PORT"),
    (["--api", "openai", "--base-url", "http://localhost:{port}", "--ready-timeout", "1"],
     "cannot reach the HTTP server at http://localhost:"),
    (["--dataset", "{tmp}/missing.jsonl"], "--dataset: "),
    (["--dataset", "{tmp}/bad.jsonl"], 'bad.jsonl:2: expected {"prompt"'),
])
def test_bad_inputs_are_one_line_and_exit_1(flags, says, tmp_path, capsys):
    (tmp_path / "bad.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n')
    flags = [f.format(port=free_port(), tmp=tmp_path) for f in flags]
    assert main(["bench", "serve", "--no-progress", *flags]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("spectandem: error: ") and says in captured.err


def test_bench_options_before_serve_are_refused_and_plain_bench_is_unchanged(capsys):
    from benchmarks.bench.command import _bench
    from spectandem.cli import build_parser

    assert main(["bench", "--max-tokens", "4", "serve"]) == 2
    assert "--max-tokens is an option of `spectandem bench`" in capsys.readouterr().err
    args = build_parser().parse_args(["bench", "--sections", "demo", "--max-tokens", "4"])
    assert args.func is _bench and args.bench_command is None and args.max_tokens == 4
