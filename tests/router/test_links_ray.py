"""The Ray links on a real local Ray cluster (one session for the module: worker start-up is
slow): greedy speculation through the actors equals the in-process speculator token for token;
the router side holds only refs, never feature tensors; a killed drafter shows up as
EngineUnavailable, comes back empty, names its requests as unknown, and a re-prefill from the
verifier's features resumes generation exactly."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
import ray
import torch

from router.links import EngineUnavailable
from spectandem.protocol import DrafterPrefillItem, ExtendItem, PlainItem, Tag, VerifierPrefillItem
from router.links_ray import RayVerifierLink, ray_init, start_engines
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from router.local import LocalSpeculator
from spectandem.messages import StaleMessage, trees_from_ready
from spectandem.reference import LocalCompletion, _append
from tests.router.conftest import RAY_CLUSTERS

pytestmark = [pytest.mark.slow, RAY_CLUSTERS]

CFG = SpecConfig(method="eagle3", num_steps=4, topk=1, num_draft_tokens=5)
_ALLOWED = sorted(os.sched_getaffinity(0))
CORES = {"verifier": _ALLOWED[:1], "drafter": _ALLOWED[-1:]}   # as serve --cpu-bind binds them (2 cores)
SMALL = 32   # the verifier's forwards of up to this many tokens on the drafter's cores, as serve's
MAX_SLOTS, MAX_LEN, MAX_TOKENS = 8, 256, 24
TEXTS = ["def fibonacci(n):\n", "import os\nimport sys\n\n", "class Queue:\n    def __init__(self",
         "    for i in range(len("]


@pytest.fixture(scope="module")
def engines():
    ray_init(None, num_cpus=4)
    ray_init(None, num_cpus=4)  # idempotent
    target, draft = demo_paths(CFG.method)
    verifier, drafter, cleanup = start_engines(target, draft, CFG, MAX_SLOTS, MAX_LEN, device="cpu",
                                               cpu_cores=CORES, drafter_threads=1, one_thread_up_to=SMALL,
                                               one_thread_cores=CORES["drafter"])
    yield verifier, drafter
    cleanup()
    ray.shutdown()


@pytest.fixture(scope="module")
def local():
    target, draft = demo_paths(CFG.method)
    return LocalSpeculator(target, draft, CFG, max_slots=MAX_SLOTS, max_len=MAX_LEN)


@pytest.fixture(scope="module")
def prompt_texts():
    """This module's texts for tests/router/conftest.py's `prompts`: not link_harness's order (the
    crash test runs on the first two)."""
    return TEXTS


class Seen:
    """Every handle the router side received, and the requests the drafter forgot."""

    def __init__(self):
        self.handles: list = []
        self.results: list = []
        self.resynced: list[str] = []
        self.ahead: list = []
        self.ready = 0           # request-rounds verified with DraftAhead's outcome trees (no Draft call)
        self.merged = 0          # DraftAhead calls that carried the last verdict's catch-up


async def speculate(verifier, drafter, prompts, params, eos, lookahead, seen: Seen, before_extend=None,
                    ahead: bool = False, with_draft: bool = False):
    """The loop of spectandem/reference.py, through the links, as a router runs it (plus the
    re-prefill of requests the drafter reports unknown). `ahead`: DraftAhead on each round's
    trees, overlapped with their verify as the router's "ahead" mode does; the hit flags go to
    `seen.ahead`. `with_draft`: each round's catch-up goes with the next Draft call (the
    router's sequential rounds)."""
    max_len = (await verifier.info()).max_len
    ids = [f"req-{i}" for i in range(len(prompts))]
    seeds = {rid: sp.resolved_seed() for rid, sp in zip(ids, params)}
    by_id = {rid: (LocalCompletion(rid, list(p)), sp) for rid, p, sp in zip(ids, prompts, params)}
    tags: dict[str, Tag] = {}
    pres = await verifier.prefill([VerifierPrefillItem(Tag(rid, 0, len(p)), p, sp, seeds[rid])
                                   for rid, p, sp in zip(ids, prompts, params)], want_features=True)
    items = []
    for r in pres:
        rid = r.tag.request_id
        c, sp = by_id[rid]
        seen.handles.append(r.features)
        seen.results.append(r)
        tags[rid] = r.tag
        _append(c, [r.first_token_id], sp, eos, r.tag.committed_len, max_len)
        if c.finish_reason is None:
            items.append(DrafterPrefillItem(r.tag, c.prompt_ids, r.first_token_id, sp, seeds[rid], r.features))
    assert await drafter.prefill(items) == []
    active = [i.tag.request_id for i in items]
    next_trees: dict = {}     # request -> (committed_len, ReadyTree) from the last DraftAhead
    catch_up: list = []       # an all-hit verdict's catch-up, held back for the next DraftAhead
    round_no = 0

    async def resync(unknown):
        for rid in unknown:  # the drafter restarted: rebuild it from the verifier's features
            c, sp = by_id[rid]
            committed = c.prompt_ids + c.token_ids
            feats = await verifier.features(tags[rid])
            seen.handles.append(feats)
            assert await drafter.prefill([DrafterPrefillItem(tags[rid], committed[:-1], committed[-1], sp,
                                                             seeds[rid], feats)]) == []
            seen.resynced.append(rid)
    while active:
        held = [next_trees.get(r) for r in active]
        if not all(tags[r].committed_len - 1 + lookahead <= max_len for r in active):
            draft, plain = None, [PlainItem(tags[r], by_id[r][0].token_ids[-1]) for r in active]
        elif all(t is not None and t[0] == tags[r].committed_len for t, r in zip(held, active)):
            # Every request hit: verify the outcome trees DraftAhead returned, as the router does.
            draft = drafter.ready_handle(trees_from_ready(active, [tags[r].committed_len for r in active],
                                                          [t[1] for t in held]), [tags[r] for r in active])
            plain = []
            seen.ready += len(active)
        else:
            if catch_up and not with_draft:   # the drafter must be in step before it drafts
                await resync(await drafter.extend(catch_up))
                catch_up = []
            draft, plain = await drafter.draft([tags[r] for r in active], None, catch_up), []
            assert draft.unknown == [] and draft.tags == [tags[r] for r in active]
            catch_up = []
            seen.handles.append(draft.payload)
        if draft is None and catch_up:
            await resync(await drafter.extend(catch_up))
            catch_up = []
        next_trees, tables = {}, {}
        if ahead and draft is not None:
            # An all-hit verdict's catch-up rides with DraftAhead, as the router sends it.
            results, reply = await asyncio.gather(verifier.verify(draft, plain, want_features=True),
                                                  drafter.draft_ahead(list(draft.tags), catch_up))
            if catch_up:
                seen.merged += 1
            catch_up = []
            await resync(reply.unknown)
            flags = reply.hits
            tables = {t.request_id: trees for t, trees in zip(draft.tags, reply.trees) if trees}
            seen.ahead += flags
        else:
            results = await verifier.verify(draft, plain, want_features=True)
        still, done = [], []
        for res in results:
            rid = res.tag.request_id
            hit = tables.get(rid, {}).get(tuple(res.token_ids))
            if hit is not None:
                next_trees[rid] = (res.tag.committed_len, hit)
            c, sp = by_id[rid]
            seen.handles.append(res.features)
            seen.results.append(res)
            tags[rid] = res.tag
            c.stats.num_rounds += 1
            c.stats.draft_tokens += res.num_draft_tokens
            c.stats.accepted_tokens += res.num_accepted
            _append(c, res.token_ids, sp, eos, res.tag.committed_len, max_len)
            (still if c.finish_reason is None else done).append(res)
        if done:
            ids_done = [r.tag.request_id for r in done]
            await verifier.release(ids_done)
            await drafter.release(ids_done)
        if before_extend is not None:
            await before_extend(round_no)
        items = [ExtendItem(r.tag, r.token_ids, r.features) for r in still]
        if items and ahead and before_extend is None and all(r.tag.request_id in next_trees for r in still):
            catch_up = items
        elif items and with_draft and not ahead and before_extend is None and all(
                tags[r.tag.request_id].committed_len - 1 + lookahead <= max_len for r in still):
            catch_up = items   # the next round drafts every one of them
        else:
            await resync(await drafter.extend(items))
        active = [r.tag.request_id for r in still]
        round_no += 1
    return [by_id[rid][0] for rid in ids]


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS) for _ in range(n)]


