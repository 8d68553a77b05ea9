"""`spectandem bench` through the router: rounds and tokens per second per pipeline mode, with
both engines on one device and, where two GPUs exist, the drafter on its own (cuda:1).

The router (router/loop.py) runs over in-process links (router/links_local.py), as
`spectandem serve --backend local` does, on the demo pair's EAGLE-3 chain. Every batch is
submitted at once (greedy, ignore_eos) and timed until its last token. Mode "plain" is the
router without a drafter (the baseline); "auto" first runs the same batch once untimed, so its
online measurement is done and the timed run shows the mode it keeps (recorded as `auto_mode`).
"""

from __future__ import annotations

import asyncio
import dataclasses

from benchmarks.bench.records import PROMPTS, record, sync
from spectandem.config import GpuPaths


def split_modes(modes: list[str]) -> tuple[list[str], list[str]]:
    """(modes RouterConfig accepts, modes it rejects)."""
    from router.requests import RouterConfig

    def accepted(mode: str) -> bool:
        if mode == "plain":
            return True
        try:
            RouterConfig(max_len=16, eos_token_ids=(), lookahead=1, want_features=False, pipeline=mode)
        except ValueError:
            return False
        return True
    return [m for m in modes if accepted(m)], [m for m in modes if not accepted(m)]


def demo_engines(max_slots: int, dtype, verifier_device: str, drafter_device: str, gpu: GpuPaths = GpuPaths(),
                 cfg=None):
    """(verifier engine, drafter engine, lookahead, eos ids, tokenizer) of the demo EAGLE-3 pair
    (`cfg`: its SpecConfig, a chain of 4 by default) with each engine on its own device.
    LocalSpeculator does this with one device for both; a `drafter_device` argument there would
    make this the same call."""
    from drafter.engine import DrafterEngine, build_proposer
    from spectandem.checkpoint import eos_token_ids, load_tokenizer, read_config
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths
    from verifier.engine import VerifierEngine
    from verifier.runner import load_runner

    cfg = cfg or SpecConfig(method="eagle3", num_steps=4, topk=1, num_draft_tokens=5)
    target, draft = demo_paths("eagle3")
    runner, model = load_runner(target, None, max_slots, 512, dtype, verifier_device, **gpu.runner_kwargs())
    proposer = build_proposer(cfg, model, draft, max_slots, runner.max_len, dtype, drafter_device,
                              **gpu.proposer_kwargs())
    runner.feature_layers = proposer.feature_layers
    tcfg = read_config(target)
    eos_ids = eos_token_ids(tcfg)
    lookahead = max(cfg.max_draft_nodes + 1, (cfg.num_steps - 1) * cfg.topk + 1)
    return (VerifierEngine(runner, max_slots, int(tcfg["vocab_size"])), DrafterEngine(proposer, cfg), lookahead,
            eos_ids, load_tokenizer(target))


async def _complete(router, prompts: list[list[int]], params) -> int:
    """Submits every prompt at once; -> tokens generated once all have finished."""
    from router.loop import StreamEvent

    async def one(req) -> int:
        n = 0
        while True:
            ev = await req.events.get()
            if not isinstance(ev, StreamEvent):
                raise RuntimeError(f"request {req.request_id} failed: {ev}")
            n += len(ev.token_ids)
            if ev.finish_reason:
                return n
    return sum(await asyncio.gather(*(one(router.submit(p, params)) for p in prompts)))


async def _settle(links, timeout: float = 60.0) -> None:
    """Waits until both engines hold no request: the router streams a request's last tokens
    before it releases it, and the next batch (or router) needs the slots back."""
    import time

    deadline = time.monotonic() + timeout
    while any([(await link.info()).used_slots for link in links]):
        if time.monotonic() > deadline:
            raise RuntimeError(f"engines still hold requests {timeout} s after the last one finished")
        await asyncio.sleep(0.005)


async def _rows(engines, modes: list[str], batch_sizes: list[int], max_tokens: int, placement: dict,
                plain_steps: int = 1) -> list[dict]:
    import time

    from router.links_local import LocalDrafterLink, LocalVerifierLink
    from router.loop import Router, RouterConfig
    from spectandem.config import SamplingParams

    verifier, drafter, lookahead, eos, tokenizer = engines
    prompts = [tokenizer.encode(p).ids for p in PROMPTS]
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    vlink, dlink = LocalVerifierLink(verifier), LocalDrafterLink(drafter)
    devices = tuple({placement["verifier_device"], placement["drafter_device"]})
    records = []
    for mode in modes:
        plain = mode == "plain"
        router = Router(vlink, None if plain else dlink, tokenizer, RouterConfig(
            max_len=verifier.max_len, eos_token_ids=eos, lookahead=1 if plain else lookahead, want_features=not plain,
            max_running=max(batch_sizes), pipeline="sequential" if plain else mode,
            draft_sampling_min_temperature=drafter.cfg.draft_sampling_min_temperature, plain_steps=plain_steps))
        router.start()
        try:
            await _complete(router, prompts[:2], SamplingParams(max_tokens=8, ignore_eos=True))  # warm-up
            await _settle((vlink, dlink))
            for b in batch_sizes:
                if mode == "auto":   # let the online measurement finish on this batch size first
                    await _complete(router, [prompts[i % len(prompts)] for i in range(b)], params)
                    await _settle((vlink, dlink))
                before = dataclasses.asdict(router.counters)
                t0 = time.perf_counter()
                tokens = await _complete(router, [prompts[i % len(prompts)] for i in range(b)], params)
                for d in devices:
                    sync(d)
                dt = time.perf_counter() - t0
                await _settle((vlink, dlink))
                c = {k: v - before[k] for k, v in dataclasses.asdict(router.counters).items() if isinstance(v, int)}
                drafts = c["num_drafts"]
                records.append(record(
                    section="pipeline", workload="demo", method="none" if plain else "eagle3", mode=mode, batch_size=b, tokens=tokens,
                    seconds=dt, accept_length=(c["accepted_tokens"] + drafts) / drafts if drafts else 1.0,
                    rounds_per_s=round(c["rounds"] / dt, 1), draft_ahead_hits=c["draft_ahead_hits"],
                    draft_ahead_misses=c["draft_ahead_misses"], fallback_rounds=c["fallback_rounds"],
                    auto_mode=router._modes.mode if mode == "auto" else None, **placement))
        finally:
            await router.stop()
    return records


def bench_pipeline(modes: list[str], batch_sizes: list[int], max_tokens: int, device: str, dtype,
                   gpu: GpuPaths = GpuPaths(), plain_steps: int = 1) -> list[dict]:
    """Rows per placement (one device; drafter on cuda:1 where two GPUs exist), mode, batch size.
    `plain_steps`: RouterConfig.plain_steps of every router (multi-step plain rounds)."""
    import torch

    placements = [dict(placement="one-device", verifier_device=device, drafter_device=device)]
    if device.startswith("cuda") and torch.cuda.device_count() >= 2:
        placements.append(dict(placement="drafter-own-gpu", verifier_device="cuda:0", drafter_device="cuda:1"))
    records = []
    for p in placements:
        engines = demo_engines(max(batch_sizes), dtype, p["verifier_device"], p["drafter_device"], gpu)
        records += asyncio.run(_rows(engines, modes, batch_sizes, max_tokens, p, plain_steps))
    return records
