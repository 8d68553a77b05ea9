"""Drafting on the verdict: a drafter that gets a round's verdicts straight from the verifier (in
this process from the verifier's worker thread, router/links_local.py; from another process over
the tree channel, spectandem/channel/trees.py) catches up with them and drafts the next trees at
once, while the router is still committing the round. A router draft call sent with the same
catch-up then finds those trees made:

    verifier: verify R ---- verdicts (tags, tokens, features) ----> drafter: catch up, draft R+1  (made)
              reply R ----> router: commit R, Draft(tags R+1, catch-up R) --> drafter: the made trees

The drafter also posts them to the verifier at once (early trees, spectandem/channel/trees.py:
an EARLY frame across processes, TreeHandOff.post_early in one), and where they serve the round
the router makes no draft call (router/loop.py `_sequential_round`): the round's catch-up was
absorbed on the verdicts.

A round that prefilled new requests in its verify step sends their drafter prefills with its
verdicts (the router names them in `draft_next`): the drafter prefills them first and drafts their
first trees with the others', so the next round's early trees hold them too, where a prefill call
of the router's would come once the drafter was done with the verdicts.

Every call of the drafter goes through one NextTrees, in the engine's one-at-a-time order
(a link's worker thread, a service's engine lock, an actor's lock): the catch-ups it absorbed
on a verdict are left out of the router's later calls once (`unabsorbed`), and a draft call
takes the made tree of a tag only where nothing is left to catch up for it and no depth cap
is asked; the rest are drafted as without it. A verdict that no longer follows the drafter's
state (the router's draft call came first, the request was released) changes nothing.
"""

from __future__ import annotations

import logging

from collections import OrderedDict

from drafter.service_core import drafter_draft, drafter_extend, drafter_extend_and_draft, drafter_prefill
from spectandem.call_clock import CallClock, timed
from spectandem.messages import DraftTree, concat_trees
from spectandem.protocol import DrafterPrefillItem, ExtendItem, Tag

log = logging.getLogger("spectandem.drafter")
RELEASED_KEEP = 4096   # ids of released requests remembered, that a prefill with a verdict still on its way skips


