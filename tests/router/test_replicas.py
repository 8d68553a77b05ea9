"""Several drafter/verifier pairs behind one server (`spectandem serve --replicas N`): the routing
rule on fakes, then the local backend with two replicas over real gRPC (requests spread over both
pairs, tokens identical to the single-router reference)."""

from __future__ import annotations

import threading
import time

import pytest

from router.links import EngineUnavailable
from router.replicas import ReplicaSet
from router.loop import RouterCounters
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.conftest import RAY_CLUSTERS, Served, collect, request


class FakeRouter:
    """The Router surface ReplicaSet uses; `submit` returns a token object."""

    def __init__(self, name: str):
        self.name, self.serving, self.active = name, True, []
        self.cancelled, self.listeners, self.on_serving_change = [], [], None
        self.running, self.waiting = [], []
        self.counters = RouterCounters()

    @property
    def num_active(self) -> int:
        return len(self.active)

    def submit(self, prompt_ids, params, request_id=None):
        req = object()
        self.active.append(req)
        return req

    def cancel(self, req):
        self.cancelled.append(req)

    def finish(self, req):
        self.active.remove(req)
        for fn in self.listeners:
            fn("finished", req, "stop")


def test_least_active_serving_replica_with_round_robin_ties():
    a, b, c = FakeRouter("a"), FakeRouter("b"), FakeRouter("c")
    rs = ReplicaSet([a, b, c])
    params = SamplingParams(max_tokens=4)
    # Idle: ties go round-robin, so requests spread over every pair.
    reqs = [rs.submit([1], params) for _ in range(3)]
    assert [len(r.active) for r in (a, b, c)] == [1, 1, 1]
    a.finish(a.active[0])
    assert rs.submit([1], params) in a.active                # a has the fewest active
    b.serving = False
    for _ in range(4):
        rs.submit([1], params)
    assert len(b.active) == 1                                # a replica that is down gets nothing
    a.serving = c.serving = False
    with pytest.raises(EngineUnavailable):
        rs.submit([1], params)
    # cancel reaches the replica that owns the request, and only while it is live
    rs.cancel(reqs[2])
    assert c.cancelled == [reqs[2]] and not a.cancelled and not b.cancelled
    c.finish(reqs[2])
    rs.cancel(reqs[2])
    assert c.cancelled == [reqs[2]]


def test_counters_summed_listeners_shared_serving_aggregated():
    a, b = FakeRouter("a"), FakeRouter("b")
    a.counters.rounds, a.counters.accepted_per_pos = 3, [5, 2]
    b.counters.rounds, b.counters.accepted_per_pos = 4, [1, 1, 1]
    a.counters.mode_rounds, b.counters.mode_rounds = {"sequential": 3}, {"sequential": 1, "plain": 3}
    rs = ReplicaSet([a, b])
    assert rs.counters.rounds == 7 and rs.counters.accepted_per_pos == [6, 3, 1]
    assert rs.counters.mode_rounds == {"sequential": 4, "plain": 3}
    assert a.counters.rounds == 3                            # the replicas' own counters untouched
    heard = []
    rs.listeners.append(lambda event, req, data: heard.append(event))
    a.finish(rs.submit([1], SamplingParams(max_tokens=1)))
    assert heard == ["finished"] and a.listeners is b.listeners is rs.listeners
    changes = []
    rs.on_serving_change = changes.append
    a.serving = False
    a.on_serving_change(False)                               # b still serves: no change overall
    b.serving = False
    b.on_serving_change(False)
    a.serving = True
    a.on_serving_change(True)
    assert changes == [False, True] and rs.serving


