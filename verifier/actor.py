"""The verifier as a Ray actor: builds the engine from directories, then translates each call
through verifier/service_core.py. No model logic here.

Features leave this actor only as object refs: each request's feature tensor is `ray.put` here,
in the verifier's object store, and the results carry the refs. The router holds and forwards
the refs; the drafter actor fetches the tensors (directly from the object store, never through
the router). With a direct feature channel open (`open_feature_channel`, spectandem/channel.py)
they go over it instead and the results carry ChannelRefs. With a tree channel open
(`open_tree_channel`, spectandem/channel/trees.py) a verify whose draft payload is a TreeRoute
takes the round's trees from the drafter actor there.
"""

from __future__ import annotations

import os
import socket
from dataclasses import replace

import ray
import torch

from spectandem.protocol import (EngineInfo, PlainItem, Tag, TreeRoute, Verdict, VerifierPrefillItem,
                                 VerifierPrefillResult)
from spectandem.after_reply import AfterReply
from spectandem.call_clock import CallClock
from spectandem.channel import FeatureSender, TreeMailbox
from spectandem.config import EngineConfig
from spectandem.devices import SmallForwards, bind_cpu_cores
from verifier.factory import build_engine
from verifier.runner import FeatureSpec
from verifier.service_core import forward_tokens, verifier_features, verifier_info, verifier_prefill, verify_call


def _put(features):
    """A tensor -> its ObjectRef; None and ChannelRefs (sent over the channel) stay. A view of a
    larger tensor (a verify's features: VerifierEngine.verify) is copied out first: pickling a
    view would carry its whole storage."""
    if not isinstance(features, torch.Tensor):
        return features
    if features.untyped_storage().nbytes() != features.nbytes:
        features = features.clone()
    return ray.put(features)