class NextTrees:
    def __init__(self):
        # The trees made on the last verdicts (request id -> (its tag, the DraftTree holding its
        # row)), for the next draft call only, and the verdicts caught up with (request id -> the
        # verdict's tag), each left out of the router's next call that carries it again.
        self._made: dict[str, tuple[Tag, DraftTree]] = {}
        self._absorbed: dict[str, Tag] = {}
        # The latest released ids (`released`): a drafter prefill that comes with a verdict after
        # its request was released (it ended at its first token) is not taken.
        self._released: OrderedDict[str, None] = OrderedDict()
        self.made = self.taken = self.prefilled = 0

    def draft_on(self, engine, items: list[ExtendItem], bounds: dict[str, int], receiver=None,
                 clock: CallClock | None = None, post=None, prefills: list[DrafterPrefillItem] = ()) -> None:
        """Prefills `prefills` (the requests the round prefilled in its verify step, as the router's
        prefill would carry them), catches up with a round's verdicts (`items`, as the router's
        catch-up would carry them) and drafts the next trees of the requests whose new committed
        length is below `bounds[request id]`; `post(trees, tags)`, if given, sends them on as they
        are made (the tree channel's early trees: the draft call that takes them hands out the same
        rows), and `post(None, [])` where none are made. A verdict that does not follow the
        drafter's state, or a draft that fails, leaves the work to the router's next call; a
        prefill that fails, or whose request the drafter holds already or released, is not taken
        (the router's next call finds it unknown, and its resync prefills it)."""
        self._made = {}
        new = self._prefill(engine, prefills, receiver, clock) if prefills else []
        unknown = set()
        if items:
            try:
                with timed(clock, "draft_next.catch_up"):   # its parts: "draft_next.features", ".absorb"
                    unknown = set(drafter_extend(engine, items, receiver, clock, call="draft_next"))
            except Exception as exc:   # checked before anything changed (drafter_extend)
                log.debug("verdicts not caught up ahead of the draft call: %s", exc)
                items = []
        for i in items:
            if i.tag.request_id not in unknown:
                self._absorbed[i.tag.request_id] = i.tag
        tags = [i.tag for i in items
                if i.tag.request_id not in unknown and i.tag.committed_len < bounds.get(i.tag.request_id, 0)]
        tags += [t for t in new if t.committed_len < bounds.get(t.request_id, 0)]
        if not tags:
            self._post_none(post)
            return
        try:
            with timed(clock, "draft_next.engine"):
                tree = drafter_draft(engine, tags)
        except Exception as exc:   # the draft call drafts them again and reports what fails then
            log.debug("next trees not drafted ahead of the draft call: %s", exc)
            self._post_none(post)
            return
        self._made = {t.request_id: (t, tree) for t in tags}
        self.made += len(tags)
        if post is not None:
            try:
                post(tree, tags)
            except Exception as exc:   # the router's next round drafts them with a draft call
                log.debug("next trees not sent early: %s", exc)

    @staticmethod
    def _post_none(post) -> None:
        """`post(None, [])`: none are made on these verdicts, so a verify that takes only the early
        trees (no draft call comes for its round) goes on without them at once."""
        if post is not None:
            try:
                post(None, [])
            except Exception as exc:
                log.debug("no early trees, and that not sent: %s", exc)

    def _prefill(self, engine, prefills: list[DrafterPrefillItem], receiver, clock: CallClock | None) -> list[Tag]:
        """`draft_on`'s prefills, less those of requests held or released -> the tags taken."""
        todo = [p for p in prefills if p.tag.request_id not in engine.requests and p.tag.request_id not in self._released]
        if not todo:
            return []
        try:
            with timed(clock, "draft_next.prefill"):
                self.forget([p.tag.request_id for p in todo])
                missing = set(drafter_prefill(engine, todo, receiver))
        except Exception as exc:
            log.debug("prefills with the verdicts not taken: %s", exc)
            for p in todo:   # none half-held
                engine.remove(p.tag.request_id, keep_draft=False)
            return []
        taken = [p.tag for p in todo if p.tag.request_id not in missing]
        self.prefilled += len(taken)
        return taken

    def released(self, request_ids) -> None:
        """The requests were released: `forget` them, and a prefill of theirs with a verdict
        still on its way is not taken."""
        self.forget(request_ids)
        for rid in request_ids:
            self._released[rid] = None
            self._released.move_to_end(rid)
        while len(self._released) > RELEASED_KEEP:
            self._released.popitem(last=False)

    def unabsorbed(self, items) -> list[ExtendItem]:
        """`items` less the verdicts `draft_on` caught up with (each left out once)."""
        if not self._absorbed:
            return list(items)
        out = []
        for i in items:
            if self._absorbed.get(i.tag.request_id) == i.tag:
                del self._absorbed[i.tag.request_id]
            else:
                out.append(i)
        return out

    def forget(self, request_ids) -> None:
        """The requests left the drafter (released) or come again (prefilled)."""
        for rid in request_ids:
            self._made.pop(rid, None)
            self._absorbed.pop(rid, None)

    @property
    def empty(self) -> bool:
        return not self._made and not self._absorbed

    def extend_and_draft(self, engine, tags: list[Tag], num_steps, extend: list[ExtendItem], receiver=None,
                         clock: CallClock | None = None) -> tuple[DraftTree | None, list[Tag], list[str]]:
        """drafter_extend_and_draft, taking the trees made for these very tags (of the configured
        depth, with nothing left to catch up first) rather than drafting them again."""
        extend = self.unabsorbed(extend)
        made, self._made = self._made, {}
        pending = {i.tag.request_id for i in extend}
        take = [made.get(t.request_id, (None,))[0] == t and t.request_id not in pending
                and not (num_steps and num_steps[k]) for k, t in enumerate(tags)]
        if not any(take):
            return drafter_extend_and_draft(engine, tags, num_steps, extend, receiver, clock)
        rest = [k for k, ok in enumerate(take) if not ok]
        tree, _, unknown = (drafter_extend_and_draft(engine, [tags[k] for k in rest],
                                                     [num_steps[k] for k in rest] if num_steps else None, extend,
                                                     receiver, clock)
                            if rest or extend else (None, [], []))
        hits = [t for t, ok in zip(tags, take) if ok]
        self.taken += len(hits)
        parts: dict[int, list[str]] = {}   # per made DraftTree, the rows taken from it
        for t in hits:
            parts.setdefault(id(made[t.request_id][1]), []).append(t.request_id)
        for ids in parts.values():
            whole = made[ids[0]][1]
            part = whole if whole.request_ids == ids else whole.select(ids)
            tree = part if tree is None else concat_trees(tree, part)
        known = [t for t in tags if t.request_id not in unknown]
        ids = [t.request_id for t in known]
        return (tree if tree.request_ids == ids else tree.select(ids)), known, unknown
