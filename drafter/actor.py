"""The drafter as a Ray actor: builds the engine from directories, then translates each call
through drafter/service_core.py. No model logic here.

Features arrive as ObjectRefs inside the items (put by the verifier actor); Ray resolves only
top-level arguments, so they are fetched here, all of a call's at once. A round's DraftTree
leaves as a task return that the caller owns: the router passes the ref on to the verifier
unresolved, and the tree outlives a crash of this actor.

Run with max_restarts=-1: a restart re-runs __init__ and comes back empty; `extend` then names
the requests it does not hold and the router re-prefills them.

With a direct feature channel open (`open_feature_channel`, spectandem/channel.py) features
arrive as ChannelRefs and are taken from it. A restarted actor has no channel: it reports the
requests of such items as unknown, and the verifier's sender, its peer gone, soon goes back to
object refs. With a tree channel open (`open_tree_channel`, spectandem/channel/trees.py) a draft
with a round to post sends its trees to the verifier actor there; a restarted actor has none,
and the router's rounds find that out from its replies (nothing posted). Over the tree channel the
verifier actor also sends a round's verdicts, on which this actor drafts the next trees
(drafter/next_trees.py) in the channel's reading thread: the engine calls take one lock.
"""

from __future__ import annotations

import os
import threading
from dataclasses import replace

import ray
import torch

from drafter.factory import build_engine
from drafter.next_trees import NextTrees
from drafter.service_core import (drafter_draft_ahead, drafter_draft_posted, drafter_extend, drafter_info,
                                  drafter_prefill, drafter_release)
from spectandem.protocol import AheadReply, DrafterPrefillItem, EngineInfo, ExtendItem, Tag
from spectandem.channel import FeatureReceiver, TreePoster
from spectandem.channel.trees import verdicts_from_bytes
from spectandem.call_clock import CallClock
from spectandem.config import EngineConfig
from spectandem.messages import DraftTree


def _resolve_features(items: list):
    """The items with each ObjectRef `features` replaced by its tensor (one ray.get for all)."""
    refs = [i.features for i in items if isinstance(i.features, ray.ObjectRef)]
    values = iter(ray.get(refs))
    return [replace(i, features=next(values)) if isinstance(i.features, ray.ObjectRef) else i for i in items]


@ray.remote
class DrafterActor:
    def __init__(self, config: EngineConfig, model_name: str = "draft", num_threads: int = 1):
        torch.set_num_threads(num_threads)   # this actor's own process
        self.engine, _ = build_engine(config)
        self.model_name, self.device = model_name, config.device
        self.receiver: FeatureReceiver | None = None
        self.poster: TreePoster | None = None
        self.clock = CallClock()   # EngineInfo.calls
        self.next_trees = NextTrees()
        self._engine_lock = threading.Lock()   # the actor's calls, and drafting on the verdicts

    def open_feature_channel(self, address: str) -> None:
        """Starts the drafter's end of the verifier's feature channel; connecting runs in the background."""
        if self.receiver is not None:
            self.receiver.close()
        self.receiver = FeatureReceiver(address, self.device)

    def open_tree_channel(self, address: str) -> None:
        """Starts the drafter's end of the verifier's tree channel; connecting runs in the background."""
        if self.poster is not None:
            self.poster.close()
        self.poster = TreePoster(address, on_verdicts=self._on_verdicts)

    def _on_verdicts(self, body: bytes) -> None:
        items, bounds = verdicts_from_bytes(body)
        with self._engine_lock, self.clock.timing("draft_next"):
            self.next_trees.draft_on(self.engine, items, bounds, self.receiver, self.clock)

    def prefill(self, items: list[DrafterPrefillItem]) -> list[str]:
        items = _resolve_features(items)
        with self._engine_lock, self.clock.timing("prefill"):
            self.next_trees.forget([i.tag.request_id for i in items])
            return drafter_prefill(self.engine, items, self.receiver)

    @ray.method(num_returns=2)
    def draft(self, tags: list[Tag], num_steps: list[int | None] | None = None, extend: list[ExtendItem] = (),
              post_round: int = 0) -> tuple[DraftTree | None, tuple[list[Tag], list[str], bool]]:
        """`extend` first, then (the round's trees, (the tags they are for, the unknown ids, whether
        the trees went to the verifier over the tree channel as round `post_round`, 0: not asked)):
        the caller awaits the second, which raises as the call failed, and forwards the tree's ref
        without fetching it (None once posted)."""
        extend = _resolve_features(list(extend))
        with self._engine_lock, self.clock.timing("draft"):
            make = self.next_trees.extend_and_draft
            if post_round:
                tree, known, unknown, posted = drafter_draft_posted(self.engine, tags, num_steps, extend, self.receiver,
                                                                    self.poster, post_round, self.clock, make)
            else:
                (tree, known, unknown), posted = make(self.engine, tags, num_steps, extend, self.receiver,
                                                      self.clock), False
        return tree, (known, unknown, posted)

    def draft_ahead(self, tags: list[Tag], extend: list[ExtendItem] = ()) -> AheadReply:
        extend = _resolve_features(list(extend))
        with self._engine_lock, self.clock.timing("draft_ahead"):
            return drafter_draft_ahead(self.engine, tags, self.next_trees.unabsorbed(extend), self.receiver)

    def extend(self, items: list[ExtendItem]) -> list[str]:
        """Catch-up; returns the ids this drafter does not hold (it restarted)."""
        items = _resolve_features(items)
        with self._engine_lock, self.clock.timing("extend"):
            return drafter_extend(self.engine, self.next_trees.unabsorbed(items), self.receiver)

    def release(self, request_ids: list[str], keep_draft: bool = False,
                outputs: dict[str, list[int]] | None = None) -> None:
        with self._engine_lock:
            self.next_trees.forget(request_ids)
            drafter_release(self.engine, request_ids, keep_draft, outputs)

    def info(self) -> EngineInfo:
        info = drafter_info(self.engine, self.model_name)
        ctx = ray.get_runtime_context()
        info.extra.update(pid=os.getpid(), node_id=ctx.get_node_id(), placement_group_id=ctx.get_placement_group_id())
        if self.receiver is not None:
            info.extra["feature_channel"] = self.receiver.state
        if self.poster is not None:
            info.extra["tree_channel"] = self.poster.state
        info.extra.update(next_trees_made=self.next_trees.made, next_trees_taken=self.next_trees.taken)
        info.calls = self.clock.stats()
        return info

    def ping(self) -> bool:
        return True
