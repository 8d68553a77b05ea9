"""Host-to-device copies that do not stall the host.

`torch.tensor(data, device="cuda")` and `cpu_tensor.to("cuda")` copy from pageable memory and
then synchronize the stream: the host waits for every kernel queued before it, and the GPU then
idles while the host prepares the next launch. A speculation round makes a few dozen such small
copies (slots, lengths, tree shapes, block tables), each one such stall; on the H200 the 8B round
waited ~80 µs per copy (benchmarks/profile_round.py). `to_device` stages the data in pinned
memory and copies it asynchronously, in stream order, so the host runs ahead. The values are
the same; PyTorch's pinned-memory allocator keeps the staging buffer until the copy is done.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

# What the engines compute in unless told otherwise (for callers that import no torch themselves).
DEFAULT_DTYPE = torch.float32


def to_device(data, device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`torch.tensor(data, dtype=dtype, device=device)` (or a CPU tensor moved there), without a
    stream synchronization on CUDA."""
    device = torch.device(device)
    if isinstance(data, torch.Tensor) and data.device == device and (dtype is None or data.dtype == dtype):
        return data   # already there (say, features from an engine on the same device)
    t = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def to_host(*tensors: torch.Tensor | None) -> list[torch.Tensor | None]:
    """CPU copies of `tensors` (None stays None) with one wait: CUDA tensors are copied into
    pinned memory without blocking, then each device's stream is synchronized once, where one
    `.cpu()` per tensor would stall the host once each.

    Hazard this also avoids: `.cpu()` copies into pageable memory, and while that copy waits
    for the work queued before it, other threads' CUDA calls on the same device stall: on the
    H200 host a kernel launch or a small copy took about 50 us instead of 5, and creating an
    event waited for the whole queue (benchmarks/wait_contention.py). A stream synchronize does
    not hold them up. In-process serving reads each verdict this way while the drafter's thread
    prepares the next launch on the verifier's device."""
    out, devices = [], set()
    for t in tensors:
        if t is None or t.device.type != "cuda":
            out.append(t)
            continue
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
        devices.add(t.device)
    for device in devices:
        torch.cuda.current_stream(device).synchronize()
    return out


