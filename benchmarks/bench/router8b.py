"""`spectandem bench --sections router8b`: the router's pipeline modes over the 8B-shaped target
at controlled acceptance (drafter/controlled.py), so that "auto" is measured where
speculation can lose: at large batches, a verify of B trees costs more than B plain tokens, and
at a low acceptance rate the drafts do not pay for it.

For each placement, acceptance rate and batch size: "plain" (the router without a drafter, the
baseline; run once, with the first placement; its rounds decode `plain_steps` tokens a call, as
serve's --plain-steps, and so do the plain rounds "auto" picks), then each speculating mode (`ROUTER8B_MODES`;
default "sequential" and "auto"), all requests submitted at once (greedy, ignore_eos) and timed
until the last token. A row is the median of `repeats` such batches (one batch's wall time
varies by a few percent from run to run: plain decoding at 64 read 8,761-9,037 tok/s over four
batches on one H200). "auto" first runs the same batch untimed until its choice has settled (kept
twice in a row; at most AUTO_WARM_BATCHES batches), so its online measurement is done and the
timed run shows the steady state: the mode it keeps (`auto_mode`), the committed tokens/s it
measured per candidate at the batch's size (`auto_rates`) and, where it settled on plain at a
large batch, requests admitted without the drafter (`detached_admissions`). Before any timing, each mode runs
every batch size once untimed (CUDA graphs of each size captured). Every row checks that its
tokens are the target's own greedy continuation (`matches_plain`). "ahead" drafts ahead with the
controlled drafter's guesses (drafter/controlled.py): its rows give the outcome cache's
hits and misses (`ahead_hits`, `ahead_misses`; expected hit rate `expected_ahead_hit_rate`) and
the request-rounds verified with a tree the router held from draft ahead, no draft call
(`ready_trees`).

Plain timed minutes earlier is no baseline: the GPU's speed drifts by several percent over a
section (on one H200, plain at batch 64 read 9,337 tok/s at the start of a run; interleaved batch
by batch, plain and the router held in plain mode both read 5,823-5,923). So each speculating
row's `repeats` batches alternate with as many plain batches of its size, plain first, on a plain
router kept running beside it: `paired_plain_runs` (their tokens/s), `paired_plain_tokens_per_s`
(the median one, picked as the row's own) and `speedup_paired` = tokens_per_s over it. `speedup`
still divides by the section's first plain rows.

At batch 1, given the verify forward's time (`verify_forward_times`, a chain of num_steps + 1
nodes), each speculating row also gives the issue's ideal: `ideal_tokens_per_s` = accept_length /
that time, `measured_over_ideal` = tokens_per_s over it, and the same for the decode phase alone
(`decode_over_ideal`: tokens over the wall time less the prefills, the verifier's and the drafter's).

Placements (`placement`, with `verifier_device` and `drafter_device`): "one-device", the target
and the EAGLE-3 head on one device; "drafter-own-gpu" (given a drafter device), the head copied
to it with its proposer and caches, the target engines shared (`ControlledRuns.with_drafter_device`).

Is drafting hidden behind verification? Each row takes the engines' busy time over its timed
batch from the links (`busy_s` of router/links_local.py: per call, from its start in the worker thread
until its CUDA stream is done; for a verify, the host's preparation, the forward, acceptance and
the results on the host):
- `wall_s`: the batch's wall seconds, from submission until the last token;
- `verify_busy_s`, `prefill_busy_s`: the verifier inside verify and prefill calls;
- `round_over_verify` = (wall_s - prefill_busy_s) / verify_busy_s = 1 + the time the verifier
  sat idle (waiting for the drafter, the router or the host) per second it verified. 1.0: it
  never waited. The verifier's calls run one after another and all start and end inside the
  timed batch, so its busy time never exceeds the wall time and the ratio is at least 1;
- `drafter_busy_s`: the drafter inside all its calls (prefill, draft, extend, release); None for plain;
- `rounds`: verify calls of the batch (ping-pong verifies each half on its own), so
  verify_busy_s / rounds is the mean verify call;
- `round_ms` = (wall_s - prefill_busy_s) / rounds (speculating rows) and, at batch 1,
  `round_over_forward` = round_ms / the verify forward's time (the chain above): the issue's
  "a round takes at most 1.1x the verify forward alone" read against the forward itself, with
  the verify call's host work and acceptance on the round's side;
- `over_verify_alone` = (wall_s - prefill_busy_s) / verify_busy_s of the "sequential" row of the
  same placement, rate and batch size (None without one): the batch against the same tokens'
  verification with nothing beside it (sequential verify calls never overlap drafting, and
  verify the whole batch at once where ping-pong verifies halves). For the drafter on its own
  GPU, "a round takes at most 1.1x the verify forward alone" reads: pingpong's <= 1.1.

The random-weight target has no tokenizer: the router's detokenizer gets token ids as text.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import time

from drafter.controlled import ControlledProposer, expected_ahead_hit_rate, plan_drafts
from benchmarks.bench.pipeline import _settle
from benchmarks.bench.records import record, sync

ROUTER8B_MODES = ("sequential", "ahead", "pingpong", "auto")   # besides plain, which always runs
AUTO_WARM_BATCHES = 4    # untimed batches before an "auto" row, until its choice has settled


def check_modes(modes: list[str], what: str = "router8b modes") -> None:
    bad = [m for m in modes if m not in ROUTER8B_MODES]
    if bad or not modes:
        raise ValueError(f"{what}: unknown {bad or modes}; choose from {', '.join(ROUTER8B_MODES)} "
                         "(plain always runs)")


class IdsAsText:
    """The detokenizer's tokenizer for a model without one: "12 7 99" for [12, 7, 99]."""

    @staticmethod
    def decode(ids) -> str:
        return " ".join(str(i) for i in ids)


