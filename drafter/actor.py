"""The drafter as a Ray actor: builds the engine from directories, then makes each call through
drafter/calls.py. No model logic here.

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
from drafter.calls import DrafterCalls
from spectandem.protocol import AheadReply, DrafterPrefillItem, EngineInfo, ExtendItem, Tag
from spectandem.channel import FeatureReceiver, TreePoster
from spectandem.call_clock import CallClock
from spectandem.config import EngineConfig
from spectandem.devices import bind_cpu_cores
from spectandem.messages import DraftTree


def _resolve_features(items: list):
    """The items with each ObjectRef `features` replaced by its tensor (one ray.get for all)."""
    refs = [i.features for i in items if isinstance(i.features, ray.ObjectRef)]
    values = iter(ray.get(refs))
    return [replace(i, features=next(values)) if isinstance(i.features, ray.ObjectRef) else i for i in items]


@ray.remote
class DrafterActor:
    def __init__(self, config: EngineConfig, model_name: str = "draft", num_threads: int = 1,
                 cpu_cores: list[int] | None = None):
        bind_cpu_cores(cpu_cores, every_thread=True)   # this actor's own process (serve --cpu-bind)
        torch.set_num_threads(num_threads)
        engine, _ = build_engine(config)
        self.model_name, self.device = model_name, config.device
        self.drafter = DrafterCalls(engine)   # its channels once opened
        self.clock = CallClock()   # EngineInfo.calls
        self._engine_lock = threading.Lock()   # the actor's calls, and drafting on the verdicts

    def open_feature_channel(self, address: str) -> None:
        """Starts the drafter's end of the verifier's feature channel; connecting runs in the background."""
        if self.drafter.receiver is not None:
            self.drafter.receiver.close()
        self.drafter.receiver = FeatureReceiver(address, self.device)

    def open_tree_channel(self, address: str) -> None:
        """Starts the drafter's end of the verifier's tree channel; connecting runs in the background."""
        if self.drafter.poster is not None:
            self.drafter.poster.close()
        self.drafter.poster = TreePoster(address, on_verdicts=self._on_verdicts)

    def _on_verdicts(self, body: bytes) -> None:
        with self._engine_lock, self.clock.timing("draft_next"):
            self.drafter.draft_on_frame(body, self.clock)

    def prefill(self, items: list[DrafterPrefillItem]) -> list[str]:
        items = _resolve_features(items)
        with self._engine_lock, self.clock.timing("prefill"):
            return self.drafter.prefill(items)

    @ray.method(num_returns=2)
    def draft(self, tags: list[Tag], num_steps: list[int | None] | None = None, extend: list[ExtendItem] = (),
              post_round: int = 0) -> tuple[DraftTree | None, tuple[list[Tag], list[str], bool]]:
        """`extend` first, then (the round's trees, (the tags they are for, the unknown ids, whether
        the trees went to the verifier over the tree channel as round `post_round`, 0: not asked)):
        the caller awaits the second, which raises as the call failed, and forwards the tree's ref
        without fetching it (None once posted)."""
        extend = _resolve_features(list(extend))
        with self._engine_lock, self.clock.timing("draft"):
            if post_round:
                tree, known, unknown, posted = self.drafter.draft_posted(tags, num_steps, extend, post_round, self.clock)
            else:
                (tree, known, unknown), posted = self.drafter.draft(tags, num_steps, extend, self.clock), False
        return tree, (known, unknown, posted)

    def draft_ahead(self, tags: list[Tag], extend: list[ExtendItem] = ()) -> AheadReply:
        extend = _resolve_features(list(extend))
        with self._engine_lock, self.clock.timing("draft_ahead"):
            return self.drafter.draft_ahead(tags, extend)

    def extend(self, items: list[ExtendItem]) -> list[str]:
        """Catch-up; returns the ids this drafter does not hold (it restarted)."""
        items = _resolve_features(items)
        with self._engine_lock, self.clock.timing("extend"):
            return self.drafter.extend(items)

    def release(self, request_ids: list[str], keep_draft: bool = False,
                outputs: dict[str, list[int]] | None = None) -> None:
        with self._engine_lock:
            self.drafter.release(request_ids, keep_draft, outputs)

    def info(self) -> EngineInfo:
        info = self.drafter.info(self.model_name)
        ctx = ray.get_runtime_context()
        info.extra.update(pid=os.getpid(), node_id=ctx.get_node_id(), placement_group_id=ctx.get_placement_group_id())
        info.calls = self.clock.stats()
        return info

    def ping(self) -> bool:
        return True
