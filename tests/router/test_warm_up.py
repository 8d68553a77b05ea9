"""serve --warm-up: requests at each batch size before the port opens; what they did is forgotten."""

from spectandem.v1 import generation_pb2
from tests.router.conftest import Served, request


def test_warm_up_runs_each_batch_size_before_serving_and_leaves_clean_counters():
    server = Served(["--backend", "local", "--warm-up", "--max-running", "2", "--max-len", "512"]).wait_ready(300)
    try:
        router = server.state["router"]
        assert router.num_active == 0
        stats = server.stub.GetServerStats(generation_pb2.GetServerStatsRequest())
        assert stats.requests_finished == 0 and stats.rounds == 0
        # of what "auto" measured, only what does not depend on the text: plain's rate, each mode's speed
        assert set(router._modes.rates_for(1)) <= {"plain"} and set(router._modes.rates_for(2)) <= {"plain"}
        assert any(state.speeds for state in router._modes._states.values())
        assert not router._switch.off(0) and router._switch._recent == []
        # the warm-up's requests went through both engines and were released there
        assert server.slots_in_use() == (0, 0)
        chunks = list(server.stub.Generate(request(text="def f(x):\n", max_tokens=8, ignore_eos=True), timeout=120))
        assert sum(len(c.token_ids) for c in chunks) == 8
        assert server.stub.GetServerStats(generation_pb2.GetServerStatsRequest()).requests_finished == 1
    finally:
        server.close()


def test_a_warm_up_stage_that_stalls_writes_every_threads_stack_once():
    """StallDump: a stage that has not ended after its time has the threads' stacks written to
    stderr; a stage that ends in time (the next one announced, or close) writes none."""
    import subprocess
    import sys

    code = """
import time
from router.serve import StallDump
said = []
stage = StallDump(said.append, 0.5)
stage("stage 1"); time.sleep(1.2)                # stalls: one dump
stage("stage 2"); time.sleep(0.2)                # ends in time
stage("stage 3"); time.sleep(0.2); stage.close()
time.sleep(0.8)                                  # disarmed: none
print(said)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['stage 1', 'stage 2', 'stage 3']"
    assert out.stderr.count("Timeout (") == 1 and "most recent call first" in out.stderr