@ray.remote
class VerifierActor:
    def __init__(self, config: EngineConfig, feature_layers: FeatureSpec, model_name: str = "target",
                 num_threads: int = 1, cpu_cores: list[int] | None = None, one_thread_up_to: int = 0,
                 one_thread_cores: list[int] | None = None):
        """`cpu_cores`: the cores of this actor's process (serve --cpu-bind; None: as Ray started
        it); `one_thread_up_to`, `one_thread_cores`: a forward of at most that many tokens runs on
        one torch thread bound to those cores (spectandem.devices.SmallForwards)."""
        bind_cpu_cores(cpu_cores, every_thread=True)   # this actor's own process (serve --cpu-bind)
        torch.set_num_threads(num_threads)
        self.small = SmallForwards(one_thread_up_to, num_threads, one_thread_cores)
        self.engine = build_engine(config, feature_layers)
        self.model_name, self.device = model_name, config.device
        self.sender: FeatureSender | None = None
        self.trees: TreeMailbox | None = None
        # Ray restarted this actor (max_restarts): the KV of every request the router had here is
        # gone, so a call about a request this instance never prefilled is an outage, not a stale reply.
        self.restarted = ray.get_runtime_context().was_current_actor_reconstructed
        self.clock = CallClock()   # EngineInfo.calls
        # What a call leaves for after its reply (spectandem/after_reply.py): the decode ahead and
        # the feature channel's copies. Every call that uses the engine waits for it first.
        self.after = AfterReply(device=config.device, clock=self.clock)

    def _check_held(self, request_ids) -> None:
        missing = sorted({r for r in request_ids if r not in self.engine.requests})
        if missing and self.restarted:
            raise RuntimeError(f"the verifier restarted and does not hold requests {missing}: their KV is gone")

    def open_feature_channel(self, address: str | None) -> str:
        """Starts the verifier's end of the direct feature channel at `address` (None: a free port
        of this node) and returns the address; connecting runs in the background."""
        if address is None:
            with socket.socket() as s:
                s.bind(("", 0))
                address = f"tcp://{ray.util.get_node_ip_address()}:{s.getsockname()[1]}"
        self.after.settle()   # the old sender's copies are done before it closes
        if self.sender is not None:
            self.sender.close()
        self.sender = FeatureSender(address, self.device, later=self.after.later)
        return address

    def open_tree_channel(self) -> str:
        """Starts the verifier's end of the tree channel on a free port of this node; returns its
        address (the drafter actor's `open_tree_channel` connects there)."""
        if self.trees is not None:
            self.trees.close()
        self.trees = TreeMailbox(f"tcp://{ray.util.get_node_ip_address()}:0")
        return self.trees.address

    def set_feature_layers(self, feature_layers: FeatureSpec) -> None:
        """Which target features to return: the drafter's head decides (its info says), so a
        verifier built alongside its drafter learns them after both have loaded."""
        self.after.settle()
        if self.engine.requests:
            raise ValueError(f"cannot change the feature layers with {len(self.engine.requests)} requests active")
        self.engine.runner.feature_layers = feature_layers

    def prefill(self, items: list[VerifierPrefillItem], want_features: bool) -> list[VerifierPrefillResult]:
        """Results whose `features` is an ObjectRef of the prompt's features [prompt_len, F] (or None)."""
        with self.after.call(), self.clock.timing("prefill"):
            with self.small.placed(forward_tokens(None, [], items)):
                results = verifier_prefill(self.engine, items, want_features, self.sender)
            return [replace(r, features=_put(r.features)) for r in results]

    def verify(self, draft_payload, tags: list[Tag], plain: list[PlainItem], want_features: bool,
               draft_next: dict[str, int] | None = None) -> list[Verdict]:
        """`draft_payload`: the drafter's DraftTree (Ray resolves the ref passed at top level), a
        TreeRoute (the trees come over the tree channel; the requests of trees that do not come
        get no result) or None. Results in the order tags then plain; `features` an ObjectRef of
        [num_accepted + 1, F] (or None). `draft_next`: the requests whose verdicts go to the
        drafter over the tree channel (verifier/service_core.py verdicts_to_drafter)."""
        return self.verify_prefill(draft_payload, tags, plain, want_features, [], False, draft_next)[0]

    def verify_prefill(self, draft_payload, tags: list[Tag], plain: list[PlainItem], want_features: bool,
                       items: list[VerifierPrefillItem], prefill_features: bool,
                       draft_next: dict[str, int] | None = None) -> tuple[list[Verdict], list[VerifierPrefillResult]]:
        """`verify` with `items` prefilled in the same step (VerifierEngine.verify_with_prefill):
        (its results, the prefill's, their features ObjectRefs as `prefill`'s)."""
        with self.after.call(), self.clock.timing("verify"):
            route = draft_payload if isinstance(draft_payload, TreeRoute) else None
            outs, prefilled = verify_call(self.engine, None if route is not None else draft_payload, tags, route, plain,
                                          want_features, items, prefill_features, draft_next, trees=self.trees,
                                          sender=self.sender, small=self.small, clock=self.clock, after=self.after,
                                          check_held=self._check_held)
            # Their features in the object store (or queued for the channel); the decode ahead goes
            # once the reply is on its way.
            return ([replace(r, features=_put(r.features)) for r in outs],
                    [replace(r, features=_put(r.features)) for r in prefilled])

    def features(self, tag: Tag) -> ray.ObjectRef | None:
        """An ObjectRef of the features of every committed position but the last."""
        with self.after.call():
            self._check_held([tag.request_id])
            return _put(verifier_features(self.engine, tag))

    def release(self, request_ids: list[str]) -> None:
        with self.after.call():
            for rid in request_ids:
                self.engine.release(rid)

    def info(self) -> EngineInfo:
        info = verifier_info(self.engine, self.model_name)
        ctx = ray.get_runtime_context()
        info.extra.update(pid=os.getpid(), restarted=self.restarted, node_id=ctx.get_node_id(),
                          placement_group_id=ctx.get_placement_group_id(), one_thread_forwards=self.small.count)
        if self.sender is not None:
            info.extra["feature_channel"] = self.sender.state
            info.extra.update(feature_ring_messages=self.sender.ring_messages,
                              feature_group_messages=self.sender.group_messages)
        if self.trees is not None:
            info.extra.update(tree_channel=self.trees.state, early_trees_taken=self.trees.early_taken)
        info.calls = self.clock.stats()
        return info

    def ping(self) -> bool:
        return True