def _assert_only_refs(seen: Seen):
    assert seen.handles and all(isinstance(h, ray.ObjectRef) for h in seen.handles), \
        [type(h) for h in seen.handles if not isinstance(h, ray.ObjectRef)]
    for r in seen.results:
        assert not any(isinstance(v, torch.Tensor) for v in vars(r).values()), r


@pytest.mark.parametrize("with_draft", [False, True], ids=["extend-calls", "catch-up-with-draft"])
def test_greedy_through_ray_equals_local(engines, local, prompts, with_draft):
    verifier, drafter = engines
    expected = local.generate(prompts, _greedy(len(prompts)))
    seen = Seen()
    got = asyncio.run(speculate(verifier, drafter, prompts, _greedy(len(prompts)), local.eos_token_ids,
                                local.lookahead, seen, with_draft=with_draft))
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.token_ids == e.token_ids, f"prompt {i}: {g.token_ids} != {e.token_ids}"
        assert g.finish_reason == e.finish_reason
        assert g.stats.as_dict() == e.stats.as_dict()  # the same drafts were made and accepted
    assert sum(g.stats.accepted_tokens for g in got) > 0
    _assert_only_refs(seen)
    infos = asyncio.run(_infos(verifier, drafter))
    assert [i.used_slots for i in infos] == [0, 0]  # every request released on both sides


