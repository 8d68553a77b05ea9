"""/metrics and JSON request logs of a served router (local backend): the counters move with
requests and equal the router's own, latencies are observed, gauges follow the running batch."""

from __future__ import annotations

import io
import json
import logging
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.request_log import REQUEST_LOGGER, JsonFormatter
from tests.e2e.conftest import PROMPT_TEXTS
from router.serve import free_port
from tests.router.conftest import Served, collect, request

P = "spectandem:"


@pytest.fixture(scope="module")
def server():
    s = Served(["--backend", "local", "--max-len", "512", "--max-running", "8",
                "--metrics-port", str(free_port()), "--log-format", "json"]).wait_ready()
    yield s
    s.close()


def scrape(server) -> dict:
    """{(sample name, ((label, value), ...)): value}"""
    text = urllib.request.urlopen(f"http://localhost:{server.state['metrics_port']}/metrics", timeout=10).read()
    out = {}
    for family in text_string_to_metric_families(text.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(m: dict, name: str, **labels) -> float:
    return m[(P + name, tuple(sorted(labels.items())))]


def wait_idle(server, timeout=10.0):
    deadline = time.monotonic() + timeout
    while server.state["router"].num_active and time.monotonic() < deadline:
        time.sleep(0.02)


def test_counters_move_and_equal_the_routers(server):
    wait_idle(server)
    before = scrape(server)
    tokens = 0
    for text in PROMPT_TEXTS[:3]:
        toks, _, reason, _ = collect(server.stub, request(text=text, max_tokens=24, ignore_eos=True))
        assert reason == "length"
        tokens += len(toks)
    wait_idle(server)
    after = scrape(server)
    delta = lambda name, **kw: value(after, name, **kw) - value(before, name, **kw)  # noqa: E731

    assert delta("num_requests_finished_total") == 3
    assert delta("num_requests_admitted_total") == 3
    assert delta("generation_tokens_total") == tokens
    assert delta("spec_decode_num_drafts_total") > 0
    drafted, accepted = delta("spec_decode_num_draft_tokens_total"), delta("spec_decode_num_accepted_tokens_total")
    assert 0 < accepted <= drafted
    # Positions 0..num_steps-1 are always there; each accepted token is counted at its depth.
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths

    depth = SpecConfig(method="eagle3").for_draft(demo_paths("eagle3")[1]).num_steps   # the server's (the demo head's)
    per_pos = [delta("spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(depth)]
    assert sum(per_pos) == accepted and per_pos == sorted(per_pos, reverse=True)
    for name in ("time_to_first_token_seconds", "time_per_output_token_seconds", "e2e_request_latency_seconds"):
        assert delta(name + "_count") == 3, name
        assert delta(name + "_sum") > 0, name
    assert value(after, "num_requests_running") == 0 and value(after, "num_requests_waiting") == 0

    # Read at scrape time: the exposition is the router's own counters, not a copy that drifts.
    c = server.state["router"].counters
    assert value(after, "spec_decode_num_drafts_total") == c.num_drafts
    assert value(after, "spec_decode_num_accepted_tokens_total") == c.accepted_tokens
    assert value(after, "num_rounds_total") == c.rounds
    # Rounds by the pipeline mode that ran them: they add up to the rounds.
    assert c.mode_rounds and sum(c.mode_rounds.values()) == c.rounds
    assert {m: value(after, "num_rounds_by_mode_total", mode=m) for m in c.mode_rounds} == c.mode_rounds
    assert value(after, "num_fallback_rounds_total") == c.fallback_rounds
    for name in ("num_preemptions_total", "num_stale_replies_dropped_total", "num_requests_failed_total"):
        assert (P + name, ()) in after


def test_gauges_follow_a_running_request_and_cancel_counts(server):
    wait_idle(server)
    # The engines release a request's KV after the router has ended it: a busy machine scraped
    # between the two (once, in a full run on 2 cores). Idle means released too.
    deadline = time.monotonic() + 10
    before = scrape(server)
    while value(before, "kv_cache_usage_perc", side="verifier") != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
        before = scrape(server)
    assert value(before, "kv_cache_usage_perc", side="verifier") == 0
    call = server.stub.Generate(request(text=PROMPT_TEXTS[1], max_tokens=400, ignore_eos=True))
    for _ in range(3):  # past the first chunk (sent before the drafter's prefill): both sides hold it
        assert next(call).token_ids
    during = scrape(server)
    call.cancel()
    assert value(during, "num_requests_running") == 1
    assert value(during, "kv_cache_usage_perc", side="verifier") > 0
    assert value(during, "kv_cache_usage_perc", side="drafter") > 0
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = scrape(server)
        if value(after, "num_requests_cancelled_total") > value(before, "num_requests_cancelled_total"):
            break
        time.sleep(0.05)
    assert value(after, "num_requests_cancelled_total") == value(before, "num_requests_cancelled_total") + 1
    wait_idle(server)
    assert value(scrape(server), "num_requests_running") == 0


def test_json_request_log_lines(server):
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger(REQUEST_LOGGER)
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)  # the entry point does this for --log-format json
    try:
        toks, _, reason, stats = collect(server.stub, generation_request("log-me-1"))
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    mine = [line for line in lines if line["request_id"] == "log-me-1"]
    assert [line["event"] for line in mine] == ["admitted", "first_token", "finished"]
    admitted, first, finished = mine
    assert admitted["prompt_tokens"] > 0 and admitted["max_tokens"] == 12
    assert 0 <= first["ttft_s"] <= finished["e2e_s"]
    assert finished["finish_reason"] == reason == "length"
    assert finished["completion_tokens"] == len(toks) == 12
    assert finished["num_rounds"] == stats.num_rounds and finished["accepted_tokens"] == stats.accepted_tokens
    assert all(line["logger"] == REQUEST_LOGGER and line["level"] == "INFO" and "time" in line for line in mine)


def generation_request(request_id: str):
    r = request(text=PROMPT_TEXTS[2], max_tokens=12, ignore_eos=True)
    r.request_id = request_id
    return r