async def _batch(router, runs, ids: list[str], indices: list[int]) -> int:
    from router.loop import StreamEvent

    async def one(rid: str, i: int) -> int:
        req = router.submit(runs.prompts[i], runs.params, request_id=rid)
        got = []
        while True:
            ev = await req.events.get()
            if not isinstance(ev, StreamEvent):
                raise RuntimeError(f"request {rid} failed: {ev}")
            got += ev.token_ids
            if ev.finish_reason:
                break
        end = runs.prompt_len + runs.max_tokens
        if got != list(runs.truths[i][runs.prompt_len: end]):
            raise AssertionError(f"request {rid}: tokens differ from the target's greedy continuation")
        return len(got)
    return sum(await asyncio.gather(*(one(rid, i) for rid, i in zip(ids, indices))))


@dataclasses.dataclass
class _Setup:
    """One router over fresh links for plain (acceptance_rate None) or one speculating mode."""

    router: object
    links: tuple                 # (verifier link,) or (verifier link, drafter link)
    plans: dict                  # request id -> DraftPlan, read by the ControlledProposer
    acceptance_rate: float | None


def _setup(runs, acceptance_rate: float | None, mode: str, max_running: int, plain_steps: int = 1) -> _Setup:
    from drafter.engine import DrafterEngine
    from router.links_local import LocalDrafterLink, LocalVerifierLink
    from router.loop import Router, RouterConfig

    plain = acceptance_rate is None
    plans: dict = {}
    verifier = runs.plain if plain else runs.verifier
    vlink = LocalVerifierLink(verifier)
    dlink = None if plain else LocalDrafterLink(DrafterEngine(ControlledProposer(runs.inner, plans), runs.cfg))
    router = Router(vlink, dlink, IdsAsText(), RouterConfig(
        max_len=verifier.max_len, eos_token_ids=(), lookahead=1 if plain else runs.lookahead,
        want_features=not plain, max_running=max_running, pipeline="sequential" if plain else mode,
        plain_steps=plain_steps))
    return _Setup(router, (vlink,) if plain else (vlink, dlink), plans, acceptance_rate)