def test_draft_ahead_through_ray_equals_local(engines, local, prompts):
    """DraftAhead on the actor, overlapped with the verify: the in-process loop's tokens and
    outcome-cache hits (all-hit rounds verify the outcome trees the actor returned, no draft
    call), and the drafter's KV back to empty."""
    verifier, drafter = engines
    expected = local.generate(prompts, _greedy(len(prompts)), ahead=True)
    seen = Seen()
    got = asyncio.run(speculate(verifier, drafter, prompts, _greedy(len(prompts)), local.eos_token_ids,
                                local.lookahead, seen, ahead=True))
    assert [g.token_ids for g in got] == [e.token_ids for e in expected]
    assert [g.stats.as_dict() for g in got] == [e.stats.as_dict() for e in expected]  # the same trees
    assert seen.ahead.count(True) > 0 and seen.ahead.count(False) > 0
    assert seen.ready > 0   # rounds whose every request hit went out with the trees DraftAhead returned
    assert seen.merged > 0  # ... and their catch-up went with that round's DraftAhead
    infos = asyncio.run(_infos(verifier, drafter))
    assert infos[1].used_slots == 0 and infos[1].kv["used_blocks"] == 0
    # Each actor reports the calls it ran and the time inside them (spectandem/call_clock.py).
    for info, kinds in zip(infos, ({"prefill", "verify"}, {"prefill", "draft_ahead"})):
        assert kinds <= set(info.calls["count"]), info.calls
        assert all(info.calls["count"][k] > 0 and info.calls["busy_s"][k] > 0 for k in kinds), info.calls


async def _infos(verifier, drafter):
    return await verifier.info(), await drafter.info()


