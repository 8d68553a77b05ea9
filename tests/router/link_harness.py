"""The round protocol over the engine links, for the link tests: the demo prompts and tree, the
in-process reference (LocalSpeculator), prefill -> (draft -> verify -> extend)* over a verifier
and a drafter link, the comparison of completions, and engine entry points started as
subprocesses (one server, or the verifier and drafter pair)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from spectandem.protocol import (DraftHandle, DrafterPrefillItem, ExtendItem, PlainItem, Tag, TreeRoute,
                                 VerifierPrefillItem)
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.messages import trees_from_ready
from router.local import LocalSpeculator
from spectandem.reference import LocalCompletion, _append

ROOT = Path(__file__).resolve().parents[2]
PROMPT_TEXTS = ["def fibonacci(n):\n", "class Queue:\n    def __init__(self", "import os\nimport sys\n\n",
                "    for i in range(len("]
MAX_TOKENS = 24
MAX_LEN = 256
TREE = dict(num_steps=4, topk=2, num_draft_tokens=8)


def _greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=MAX_TOKENS) for _ in range(n)]


def _local(method: str, prompts, *param_lists, ahead: bool = False) -> tuple[list[list[LocalCompletion]], tuple[int, ...], int]:
    """The in-process reference: completions for each list of params, eos ids, lookahead."""
    target, draft = demo_paths(method)
    spec = LocalSpeculator(target, draft, SpecConfig(method=method, **TREE), max_slots=4, max_len=MAX_LEN)
    return [spec.generate(prompts, ps, ahead=ahead) for ps in param_lists], spec.eos_token_ids, spec.lookahead


def _seeded(n: int) -> list[SamplingParams]:
    """Sampled drafts: their q crosses the wire and the verifier runs rejection sampling.
    (Temperature 1.0 is exact in the wire's float32.)"""
    return [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i) for i in range(n)]


# ----------------------------------------------------------------------------------------------
# A started Router in-process


async def collect(router, prompt: list[int], params: SamplingParams):
    """Submits one request to a started Router -> (its tokens, the ServedRequest), once finished."""
    req = router.submit(prompt, params)
    toks = []
    while True:
        ev = await req.events.get()
        toks += ev.token_ids
        if ev.finish_reason:
            return toks, req


async def drained(spec, tries: int = 50) -> None:
    """Waits (at most tries x 20 ms) until neither of the speculator's engines holds a request."""
    for _ in range(tries):
        if not spec.drafter.requests and not spec.verifier.requests:
            return
        await asyncio.sleep(0.02)


# ----------------------------------------------------------------------------------------------
# The round protocol over links (what the router does, without its scheduling)


