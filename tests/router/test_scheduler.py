"""The scheduler's plan (router/scheduler.py) from ids and counts alone: first come first served
admission by both KV pools and max_running, ids an engine still holds, requests that can never
fit, and preemption of the latest admitted."""

from __future__ import annotations

from router.capacity import KvBudget
from router.requests import RouterConfig
from router.scheduler import Plan, Running, Scheduler, Waiting


def scheduler(max_running=8, **kw) -> Scheduler:
    # lookahead 4, blocks of 4 entries: a request at committed length n needs ceil((n + 3) / 4) blocks
    cfg = RouterConfig(max_len=1024, eos_token_ids=(), lookahead=4, want_features=True, max_running=max_running,
                       kv_block_size=4, draft_kv_block_size=4, **kw)
    return Scheduler(KvBudget(cfg, has_drafter=True), max_running)


def test_unlimited_pools_admit_in_order_up_to_max_running():
    s = scheduler(max_running=3)
    plan = s.plan([Running("a", 10, 1)], [Waiting("b", 5), Waiting("c", 5), Waiting("d", 5)])
    assert plan == Plan(admit=["b", "c"])


def test_admission_stops_at_the_first_request_that_does_not_fit():
    s = scheduler(kv_blocks=10)
    # "a" holds 4 blocks (13 + 3 entries); "b" needs 2 (4 + 1 + 3), "c" needs 6, "d" 1: c waits, and d behind it
    plan = s.plan([Running("a", 13, 1)], [Waiting("b", 4), Waiting("c", 20), Waiting("d", 1)])
    assert plan.admit == ["b"] and not plan.preempt and not plan.fail_waiting


def test_a_resumed_request_needs_its_committed_length():
    s = scheduler(kv_blocks=6)
    assert s.plan([], [Waiting("p", 21, resuming=True)]).admit == ["p"]        # 6 blocks
    assert s.plan([], [Waiting("p", 22, resuming=True)]).fail_waiting           # 7 blocks: never
    assert s.plan([], [Waiting("n", 21)]).fail_waiting                          # its first token: 7


def test_an_id_an_engine_still_holds_waits_and_those_behind_it():
    s = scheduler()
    plan = s.plan([], [Waiting("a", 3), Waiting("x", 3), Waiting("b", 3)], held={"x"})
    assert plan.admit == ["a"]


def test_a_waiting_request_that_can_never_fit_fails_and_the_queue_goes_on():
    s = scheduler(kv_blocks=8, draft_kv_blocks=4)
    plan = s.plan([], [Waiting("big", 100), Waiting("ok", 5), Waiting("draft_big", 14)])
    assert plan.admit == ["ok"]
    assert [rid for rid, _ in plan.fail_waiting] == ["big", "draft_big"]
    assert "--kv-blocks" in plan.fail_waiting[0][1] and "--draft-kv-blocks" in plan.fail_waiting[1][1]


def test_preemption_takes_the_latest_admitted_until_the_round_fits():
    s = scheduler(kv_blocks=10)
    running = [Running("first", 13, 1), Running("third", 13, 3), Running("second", 13, 2)]   # 4 blocks each
    plan = s.plan(running, [Waiting("new", 1)])
    assert plan.preempt == ["third"] and not plan.admit and not plan.fail_running
    plan = s.plan([Running("first", 25, 1), Running("second", 13, 2), Running("third", 13, 3)], [])
    assert plan.preempt == ["third", "second"]   # 7 blocks: "first" alone fits


def test_the_last_running_request_fails_when_it_alone_outgrows_the_pools():
    s = scheduler(kv_blocks=4)
    plan = s.plan([Running("a", 14, 1), Running("b", 3, 2)], [])   # "a" needs 5 blocks of 4
    assert plan.preempt == ["b"] and [rid for rid, _ in plan.fail_running] == ["a"]
    assert "needs 5 KV blocks" in plan.fail_running[0][1] and "--kv-blocks" in plan.fail_running[0][1]
