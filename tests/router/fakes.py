"""Fake engines for router-logic tests: an oracle verifier and a scripted drafter, implementing
the link protocols of router/links.py with no model, so a test of the router's loop runs in
milliseconds.

The oracle verifier's "target model" is a deterministic function of the context (`oracle`). A
verify accepts the draft chain's tokens while they equal the oracle's, then adds the oracle's
next token (the bonus): greedy speculative decoding, so the committed tokens are exactly
`reference(prompt, ...)` whatever the drafts were.

The scripted drafter keeps each request's context (prompt, first token, catch-ups) and drafts
what `propose(context, depth)` says; `mode` makes every call answer ("ok"), raise
EngineUnavailable ("fail") or never return ("hang"). Both fakes record what went out of step
(`errors`): a draft or catch-up for a context the router has not committed, a verify of a tag
that is not the request's.

`TreeBox` stands for the tree channel between them (spectandem/channel/trees.py): a drafter
given one posts the trees of a draft call with a `post_round` there (None on failure, as the
real drafter's NONE frame), and the verifier takes them for a verify whose payload is a
TreeRoute, waiting at most its `wait_s` (not at all when the box is `down`: no drafter connected).
"""

from __future__ import annotations

import asyncio

from router.links import EngineUnavailable
from spectandem.protocol import AheadReply, DraftHandle, EngineInfo, Tag, TreeRoute, Verdict, VerifierPrefillResult

VOCAB = 64


def oracle(context: list[int]) -> int:
    """The target model's next token after `context`: a hash of its length and last three tokens."""
    h = len(context)
    for t in context[-3:]:
        h = (h * 131 + t * 7 + 17) % 1_000_003
    return (h * 2_654_435_761 >> 9) % VOCAB


def continuation(context: list[int], n: int) -> list[int]:
    ctx, out = list(context), []
    for _ in range(n):
        out.append(oracle(ctx))
        ctx.append(out[-1])
    return out


def reference(prompt: list[int], max_tokens: int, eos: tuple[int, ...] = (), max_len: int = 10 ** 9) -> list[int]:
    """The tokens greedy decoding of the oracle commits: up to and including an eos token, at
    most max_tokens, within the context."""
    ctx, out = list(prompt), []
    while len(out) < max_tokens and len(ctx) < max_len:
        t = oracle(ctx)
        out.append(t)
        ctx.append(t)
        if t in eos:
            break
    return out


class Tokenizer:
    """One character per token id: 'a' + id % 26."""

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(ord("a") + i % 26) for i in ids)