def to_device_all(tensors: list[torch.Tensor], device, dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """`to_device` of each tensor [n_i, ...]; host tensors of one trailing shape cross in one copy
    (concatenated on the host, split on the device into views)."""
    device = torch.device(device)
    if all(t.device == device and (dtype is None or t.dtype == dtype) for t in tensors):
        return list(tensors)   # already there, as `to_device` would find each
    same = len({t.shape[1:] for t in tensors}) == 1
    if device.type != "cuda" or len(tensors) < 2 or not same or any(t.device.type != "cpu" for t in tensors):
        return [to_device(t, device, dtype) for t in tensors]
    joined = to_device(torch.cat([t if dtype is None else t.to(dtype) for t in tensors]), device, dtype)
    return list(joined.split([t.shape[0] for t in tensors]))


def engine_device(engine) -> torch.device | None:
    """The torch device an in-process engine computes on (None: none, e.g. n-gram drafting)."""
    runner = getattr(engine, "runner", None)
    proposer = getattr(engine, "proposer", None)
    device = getattr(runner, "device", None) or getattr(proposer, "device", None)
    return None if device is None else torch.device(device)


def engine_stream(engine):
    """A CUDA stream of the engine's own on its device (None: it computes on the CPU or nothing),
    for an in-process link to run the engine's calls on (router/local_base.py)."""
    device = engine_device(engine)
    if device is None or device.type != "cuda":
        return None
    return torch.cuda.Stream(device=device)


def on_stream(stream, fn, *args):
    """fn(*args) with `stream` current (as it is when `stream` is None)."""
    if stream is None:
        return fn(*args)
    with torch.cuda.stream(stream):
        return fn(*args)


def bind_cpu_cores(cores: list[int] | None, every_thread: bool = False) -> None:
    """Binds this process to `cores` (an engine's --cpu-cores; None: left as it is). Called by the
    entry points that start engines, first: the threads started later (torch's, gRPC's) run on
    those cores too. `every_thread`: the threads already running as well (a Ray actor, whose
    worker started its own before the actor is built). Refused where a core is not one this
    process may run on, or where the platform cannot bind."""
    if cores is None:
        return
    check_cores(cores, "--cpu-cores")
    for tid in os.listdir("/proc/self/task") if every_thread else [0]:   # 0: the calling thread
        try:
            os.sched_setaffinity(int(tid), cores)
        except ProcessLookupError:   # a thread that ended meanwhile
            pass


def check_cores(cores: list[int], flag: str) -> None:
    """Refuses `cores` (the value of `flag`) where one is not a core this process may run on, or
    where the platform cannot bind threads to cores."""
    from spectandem.service_args import format_cores

    if not hasattr(os, "sched_setaffinity"):
        raise ValueError(f"{flag}: this platform cannot bind threads to cores")
    allowed = os.sched_getaffinity(0)
    outside = sorted(set(cores) - allowed)
    if outside:
        raise ValueError(f"{flag} {format_cores(cores)}: core(s) {format_cores(outside)} are not among those "
                         f"this process may run on ({format_cores(allowed)})")


class SmallForwards:
    """Where an engine's forwards run on the CPU, by their size (a verifier's --one-thread-up-to
    and --one-thread-cores). `with placed(tokens):` around a forward of `tokens` tokens, on the
    thread that runs it: one of at most `up_to` tokens runs on one torch thread, that thread bound
    to `cores` where given; a larger one on `threads` torch threads, on the process's cores. `up_to`
    0: every forward as the process is set.

    serve --cpu-bind gives a speculating pair's verifier the drafter's cores for its small
    forwards. At low concurrency one core then computes the whole round, the verify and then the
    draft, and does not idle between them: on this project's 2-core VM an idle vCPU halts at once
    and computes slower once woken (benchmarks/results/idle-core-cpu-2core.txt). After a small
    forward the thread may run on the process's cores and on `cores`, so that what it does next (the
    verdicts to the drafter, the reply) stays on the core it computed on: moved to the process's
    other cores after each forward, a gRPC pair served 0.95x, and a Ray pair, whose verifier's
    process has cores apart from the drafter's, served 1.07x when left there
    (benchmarks/results/small-forwards-cpu-2core.txt). After a large forward it is back on the
    process's cores, where the threads it starts later (a thread takes its creator's cores) belong."""

    def __init__(self, up_to: int = 0, threads: int = 1, cores: list[int] | None = None):
        self.check(up_to, cores)
        self.up_to, self.threads = up_to, threads
        self.cores = list(cores) if cores is not None else None
        self.home = sorted(os.sched_getaffinity(0)) if cores is not None else None
        self.after_small = sorted(set(self.home) | set(self.cores)) if cores is not None else None
        self.count = 0   # forwards run on one thread (EngineInfo.extra "one_thread_forwards")

    @staticmethod
    def check(up_to: int, cores: list[int] | None) -> None:
        """Refuses --one-thread-cores without --one-thread-up-to (a verifier's flags, checked
        before its model loads too). The cores may lie outside the process's own (a Ray verifier
        actor's are apart from the drafter's); the verifier's entry point checks them against
        those it was started with."""
        if cores is not None and not up_to:
            raise ValueError("--one-thread-cores needs --one-thread-up-to: the forwards it places are those of "
                             "at most that many tokens")

    @contextmanager
    def placed(self, tokens: int):
        small = bool(self.up_to) and tokens <= self.up_to
        if self.up_to and self.threads > 1:
            torch.set_num_threads(1 if small else self.threads)
        bound = self.cores is not None   # (`check`: only with up_to)
        if bound:   # before a large forward too: a team it starts gets the process's cores
            os.sched_setaffinity(0, self.cores if small else self.home)
        self.count += small
        try:
            yield
        finally:
            if bound:
                os.sched_setaffinity(0, self.after_small if small else self.home)


def set_cpu_threads(n: int | None) -> None:
    """torch's intra-op CPU threads for this process (None: left as torch set them). Called by the
    entry points that start engines, once, before any model loads."""
    if n is not None:
        torch.set_num_threads(n)


def own_cpu_threads(n: int) -> None:
    """torch's CPU threads for the calling thread, its OpenMP team made now (a parallel region),
    so that the thread keeps them whatever later calls set for the process. For a thread that
    runs engine calls (router/local_base.py cpu_engine_thread)."""
    torch.set_num_threads(n)
    torch.ones(1 << 17).sum()


def cpu_engine_thread(num_threads: int):
    """The one worker thread that runs an engine's calls on the CPU (both engines' in `serve
    --backend local`; one engine process's otherwise), with `num_threads` torch threads: the
    process's only OpenMP team of more than one thread. libgomp counts the threads of every team
    alive in the process, and where they outnumber the cores its threads barely spin before
    sleeping, so each op waits to wake them: with one idle team of two threads beside it, the demo
    pair's engine loop with two threads decoded plainly at 67-70 tok/s instead of 214-234 (2-core
    CPU). The thread that loads the engines keeps one torch thread."""
    from concurrent.futures import ThreadPoolExecutor

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="spectandem-engines", initializer=own_cpu_threads,
                              initargs=(num_threads,))


def engine_process_thread(device: str):
    """For an engine process (gRPC service) on `device`: where it computes on the CPU with more
    than one torch thread, this thread drops to one and a `cpu_engine_thread` with the others is
    returned for its calls (which otherwise run on whichever gRPC handler thread received them,
    each its own OpenMP team); else None (calls run on the handler threads)."""
    from spectandem.config import is_cuda

    n = torch.get_num_threads()
    if is_cuda(str(device)) or n <= 1:
        return None
    torch.set_num_threads(1)
    return cpu_engine_thread(n)


def cuda_gpus() -> int:
    """The CUDA GPUs visible to this process."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def probe_platform(target_dir=None, gpus: int | None = None):
    """What this machine offers the `auto` model flags (spectandem.config.Platform): the CUDA
    GPUs visible (or `gpus`, counted elsewhere: a Ray cluster's), whether Triton is installed,
    whether the target at `target_dir` runs on the native runner (None: assumed). For entry points."""
    import importlib.util

    from spectandem.config import Platform

    if gpus is None:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    native = True
    if target_dir is not None:
        from spectandem.modeling.target import inspect_target

        native = inspect_target(target_dir, None).native
    return Platform(gpus=gpus, triton=importlib.util.find_spec("triton") is not None, native=native)


def resolve_flags(args, target_dir=None, gpus: int | None = None):
    """`args` with the model flags' `auto` values made explicit for this machine
    (spectandem.config.resolve_model_flags over probe_platform)."""
    from spectandem.config import resolve_model_flags

    return resolve_model_flags(args, probe_platform(target_dir, gpus))
