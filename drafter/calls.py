"""One drafter's calls, as every adapter makes them (the in-process link, router/links_local.py;
the gRPC servicer, drafter/service.py; the Ray actor, drafter/actor.py): the engine operations
of drafter/service_core.py, each routed through the drafter's one NextTrees
(drafter/next_trees.py), so that a request's prefill and release forget what was made on its
verdicts, and every catch-up leaves out what a verdict already absorbed.

The adapters decode their transport's messages, run these calls one at a time (a worker
thread, an engine lock) and encode the results; they hold no drafting state of their own.

`receiver`, `poster`: the drafter's ends of the feature channel and the tree channel, or None;
an adapter that opens a channel later sets them."""

from __future__ import annotations

from drafter.next_trees import NextTrees
from drafter.service_core import (drafter_draft_ahead, drafter_draft_posted, drafter_extend, drafter_info,
                                  drafter_prefill, drafter_release)
from spectandem import codec
from spectandem.call_clock import CallClock, timed
from spectandem.channel import FeatureReceiver, TreePoster
from spectandem.channel.trees import verdicts_from_bytes
from spectandem.messages import DraftTree
from spectandem.protocol import AheadReply, DrafterPrefillItem, EngineInfo, ExtendItem, Tag


class DrafterCalls:
    def __init__(self, engine, receiver: FeatureReceiver | None = None, poster: TreePoster | None = None):
        self.engine, self.receiver, self.poster = engine, receiver, poster
        self.next_trees = NextTrees()

    def prefill(self, items: list[DrafterPrefillItem]) -> list[str]:
        """drafter_prefill; -> the ids whose features did not come."""
        self.next_trees.forget([i.tag.request_id for i in items])
        return drafter_prefill(self.engine, items, self.receiver)

    def draft(self, tags: list[Tag], num_steps: list[int | None] | None, extend: list[ExtendItem],
              clock: CallClock | None = None) -> tuple[DraftTree | None, list[Tag], list[str]]:
        """`extend`, then the trees (those made on the verdicts where they serve): (the trees or
        None, the tags they are for, the unknown ids)."""
        return self.next_trees.extend_and_draft(self.engine, tags, num_steps, extend, self.receiver, clock)

    def draft_posted(self, tags: list[Tag], num_steps: list[int | None] | None, extend: list[ExtendItem],
                     round_id: int, clock: CallClock | None = None) -> tuple[DraftTree | None, list[Tag], list[str], bool]:
        """`draft`, its trees sent to the verifier over the tree channel as round `round_id`
        (drafter_draft_posted) -> (the trees where they were not sent, else None; the tags; the
        unknown ids; whether the verifier was told)."""
        return drafter_draft_posted(self.engine, tags, num_steps, extend, self.receiver, self.poster, round_id, clock,
                                    self.next_trees.extend_and_draft)

    def draft_ahead(self, tags: list[Tag], extend: list[ExtendItem]) -> AheadReply:
        return drafter_draft_ahead(self.engine, tags, self.next_trees.unabsorbed(extend), self.receiver)

    def extend(self, items: list[ExtendItem]) -> list[str]:
        """Catch-up; -> the ids this drafter does not hold."""
        return drafter_extend(self.engine, self.next_trees.unabsorbed(items), self.receiver)

    def release(self, request_ids: list[str], keep_draft: bool = False,
                outputs: dict[str, list[int]] | None = None) -> int:
        self.next_trees.released(request_ids)
        return drafter_release(self.engine, request_ids, keep_draft, outputs)

    def draft_on(self, items: list[ExtendItem], bounds: dict[str, int], clock: CallClock | None = None,
                 post=None, prefills: list[DrafterPrefillItem] = ()) -> None:
        """A round's verdicts, straight from the verifier: its prefills taken, caught up with, and
        the next trees drafted (NextTrees.draft_on); `post(trees, tags)`: sends them on at once."""
        self.next_trees.draft_on(self.engine, items, bounds, self.receiver, clock, post, prefills)

    def draft_on_frame(self, body: bytes, clock: CallClock | None = None) -> None:
        """`draft_on` for a VERDICTS frame of the tree channel (spectandem/channel/trees.py): where
        its features lie in the feature channel's ring is told to the receiver first, which then
        copies them out without waiting for their headers. Where the verify took its trees over
        the channel as round R, the next trees go to the verifier at once, as early trees after R
        (timed as "draft_next.post")."""
        with timed(clock, "draft_next.decode"):
            items, bounds, placements, round_id, prefills = verdicts_from_bytes(body)
            if placements and self.receiver is not None:
                self.receiver.expect(placements)
        def post(tree: DraftTree | None, tags: list[Tag]) -> None:   # None: an empty body, none made
            with timed(clock, "draft_next.post"):
                self.poster.post(round_id, codec.draft_tree_to_bytes(tree, tags) if tree is not None else b"",
                                 early=True)
        self.draft_on(items, bounds, clock, post if round_id and self.poster is not None else None, prefills)

    def info(self, model_name: str) -> EngineInfo:
        """drafter_info, with the channels' states and the trees made on verdicts and taken."""
        info = drafter_info(self.engine, model_name)
        if self.receiver is not None:
            info.extra.update(feature_channel=self.receiver.state, feature_early_reads=self.receiver.early_reads)
        if self.poster is not None:
            info.extra["tree_channel"] = self.poster.state
        info.extra.update(next_trees_made=self.next_trees.made, next_trees_taken=self.next_trees.taken,
                          prefills_with_verdicts=self.next_trees.prefilled)
        return info