class TreeBox:
    def __init__(self):
        self.trees: dict[int, object] = {}   # round -> (tags, chains), or None: no tree
        self.down = False                    # no drafter connected: takes do not wait, posts fail
        self.taken: list[int] = []           # rounds whose trees a verify took
        self._posted = asyncio.Event()

    def post(self, round_id: int, tree) -> bool:
        if self.down:
            return False
        self.trees[round_id] = tree
        self._posted.set()
        return True

    async def take(self, route: TreeRoute):
        """-> (tags, chains) or None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + route.wait_s
        while route.round_id not in self.trees and not self.down and loop.time() < deadline:
            self._posted.clear()
            try:
                await asyncio.wait_for(self._posted.wait(), max(0.0, deadline - loop.time()))
            except asyncio.TimeoutError:
                break
        tree = self.trees.get(route.round_id)
        if tree is not None:
            self.taken.append(route.round_id)
        return tree


class OracleVerifier:
    def __init__(self, trees: TreeBox | None = None):
        self.trees = trees
        self.ctx: dict[str, list[int]] = {}      # request id -> its committed tokens (KV) here
        self.epoch: dict[str, int] = {}
        self.down = False                        # every call raises EngineUnavailable
        self.refuse: set[str] = set()            # ids whose prefill it refuses (ValueError)
        self.errors: list[str] = []
        self.verifies = 0
        self.hold = None                         # a callable: verify waits while it returns True
        self.mixed: list[list[str]] = []         # the request ids of each verify_prefill

    def _check(self) -> None:
        if self.down:
            raise EngineUnavailable("the verifier is down")

    async def prefill(self, items, want_features):
        self._check()
        if any(i.tag.request_id in self.refuse for i in items):
            raise ValueError("refused")
        out = []
        for it in items:
            rid = it.tag.request_id
            if rid in self.ctx:
                self.errors.append(f"prefill of {rid}, which it holds")
            ctx = self.ctx[rid] = list(it.prompt_ids)
            self.epoch[rid] = it.tag.epoch
            first = -1
            if not it.resume:
                first = oracle(ctx)
                ctx.append(first)
            elif len(ctx) != it.tag.committed_len:
                self.errors.append(f"resume of {rid} at {it.tag.committed_len} with {len(ctx)} tokens")
            tag = Tag(rid, it.tag.epoch, len(ctx))
            out.append(VerifierPrefillResult(tag, first, ("features", rid, len(ctx)) if want_features else None))
        return out

    def _round(self, tag: Tag, chain: list[int], steps: int, want_features: bool) -> Verdict:
        rid = tag.request_id
        ctx = self.ctx.get(rid)
        if ctx is None or len(ctx) != tag.committed_len or self.epoch[rid] != tag.epoch:
            self.errors.append(f"verify of {tag} against {None if ctx is None else len(ctx)} tokens")
            ctx = self.ctx.setdefault(rid, [])
        accepted = 0
        for t in chain:
            if t != oracle(ctx):
                break
            ctx.append(t)
            accepted += 1
        tokens = chain[:accepted] + continuation(ctx, steps)
        ctx += tokens[accepted:]
        return Verdict(Tag(rid, tag.epoch, len(ctx)), tokens, accepted, len(chain),
                           ("features", rid, len(ctx)) if want_features else None)

    async def verify(self, draft, plain, want_features, on_launch=None):
        self._check()
        while self.hold is not None and self.hold():
            await asyncio.sleep(0.001)
        self.verifies += 1
        if on_launch is not None:
            on_launch()
        out = []
        if draft is not None and isinstance(draft.payload, TreeRoute):
            tree = await self.trees.take(draft.payload) if self.trees is not None else None
            draft = None if tree is None else DraftHandle(*tree)
        if draft is not None:
            out += [self._round(tag, draft.payload[tag.request_id], 1, want_features) for tag in draft.tags]
        out += [self._round(item.tag, [], item.steps, want_features) for item in plain]
        await asyncio.sleep(0)
        return out

    async def verify_prefill(self, draft, plain, want_features, items, prefill_features, on_launch=None):
        """`prefill` of the items, then `verify`, as one call (a verifier carrying prefills in its step)."""
        self.mixed.append([i.tag.request_id for i in items])
        prefilled = await self.prefill(items, prefill_features)
        return await self.verify(draft, plain, want_features, on_launch), prefilled

    async def features(self, tag):
        self._check()
        return ("features", tag.request_id, tag.committed_len)

    async def release(self, request_ids):
        self._check()
        for rid in request_ids:
            self.ctx.pop(rid, None)

    async def info(self):
        self._check()
        return EngineInfo("verifier", "oracle", "fake", VOCAB, 4096, 64, len(self.ctx))

    async def close(self):
        pass


class ScriptedDrafter:
    def __init__(self, propose=None, depth: int = 4, trees: TreeBox | None = None):
        self.trees = trees
        # propose(context, depth) -> the draft chain; by default the oracle's own tokens (all accepted)
        self.propose = propose or continuation
        self.depth = depth
        self.ctx: dict[str, list[int]] = {}
        self.mode = "ok"                       # "ok" | "fail" | "hang"
        self.stale = False                     # draft answers with tags of another round
        self.errors: list[str] = []
        self.calls: list[str] = []

    async def _gate(self, name: str) -> None:
        self.calls.append(name)
        if self.mode == "fail":
            raise EngineUnavailable("the drafter is down")
        if self.mode == "hang":
            await asyncio.Event().wait()

    def _in_step(self, tag: Tag, what: str) -> list[int] | None:
        ctx = self.ctx.get(tag.request_id)
        if ctx is not None and len(ctx) != tag.committed_len:
            self.errors.append(f"{what} of {tag} with {len(ctx)} tokens")
        return ctx

    async def prefill(self, items):
        await self._gate("prefill")
        for it in items:
            self.ctx[it.tag.request_id] = list(it.prompt_ids) + [it.first_token_id]
            self._in_step(it.tag, "prefill")
        return []

    async def draft(self, tags, num_steps=None, extend=(), post_round=0):
        try:
            await self._gate("draft")
        except EngineUnavailable:
            if post_round and self.trees is not None:
                self.trees.post(post_round, None)   # the draft failed: no tree for that round
            raise
        handle = await self._draft(tags, num_steps, extend)
        if not post_round:
            return handle
        if self.trees is None or not self.trees.post(post_round, (handle.tags, handle.payload) if handle.tags else None):
            return handle
        return DraftHandle(handle.tags, None, handle.unknown, posted=True)

    async def _draft(self, tags, num_steps, extend):
        unknown = await self._absorb(extend)
        keep = [i for i, t in enumerate(tags) if t.request_id not in unknown]
        tags, num_steps = [tags[i] for i in keep], [num_steps[i] for i in keep] if num_steps else None
        chains = {}
        for i, tag in enumerate(tags):
            ctx = self._in_step(tag, "draft")
            if ctx is None:
                self.errors.append(f"draft of {tag}, which it does not hold")
                ctx = []
            depth = self.depth if num_steps is None or num_steps[i] is None else min(self.depth, num_steps[i])
            chains[tag.request_id] = list(self.propose(list(ctx), depth))[:depth]
        if self.stale:
            tags = [Tag(t.request_id, t.epoch, t.committed_len - 1) for t in tags]
        return DraftHandle(list(tags), chains if tags else None, unknown)

    async def _absorb(self, items) -> list[str]:
        unknown = []
        for it in items:
            ctx = self.ctx.get(it.tag.request_id)
            if ctx is None:
                unknown.append(it.tag.request_id)
                continue
            ctx += it.token_ids
            self._in_step(it.tag, "catch-up")
        return unknown

    async def draft_ahead(self, tags, extend=()):
        await self._gate("draft_ahead")
        unknown = await self._absorb(extend)
        return AheadReply([None] * len(tags), [None] * len(tags), unknown)

    def ready_handle(self, tree, tags):
        raise AssertionError("the scripted drafter fills no outcome cache")

    async def extend(self, items):
        await self._gate("extend")
        return await self._absorb(items)

    async def release(self, request_ids, keep_draft=False, outputs=None):
        await self._gate("release")
        for rid in request_ids:
            self.ctx.pop(rid, None)

    async def info(self):
        await self._gate("info")
        extra = {"tree_channel": "connecting" if self.trees.down else "up"} if self.trees is not None else {}
        return EngineInfo("drafter", "scripted", "fake", VOCAB, 4096, 64, len(self.ctx), extra=extra)

    async def close(self):
        pass