def test_both_actors_in_one_placement_group(engines):
    vinfo, dinfo = asyncio.run(_infos(*engines))
    assert vinfo.feature_layers == dinfo.feature_layers is not None
    pg_id = vinfo.extra["placement_group_id"]
    assert pg_id is not None and dinfo.extra["placement_group_id"] == pg_id
    pg = ray.util.placement_group_table()[pg_id]
    assert pg["strategy"] == "PACK" and list(pg["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]


def test_each_actor_runs_on_the_cores_it_was_given(engines):
    """start_engines' cpu_cores (serve --cpu-bind): every thread of each actor's process, those
    Ray started before the actor was built and those started after its calls included, runs on its
    cores only once a prefill of 40 tokens came after one of 5; one_thread_up_to: the verifier counts
    the first, a forward of at most that many tokens, as run on one thread (on the drafter's cores,
    one_thread_cores), not the second."""
    verifier, drafter = engines

    async def prefill(n: int) -> int:
        rid = f"cores-{n}"
        await verifier.prefill([VerifierPrefillItem(Tag(rid, 0, n), list(range(1, n + 1)), SamplingParams(), 0)],
                               want_features=False)
        await verifier.release([rid])
        return (await verifier.info()).extra.get("one_thread_forwards", 0)

    before = asyncio.run(_infos(*engines))[0].extra.get("one_thread_forwards", 0)
    assert asyncio.run(prefill(5)) == before + 1
    assert asyncio.run(prefill(SMALL + 8)) == before + 1
    vinfo, dinfo = asyncio.run(_infos(*engines))
    for info, role in ((vinfo, "verifier"), (dinfo, "drafter")):
        threads = {t: os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{info.extra['pid']}/task")}
        assert len(threads) > 1
        assert threads == {t: set(CORES[role]) for t in threads}, role


def test_errors_map_to_link_errors(engines):
    verifier, drafter = engines

    async def run():
        with pytest.raises(StaleMessage, match="not active on the verifier") as stale:
            await verifier.verify(None, [PlainItem(Tag("nobody", 0, 3), 1)], want_features=False)
        assert type(stale.value) is StaleMessage  # the engine's own exception, not Ray's wrapper
        with pytest.raises(StaleMessage, match="not active on the drafter") as stale:
            await drafter.draft_ahead([Tag("nobody", 0, 3)])
        assert type(stale.value) is StaleMessage
        # A draft for a request the drafter does not hold reports it unknown (the router resyncs it).
        handle = await drafter.draft([Tag("nobody", 0, 3)])
        assert handle.unknown == ["nobody"] and handle.tags == [] and handle.payload is None
        with pytest.raises(EngineUnavailable, match="did not answer"):
            await RayVerifierLink(verifier.actor, call_timeout_s=1e-6).info()

    asyncio.run(run())


def test_drafter_crash_restarts_empty_and_resyncs(engines, local, prompts):
    verifier, drafter = engines
    expected = local.generate(prompts[:2], _greedy(2))
    before = asyncio.run(drafter.info()).extra["pid"]
    outcome = {}

    async def crash_once(round_no):
        if round_no != 1:
            return
        ray.kill(drafter.actor, no_restart=False)
        # The kill lands asynchronously: poll until a call fails, then until the new one answers.
        deadline = time.monotonic() + 30
        while "error" not in outcome:
            assert time.monotonic() < deadline, "the killed drafter kept answering"
            try:
                await drafter.ping()
                await asyncio.sleep(0.05)
            except EngineUnavailable as exc:
                outcome["error"] = exc
        while "info" not in outcome:
            assert time.monotonic() < deadline, "the drafter did not come back"
            try:
                outcome["info"] = await drafter.info()
            except EngineUnavailable:
                await asyncio.sleep(0.2)

    seen = Seen()
    got = asyncio.run(speculate(verifier, drafter, prompts[:2], _greedy(2), local.eos_token_ids, local.lookahead,
                                seen, before_extend=crash_once))
    assert isinstance(outcome["error"], EngineUnavailable)
    info = outcome["info"]
    assert info.extra["pid"] != before and info.used_slots == 0  # a new process, empty
    assert info.extra["placement_group_id"] == asyncio.run(verifier.info()).extra["placement_group_id"]
    assert seen.resynced == ["req-0", "req-1"]  # extend named both as unknown
    for g, e in zip(got, expected):
        assert g.token_ids == e.token_ids
    _assert_only_refs(seen)