async def _timed(s: _Setup, runs, ids: list[str], indices: list[int]) -> dict:
    """One batch, timed: {tokens, seconds, counters (deltas), mode (the router's last), busy
    (per link, seconds per kind of call over the batch)}."""
    router = s.router
    if s.acceptance_rate is not None:
        s.plans.update({rid: plan_drafts(runs.truths[i], runs.prompt_len, s.acceptance_rate, runs.vocab_size,
                                         f"{runs.seed}:{i}") for rid, i in zip(ids, indices)})
    devices = (runs.device,) if s.acceptance_rate is None else (runs.device, runs.drafter_device)
    before = dataclasses.asdict(router.counters)
    for d in devices:
        sync(d)
    busy0 = [dict(link.busy_s) for link in s.links]   # the engines hold no request now (_settle)
    t0 = time.perf_counter()
    tokens = await _batch(router, runs, ids, indices)
    for d in devices:
        sync(d)
    busy = [{k: v - b0.get(k, 0.0) for k, v in link.busy_s.items()} for link, b0 in zip(s.links, busy0)]
    dt = time.perf_counter() - t0                     # after the busy snapshot: busy <= dt
    await _settle(s.links)
    c = {k: v - before[k] for k, v in dataclasses.asdict(router.counters).items() if isinstance(v, int)}
    return {"tokens": tokens, "seconds": dt, "counters": c, "mode": router._modes.mode, "busy": busy,
            "rates": {k: round(v, 1) for k, v in router._modes.rates_for(len(ids)).items()}}


def _record(mode: str, batch_size: int, acceptance_rate: float | None, m: dict, placement: dict,
            num_steps: int, verify: dict | None = None) -> dict:
    c, dt = m["counters"], m["seconds"]
    drafts = c["num_drafts"]
    verify_s, prefill_s = m["busy"][0].get("verify", 0.0), m["busy"][0].get("prefill", 0.0)
    plain = acceptance_rate is None
    r = record(section="router8b", workload="llama8b", method="none" if plain else "eagle3-controlled",
               mode=mode, batch_size=batch_size, acceptance_rate=acceptance_rate, tokens=m["tokens"], seconds=dt,
               wall_s=round(dt, 6),   # microseconds: over_verify_alone is computed from these
               accept_length=(c["accepted_tokens"] + drafts) / drafts if drafts else 1.0,
               rounds=c["rounds"], rounds_per_s=round(c["rounds"] / dt, 1), matches_plain=True,
               auto_mode=m["mode"] if mode == "auto" else None,
               auto_rates=m["rates"] if mode == "auto" else None,
               detached_admissions=c["detached_admissions"] if mode == "auto" else None,
               verify_busy_s=round(verify_s, 6), prefill_busy_s=round(prefill_s, 6),
               round_over_verify=round((dt - prefill_s) / verify_s, 3) if verify_s > 0 else None,
               drafter_busy_s=None if plain else round(sum(m["busy"][1].values()), 6), **placement)
    if not plain:
        r.update(ahead_hits=c["draft_ahead_hits"], ahead_misses=c["draft_ahead_misses"], ready_trees=c["ready_trees"],
                 round_ms=round((dt - prefill_s) / c["rounds"] * 1000, 3),
                 expected_ahead_hit_rate=round(expected_ahead_hit_rate(acceptance_rate, num_steps), 3))
    if not plain and batch_size == 1 and verify and drafts:
        ideal = r["accept_length"] / (verify["chain_ms"] / 1000)
        decode_s = dt - prefill_s - m["busy"][1].get("prefill", 0.0)
        r.update(ideal_tokens_per_s=round(ideal, 1), measured_over_ideal=round(r["tokens_per_s"] / ideal, 3),
                 decode_tokens_per_s=round(m["tokens"] / decode_s, 1),
                 decode_over_ideal=round(m["tokens"] / decode_s / ideal, 3),
                 round_over_forward=round(r["round_ms"] / verify["chain_ms"], 3))
    return r


