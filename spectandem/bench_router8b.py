"""`spectandem bench --sections router8b`: the router's pipeline modes over the 8B-shaped target
at controlled acceptance (spectandem/bench_controlled.py), so that "auto" is measured where
speculation can lose: at large batches, a verify of B trees costs more than B plain tokens, and
at a low acceptance rate the drafts do not pay for it.

For each acceptance rate and batch size: "plain" (the router without a drafter, the baseline),
then each speculating mode (default "sequential" and "auto"), all requests submitted at once
(greedy, ignore_eos) and timed until the last token. "auto" first runs the same batch once
untimed, so its online measurement is done and the timed run shows the mode it keeps
(`auto_mode`). Every row checks that its tokens are the target's own greedy continuation
(`matches_plain`).

The random-weight target has no tokenizer: the router's detokenizer gets token ids as text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from spectandem.bench_controlled import ControlledProposer, plan_drafts
from spectandem.bench_pipeline import _settle
from spectandem.bench_records import record, sync


class IdsAsText:
    """The detokenizer's tokenizer for a model without one: "12 7 99" for [12, 7, 99]."""

    @staticmethod
    def decode(ids) -> str:
        return " ".join(str(i) for i in ids)


async def _batch(router, runs, ids: list[str], indices: list[int]) -> int:
    from router.scheduler import Chunk

    async def one(rid: str, i: int) -> int:
        req = router.submit(runs.prompts[i], runs.params, request_id=rid)
        got = []
        while True:
            ev = await req.events.get()
            if not isinstance(ev, Chunk):
                raise RuntimeError(f"request {rid} failed: {ev}")
            got += ev.token_ids
            if ev.finish_reason:
                break
        end = runs.prompt_len + runs.max_tokens
        if got != list(runs.truths[i][runs.prompt_len: end]):
            raise AssertionError(f"request {rid}: tokens differ from the target's greedy continuation")
        return len(got)
    return sum(await asyncio.gather(*(one(rid, i) for rid, i in zip(ids, indices))))


async def _rows(runs, rates: list[float], modes: list[str], batch_sizes: list[int], device: str) -> list[dict]:
    from drafter.engine import DrafterEngine
    from router.links import LocalDrafterLink, LocalVerifierLink
    from router.scheduler import Router, RouterConfig

    records, plain_tps = [], {}
    counter = [0]

    def ids_for(b: int) -> tuple[list[str], list[int]]:
        counter[0] += 1
        return [f"r{counter[0]}-{i}" for i in range(b)], [i % runs.num_prompts for i in range(b)]

    for a in [None, *rates]:
        for mode in (["plain"] if a is None else modes):
            plans: dict = {}
            verifier = runs.plain if a is None else runs.verifier
            vlink = LocalVerifierLink(verifier)
            dlink = None if a is None else LocalDrafterLink(DrafterEngine(ControlledProposer(runs.inner, plans),
                                                                          runs.cfg))
            router = Router(vlink, dlink, IdsAsText(), RouterConfig(
                max_len=verifier.max_len, eos_token_ids=(), lookahead=1 if a is None else runs.lookahead,
                want_features=a is not None, max_running=max(batch_sizes),
                pipeline="sequential" if a is None else mode))
            links = (vlink,) if dlink is None else (vlink, dlink)

            async def run_batch(b: int) -> tuple[int, float, dict, str | None]:
                ids, indices = ids_for(b)
                if a is not None:
                    plans.update({rid: plan_drafts(runs.truths[i], runs.prompt_len, a, runs.vocab_size,
                                                   f"{runs.seed}:{i}") for rid, i in zip(ids, indices)})
                before = dataclasses.asdict(router.counters)
                sync(device)
                t0 = time.perf_counter()
                tokens = await _batch(router, runs, ids, indices)
                sync(device)
                dt = time.perf_counter() - t0
                await _settle(links)
                c = {k: v - before[k] for k, v in dataclasses.asdict(router.counters).items() if isinstance(v, int)}
                return tokens, dt, c, router._modes.mode

            router.start()
            try:
                await run_batch(2)                                   # warm-up (graphs, allocator)
                for b in batch_sizes:
                    if mode == "auto":
                        await run_batch(b)                           # the online measurement
                    tokens, dt, c, kept = await run_batch(b)
                    drafts = c["num_drafts"]
                    r = record(section="router8b", workload="llama8b", method="none" if a is None else
                               "eagle3-controlled", mode=mode, batch_size=b, acceptance_rate=a, tokens=tokens,
                               seconds=dt, accept_length=(c["accepted_tokens"] + drafts) / drafts if drafts else 1.0,
                               rounds_per_s=round(c["rounds"] / dt, 1), matches_plain=True,
                               auto_mode=kept if mode == "auto" else None)
                    if a is None:
                        plain_tps[b] = r["tokens_per_s"]
                    else:
                        r["speedup"] = round(r["tokens_per_s"] / plain_tps[b], 3)
                    records.append(r)
            finally:
                await router.stop()
    return records


def bench_router8b(runs, rates: list[float], modes: list[str], batch_sizes: list[int], device: str) -> list[dict]:
    """Rows per acceptance rate, mode and batch size (plain first, once per batch size)."""
    return asyncio.run(_rows(runs, rates, modes, batch_sizes, device))
