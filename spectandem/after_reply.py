"""Work an engine process does once a call's reply is on its way (the verifier's gRPC service and
Ray actor): what the caller does not wait for, but the engine's next call must find done.

A verify's reply needs its results, not the device work that follows them: the copy of its
features into the feature channel (they then travel to the drafter, which reads them a round
later) and the decode ahead that a plain decode asks for (VerifierEngine.after_call, which
prepares and queues the next decode on the device). Done before the reply, the router waits for
them; done after it, they overlap the reply's way back, the router's handling of it and the next
request's way in, which run in other processes.

    after = AfterReply()
    def handle(request):
        with after.call():                      # the last call's work is done first
            reply = compute(request)
            after.later(engine.after_call)      # queued in call order
            return reply                        # on the way out the jobs start on the worker

The jobs run on one worker thread, one call's after another, in the order queued. An engine
call waits (`settle`) for those of the call before it: they may read device buffers the next
forward overwrites (CUDA graph outputs) and use the engine, which is not thread-safe. On CUDA
the worker queues its device work on the same stream as the calls (each thread's default
stream, on the engine's device), so the device runs it in the order it was queued."""

from __future__ import annotations

import logging
import threading
import time
from contextlib import contextmanager
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

import torch

from spectandem.call_clock import CallClock

log = logging.getLogger("spectandem.after_reply")


class AfterReply:
    """`executor`: a one-worker executor to run the jobs on (an engine process's CPU engine
    thread, spectandem/devices.py engine_process_thread, so that torch ops keep its OpenMP team);
    None: a worker of its own, with `device` current where it is a CUDA device. `clock`: each
    call's jobs are timed there as "after_reply"."""

    def __init__(self, executor: ThreadPoolExecutor | None = None, device: str | torch.device | None = None,
                 clock: CallClock | None = None):
        self._own = executor is None
        if executor is None:
            dev = torch.device(device) if device is not None else None
            # "cuda" without an index is device 0 in every thread that did not pick another.
            init = (lambda: torch.cuda.set_device(dev.index)) if dev is not None and dev.type == "cuda" \
                and dev.index is not None else None
            executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="after-reply", initializer=init)
            # Its worker started now rather than at the first job: a thread takes the cores of the
            # one that starts it, and the thread that runs a verifier's calls may be on the
            # drafter's then (spectandem.devices.SmallForwards).
            executor.submit(int).result()
        self._executor, self.clock = executor, clock
        self._jobs: list[Callable[[], None]] = []
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.failed = 0   # jobs that raised (logged; the next call goes on)

    @contextmanager
    def call(self):
        """Around an engine call: the work of the calls before it done first (`settle`), the jobs
        it queued started once it ends (`flush`), whether it returned or raised."""
        self.settle()
        try:
            yield
        finally:
            self.flush()

    def later(self, job: Callable[[], None]) -> None:
        """Queues `job` to run after this call's reply (`flush`)."""
        with self._lock:
            self._jobs.append(job)

    def flush(self) -> None:
        """Starts the jobs queued since the last flush, after those already started."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
            if jobs:
                self._pending = self._executor.submit(self._run, jobs)

    def run_now(self) -> None:
        """Runs the jobs queued since the last flush in this thread, now, once those already
        started are done: for a call whose queued work someone waits on sooner than its reply (a
        round's verdicts, on which the drafter's work starts: verifier/service_core.py)."""
        with self._lock:
            jobs, self._jobs = self._jobs, []
        self.settle()
        if jobs:
            self._run(jobs)

    def settle(self) -> None:
        """Returns once every job started is done (their errors were logged by then)."""
        pending = self._pending
        if pending is not None:
            pending.result()

    def _run(self, jobs: list[Callable[[], None]]) -> None:
        t0 = time.perf_counter()
        for job in jobs:
            try:
                job()
            except Exception:
                self.failed += 1
                log.exception("after the reply: %s failed", getattr(job, "__qualname__", job))
        if self.clock is not None:
            self.clock.add("after_reply", time.perf_counter() - t0)

    def close(self) -> None:
        """Runs what was queued, waits for it, and ends the worker (unless it was given)."""
        self.flush()
        self.settle()
        if self._own:
            self._executor.shutdown(wait=False)
