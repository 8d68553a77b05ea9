"""Work an engine service leaves for after its reply (spectandem/after_reply.py): the jobs run in
order once flushed, a failing one is logged and the rest go on, and `settle` waits for them;
`run_now` runs the queued ones in the caller's thread once the started ones are done. Behind
a real gRPC verifier service (the demo target, fp32 on the CPU, decoding ahead), each verify's
reply reaches the router while the decode ahead it asked for waits to be queued, no engine call
starts before that is done, and the output equals plain decoding's."""

from __future__ import annotations

import threading
import time

from spectandem.after_reply import AfterReply
from spectandem.call_clock import CallClock


def test_jobs_run_in_order_after_flush_and_settle_waits():
    after = AfterReply(clock=CallClock())
    done: list[str] = []
    gate = threading.Event()
    after.later(lambda: (gate.wait(5), done.append("a")))
    after.later(lambda: done.append("b"))
    time.sleep(0.05)
    assert done == []                      # nothing runs before the flush
    after.flush()
    after.later(lambda: done.append("c"))  # queued for the next flush
    time.sleep(0.05)
    assert done == []                      # "a" waits on the gate
    gate.set()
    after.settle()
    assert done == ["a", "b"]
    after.flush()
    after.settle()
    assert done == ["a", "b", "c"]
    assert after.clock.stats()["count"]["after_reply"] == 2
    after.close()


def test_run_now_runs_the_queued_jobs_in_this_thread_after_the_started_ones():
    """A verify that hands its verdicts to the drafter sends them before its reply
    (verifier/service_core.py verdicts_to_drafter): the jobs queued so far run at once, in the
    caller's thread, after those a flush started; later jobs wait for the next flush. On a
    one-thread executor shared with the caller (a CPU engine thread) this does not deadlock."""
    from concurrent.futures import ThreadPoolExecutor

    after = AfterReply()
    done: list[tuple[str, str]] = []
    gate = threading.Event()
    after.later(lambda: (gate.wait(5), done.append(("a", threading.current_thread().name))))
    after.flush()
    after.later(lambda: done.append(("b", threading.current_thread().name)))
    threading.Timer(0.1, gate.set).start()
    after.run_now()                        # waits for "a", then runs "b" here
    me = threading.current_thread().name
    assert [j for j, _ in done] == ["a", "b"] and done[1][1] == me and done[0][1] != me
    after.later(lambda: done.append(("c", threading.current_thread().name)))
    time.sleep(0.05)
    assert len(done) == 2                  # "c" waits for the next flush
    after.flush()
    after.settle()
    assert [j for j, _ in done] == ["a", "b", "c"]
    after.close()

    engine = ThreadPoolExecutor(max_workers=1)
    shared = AfterReply(executor=engine)
    ran: list[int] = []

    def call():                            # a call on the engine thread queuing work and running it now
        shared.later(lambda: ran.append(1))
        shared.run_now()
        return ran[:]
    assert engine.submit(call).result(timeout=5) == [1]
    shared.close()
    engine.shutdown()


def test_a_failing_job_is_logged_and_the_others_run(caplog):
    after = AfterReply()
    done: list[int] = []

    def boom():
        raise RuntimeError("boom")

    for job in (lambda: done.append(1), boom, lambda: done.append(2)):
        after.later(job)
    after.flush()
    after.settle()                          # does not raise
    assert done == [1, 2] and after.failed == 1
    assert any("boom" in r.getMessage() or (r.exc_info and "boom" in str(r.exc_info[1])) for r in caplog.records)
    after.close()


def test_grpc_verifier_replies_before_its_decode_ahead_is_queued():
    from router.local import LocalSpeculator
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths
    from tests.router.test_decode_ahead_router import MAX_LEN, _ahead_engine, _check, _workload, served_over_grpc

    plain = LocalSpeculator(*demo_paths("none"), SpecConfig(method="none"), max_slots=8, max_len=MAX_LEN)
    prompts, params, want, stopped = _workload(plain)
    engine = _ahead_engine(plain)
    intervals: list[tuple[float, float]] = []
    starts: list[float] = []
    replies: list[float] = []
    replied = threading.Condition()
    missed: list[int] = []   # after_calls whose call's reply had not reached the router while they ran

    queue_ahead = engine.after_call

    def after_call_once_replied():
        # Call k's after_call holds until the router has k replies: it can only get them where
        # the reply left before its after_call ran (a wait of 5 s otherwise, then recorded).
        t0 = time.monotonic()
        k = len(intervals) + 1
        with replied:
            if not missed and not replied.wait_for(lambda: len(replies) >= k, timeout=5):
                missed.append(k)
        queue_ahead()
        intervals.append((t0, time.monotonic()))

    engine.after_call = after_call_once_replied
    for name in ("verify", "verify_with_prefill", "decode_with_prefill", "prefill", "release"):
        method = getattr(engine, name)

        def stamped(*args, _method=method, **kwargs):
            starts.append(time.monotonic())
            return _method(*args, **kwargs)

        setattr(engine, name, stamped)

    def stamp_replies(link):
        call = link.verify_prefill

        async def timed_call(*args, **kwargs):
            out = await call(*args, **kwargs)
            with replied:
                replies.append(time.monotonic())
                replied.notify_all()
            return out

        link.verify_prefill = timed_call

    got = served_over_grpc(engine, plain, prompts, params, stamp_replies)
    _check(got, want, stopped, plain, engine)
    # One after_call per verify call, in order: each reply came back while its after_call ran.
    assert len(intervals) == len(replies) > 5
    assert not missed, f"after_call {missed[0]} ran before its call's reply reached the router"
    # No engine call started while an after_call ran.
    assert not [t for t in starts for t0, t1 in intervals if t0 < t < t1]