@pytest.mark.parametrize("argv,message", [
    (["--replicas", "0"], "--replicas must be >= 1"),
    (["--backend", "grpc", "--verifier-address", "v0:1", "--verifier-address", "v1:1", "--replicas", "3"],
     "--verifier-address is given 2 times for 3 replicas"),
    (["--backend", "grpc", "--verifier-address", "v0:1", "--verifier-address", "v1:1", "--drafter-address", "d0:1"],
     "--drafter-address is given 1 times for 2 replicas"),
])
def test_replica_flags_are_checked(argv, message):
    from router.serve import _num_replicas
    from spectandem.cli import build_parser

    with pytest.raises(ValueError, match=message):
        _num_replicas(build_parser().parse_args(["serve", *argv]))


def test_one_replica_per_address_pair():
    from router.serve import _num_replicas
    from spectandem.cli import build_parser

    args = build_parser().parse_args(["serve", "--backend", "grpc", "--verifier-address", "v0:1", "--drafter-address",
                                      "d0:1", "--verifier-address", "v1:1", "--drafter-address", "d1:1"])
    assert _num_replicas(args) == 2 and args.verifier_address == ["v0:1", "v1:1"]


def test_local_backend_two_replicas_spread_and_exact():
    t, d = demo_paths("eagle3")
    reference = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=8, max_len=256)
    prompts = [reference.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(8)]
    params = [SamplingParams(max_tokens=16) if i % 2 == 0 else SamplingParams(max_tokens=16, temperature=0.9, seed=i)
              for i in range(8)]
    expected = reference.generate(prompts, params)
    server = Served(["--backend", "local", "--replicas", "2", "--max-len", "256", "--max-running", "8"]).wait_ready()
    try:
        results: dict[int, list[int]] = {}

        def worker(i):
            p = params[i]
            extra = {} if p.temperature == 0 else {"temperature": p.temperature, "seed": p.seed}
            results[i] = collect(server.stub, request(ids=prompts[i], max_tokens=16, **extra))[0]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert {i: results.get(i) for i in range(8)} == {i: expected[i].token_ids for i in range(8)}

        rs = server.state["router"]
        assert isinstance(rs, ReplicaSet) and len(rs.replicas) == 2
        finished = [r.counters.requests_finished for r in rs.replicas]
        assert all(n > 0 for n in finished) and sum(finished) == 8, finished
        assert rs.counters.requests_finished == 8 and rs.num_active == 0

        async def slots():
            return [((await v.info()).used_slots, (await d.info()).used_slots) for v, d in server.state["pairs"]]
        deadline = time.monotonic() + 20   # a finished request is released by its replica's next loop pass
        while server.run(slots()) != [(0, 0), (0, 0)] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert server.run(slots()) == [(0, 0), (0, 0)]        # both pairs released everything
    finally:
        server.close()


@RAY_CLUSTERS
def test_ray_backend_two_replicas_each_pair_in_its_own_placement_group():
    from ray.util import placement_group_table

    t, d = demo_paths("eagle3")
    reference = LocalSpeculator(t, d, SpecConfig(method="eagle3"), max_slots=4, max_len=256)
    prompts = [reference.tokenizer.encode(PROMPT_TEXTS[i]).ids for i in range(4)]
    expected = reference.generate(prompts, [SamplingParams(max_tokens=12)] * 4)
    server = Served(["--backend", "ray", "--replicas", "2", "--max-len", "256", "--max-running", "4"]).wait_ready(300)
    try:
        groups = [g for g in placement_group_table().values() if g["state"] == "CREATED"]
        assert len(groups) == 2                                # one per pair
        for g in groups:                                       # verifier + drafter bundles, on one node
            assert len(g["bundles"]) == 2 and len(set(g["bundles_to_node_id"].values())) == 1
        results: dict[int, list[int]] = {}

        def worker(i):
            results[i] = collect(server.stub, request(ids=prompts[i], max_tokens=12))[0]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert {i: results.get(i) for i in range(4)} == {i: expected[i].token_ids for i in range(4)}
        assert all(r.counters.requests_finished > 0 for r in server.state["router"].replicas)
    finally:
        server.close()