def _median(timed: list[dict]) -> dict:
    """The median batch by wall time (of an even count, the faster of the middle two)."""
    return sorted(timed, key=lambda t: t["seconds"])[(len(timed) - 1) // 2]


def _tps(t: dict) -> float:
    return round(t["tokens"] / t["seconds"], 1)


async def _started(runs, acceptance_rate: float | None, mode: str, batch_sizes: list[int], plain_steps: int,
                   ids_for) -> _Setup:
    """A started setup, warmed up: every batch size's graphs captured, the allocator grown."""
    s = _setup(runs, acceptance_rate, mode, max(batch_sizes), plain_steps)
    s.router.start()
    try:
        for b in batch_sizes:
            await _timed(s, runs, *ids_for(b))
    except BaseException:
        await s.router.stop()
        raise
    return s


async def _paired(s: _Setup, mode: str, plain: _Setup, runs, b: int, repeats: int, ids_for) -> tuple[list, list]:
    """`repeats` batches of size `b` on `s`, each right after one on `plain` (plain, mode, plain,
    mode, ...): -> (the mode's batches, the plain ones), timed at the same GPU speed."""
    if mode == "auto":   # the online measurement, untimed, until its choice settles (at most 4 batches)
        for _ in range(AUTO_WARM_BATCHES):
            await _timed(s, runs, *ids_for(b))
            if s.router._modes.settled(b) is not None:
                break
    timed, plains = [], []
    for _ in range(repeats):
        plains.append(await _timed(plain, runs, *ids_for(b)))
        timed.append(await _timed(s, runs, *ids_for(b)))
    return timed, plains


async def _rows(runs, rates: list[float], modes: list[str], batch_sizes: list[int], placement: dict,
                plain_tps: dict[int, float], plain_steps: int = 1, verify: dict | None = None,
                repeats: int = 1) -> list[dict]:
    """Rows of one placement; the plain rows only while `plain_tps` (tokens/s per batch size,
    for the speedups) is empty, which they fill. A plain setup lives through every row, for
    the plain batches timed between each speculating row's own."""
    records, n = [], itertools.count()

    def ids_for(b: int) -> tuple[list[str], list[int]]:
        k = next(n)
        return [f"r{k}-{i}" for i in range(b)], [i % runs.num_prompts for i in range(b)]

    def row(mode: str, b: int, a: float | None, timed: list[dict]) -> dict:
        r = _record(mode, b, a, _median(timed), placement, runs.cfg.num_steps, verify)
        r.update(repeats=repeats, tokens_per_s_runs=[_tps(t) for t in timed])
        records.append(r)
        return r

    plain = await _started(runs, None, "plain", batch_sizes, plain_steps, ids_for)
    try:
        if not plain_tps:
            for b in batch_sizes:
                plain_tps[b] = row("plain", b, None, [await _timed(plain, runs, *ids_for(b))
                                                      for _ in range(repeats)])["tokens_per_s"]
        for a, mode in itertools.product(rates, modes):
            s = await _started(runs, a, mode, batch_sizes, plain_steps, ids_for)
            try:
                for b in batch_sizes:
                    timed, plains = await _paired(s, mode, plain, runs, b, repeats, ids_for)
                    r = row(mode, b, a, timed)
                    paired = _tps(_median(plains))
                    r.update(speedup=round(r["tokens_per_s"] / plain_tps[b], 3), paired_plain_tokens_per_s=paired,
                             paired_plain_runs=[_tps(t) for t in plains],
                             speedup_paired=round(r["tokens_per_s"] / paired, 3))
            finally:
                await s.router.stop()
    finally:
        await plain.router.stop()
    return records


def bench_router8b(runs, rates: list[float], modes: list[str], batch_sizes: list[int],
                   drafter_device: str | None = None, plain_steps: int = 1, verify: dict | None = None,
                   repeats: int = 1) -> list[dict]:
    """Rows per placement (`runs`'s own; then, given `drafter_device`, the head there:
    `runs.with_drafter_device`), acceptance rate, mode and batch size (plain first, once per
    batch size; then, per speculating row, plain batches timed between its own). `verify`: the
    verify forward's times (`verify_forward_times`), for the batch-1 rows' fraction of the ideal.
    `repeats`: timed batches per row; the row is the median one (by wall time), every batch's
    tokens/s in `tokens_per_s_runs`."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    check_modes(modes)
    placements = [runs] + ([runs.with_drafter_device(drafter_device)] if drafter_device is not None else [])
    records, plain_tps = [], {}
    for r in placements:
        records += asyncio.run(_rows(r, rates, modes, batch_sizes, r.placement(), plain_tps, plain_steps, verify,
                                     repeats))
    _fill_over_verify_alone(records)
    return records


def _fill_over_verify_alone(records: list[dict]) -> None:
    """Sets each row's `over_verify_alone` from the sequential row of its placement, rate and batch size."""
    key = lambda r: (r["placement"], r["acceptance_rate"], r["batch_size"])
    alone = {key(r): r["verify_busy_s"] for r in records if r["mode"] == "sequential"}
    for r in records:
        v = alone.get(key(r)) if r["acceptance_rate"] is not None else None
        r["over_verify_alone"] = round((r["wall_s"] - r["prefill_busy_s"]) / v, 3) if v else None