async def speculate(vlink, dlink, prompts, params, eos: tuple[int, ...], lookahead: int,
                    plain_rounds=lambda rid, n: False, ahead: list | None = None,
                    ready: list | None = None, with_draft: bool = False,
                    posted: list | None = None) -> list[LocalCompletion]:
    """prefill -> (draft -> verify -> extend)* for a batch, as spectandem.reference.generate does.
    `plain_rounds(request_id, round)` True sends that request as a plain row (no draft).
    `ahead` (a list): DraftAhead on each round's trees, overlapped with their verify; the hit
    flags are appended to it. With it, a round whose every drafted request hit verifies the
    outcome trees DraftAhead returned (`ready_handle`, no Draft call), as the router does; the
    number of such rounds is appended to `ready` (a list) if given. `with_draft`: a round's
    catch-up is held back and goes with the next Draft call (as the router's sequential rounds
    send it) instead of its own Extend call. `posted` (a list; not with `ahead`): each round's
    Draft and Verify go out together, the trees over the tree channel (the Draft's `post_round`,
    the verify's TreeRoute), as the router's rounds send them with one; the tags of each
    round's posted trees are appended to it."""
    max_len = (await vlink.info()).max_len
    ids = [f"req-{i}" for i in range(len(prompts))]
    seeds = [p.resolved_seed() for p in params]
    comps = {rid: LocalCompletion(rid, list(p)) for rid, p in zip(ids, prompts)}
    sp = dict(zip(ids, params))
    results = await vlink.prefill([VerifierPrefillItem(Tag(rid, 0, len(p)), p, s, seed)
                                   for rid, p, s, seed in zip(ids, prompts, params, seeds)], want_features=True)
    absorb = []
    for r, p, seed in zip(results, prompts, seeds):
        rid = r.tag.request_id
        _append(comps[rid], [r.first_token_id], sp[rid], eos, r.tag.committed_len, max_len)
        if comps[rid].finish_reason is None:
            absorb.append(DrafterPrefillItem(r.tag, p, r.first_token_id, sp[rid], seed, r.features))
    assert await dlink.prefill(absorb) == []
    active = [i.tag for i in absorb]
    pending = None            # a posting round's Draft call, sent with its Verify
    next_trees: dict = {}     # request -> (committed_len, ReadyTree) from the last DraftAhead
    catch_up: list = []       # an all-hit verdict's catch-up, held back for the next DraftAhead
    n = 0
    while active:
        room = all(t.committed_len - 1 + lookahead <= max_len for t in active)
        drafted = [t for t in active if room and not plain_rounds(t.request_id, n)]
        plain = [PlainItem(t, comps[t.request_id].token_ids[-1]) for t in active if t not in drafted]
        held = [next_trees.get(t.request_id) for t in drafted]
        if drafted and all(t is not None and t[0] == tag.committed_len for t, tag in zip(held, drafted)):
            draft = dlink.ready_handle(trees_from_ready([t.request_id for t in drafted],
                                                        [t.committed_len for t in drafted], [t[1] for t in held]),
                                       drafted)
            if ready is not None:
                ready.append(len(drafted))
        else:
            if catch_up and not (with_draft and drafted):   # the drafter must be in step before it drafts
                assert await dlink.extend(catch_up) == []
                catch_up = []
            if posted is not None and drafted:
                pending = dlink.draft(drafted, None, catch_up, post_round=1000 + n)
                draft = DraftHandle(list(drafted), TreeRoute(1000 + n, 60.0))
            else:
                draft = await dlink.draft(drafted, None, catch_up) if drafted else None
                if draft is not None:
                    assert draft.unknown == [] and draft.tags == drafted
            catch_up = []
        next_trees = {}
        tables = {}
        if ahead is not None and draft is not None:
            # The last verdict's catch-up, if held back, rides with DraftAhead (as the router sends it).
            outs, reply = await asyncio.gather(vlink.verify(draft, plain, want_features=True),
                                               dlink.draft_ahead(drafted, catch_up))
            assert reply.unknown == []
            catch_up = []
            ahead += reply.hits
            tables = {t.request_id: trees for t, trees in zip(drafted, reply.trees) if trees}
        elif pending is not None:
            reply, outs = await asyncio.gather(pending, vlink.verify(draft, plain, want_features=True))
            assert reply.posted and reply.payload is None and reply.unknown == [] and reply.tags == drafted
            posted.append(reply.tags)
        else:
            outs = await vlink.verify(draft, plain, want_features=True)
        pending = None
        for o in outs:
            hit = tables.get(o.tag.request_id, {}).get(tuple(o.token_ids))
            if hit is not None:
                next_trees[o.tag.request_id] = (o.tag.committed_len, hit)
        assert [o.tag.request_id for o in outs] == [t.request_id for t in drafted] + [p.tag.request_id for p in plain]
        still = []
        for o in outs:
            c = comps[o.tag.request_id]
            c.stats.num_rounds += 1
            c.stats.draft_tokens += o.num_draft_tokens
            c.stats.accepted_tokens += o.num_accepted
            _append(c, o.token_ids, sp[c.request_id], eos, o.tag.committed_len, max_len)
            if c.finish_reason is None:
                still.append(o)
            else:
                await vlink.release([c.request_id])
                await dlink.release([c.request_id])
        items = [ExtendItem(o.tag, o.token_ids, o.features) for o in still]
        if items and ahead is not None and all(o.tag.request_id in next_trees for o in still):
            catch_up = items           # every request hit: its catch-up goes with the next DraftAhead
        elif items and with_draft and ahead is None:
            catch_up = items           # it goes with the next Draft
        elif items:
            assert await dlink.extend(items) == []
        active = [o.tag for o in still]
        n += 1
    await vlink.release(ids)
    return [comps[rid] for rid in ids]


def _assert_same(got: list[LocalCompletion], expected: list[LocalCompletion], same_stats: bool = True):
    for i, (g, e) in enumerate(zip(got, expected)):
        assert g.token_ids == e.token_ids, f"prompt {i}"
        assert g.finish_reason == e.finish_reason
        if same_stats:
            assert g.stats == e.stats, f"prompt {i}: {g.stats} != {e.stats}"
    assert sum(g.stats.accepted_tokens for g in got) > 0  # speculation really happened


# ----------------------------------------------------------------------------------------------
# Engine entry points in subprocesses


def _spawn(args: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """Starts a server on a free port; returns it and its address once it prints it."""
    # The repository first, then whatever path this process was given (packages installed
    # outside site-packages, as on the GPU image).
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path)
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, *args, "--host", "127.0.0.1", "--port", "0"], cwd=ROOT, env=env,
                                stdout=subprocess.PIPE, stderr=err, text=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.5)
        if ready:
            line = proc.stdout.readline()
            if "listening on " in line:
                return proc, line.rsplit("listening on ", 1)[1].strip()
        if proc.poll() is not None:
            break
    _stop(proc)
    raise AssertionError(f"{args} did not start:\n{log.read_text()[-3000:]}")


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    proc.stdout.close()


@contextlib.contextmanager
def spawn_pair(logs: Path, flags: Sequence[str] = ()) -> Iterator[tuple[str, str]]:
    """`python -m verifier` and `python -m drafter` without model flags (the demo EAGLE-3 pair; the
    verifier derives its feature layers from the head's config), 4 slots of MAX_LEN, the drafter
    drafting TREE, `flags` passed to both; logs in logs/v.log and logs/d.log. Yields (verifier
    address, drafter address); both are stopped on exit."""
    tree = ["--num-steps", str(TREE["num_steps"]), "--topk", str(TREE["topk"]),
            "--num-draft-tokens", str(TREE["num_draft_tokens"])]
    procs = []
    try:
        procs.append(_spawn(["-m", "verifier", "--max-slots", "4", "--max-len", str(MAX_LEN), *flags],
                            logs / "v.log"))
        procs.append(_spawn(["-m", "drafter", "--max-slots", "4", "--max-len", str(MAX_LEN), *tree, *flags],
                            logs / "d.log"))
        yield tuple(a for _, a in procs)
    finally:
        for p, _ in procs:
            _stop(p)
