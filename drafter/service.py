"""The drafter as a gRPC service (spectandem.v1.Drafter): a thin servicer that decodes the
protobuf messages, makes the drafter's calls (drafter/calls.py) and encodes the replies.

    python -m drafter --target DIR --draft DIR --method eagle3 --num-steps 4 --port N

EAGLE heads take their embeddings and lm_head from the target, so this process loads the target
model too (its weights only; the verifier owns the target's KV). n-gram drafting needs no model.
With --feature-channel tcp://HOST:PORT (the verifier's) target features come over a direct
channel (spectandem/channel.py) where the router's messages carry ChannelRefs. With
--tree-channel tcp://HOST:PORT (the verifier's) a Draft with a `post_round` sends its trees there
(spectandem/channel/trees.py) rather than in the reply.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from drafter.engine import DrafterEngine
from drafter.factory import build_engine
from drafter.calls import DrafterCalls
from spectandem import codec
from spectandem.channel import FeatureReceiver, TreePoster
from spectandem.config import EngineConfig
from spectandem.devices import engine_process_thread
from spectandem.service_args import add_drafter_args  # noqa: F401 (re-exported)
from spectandem.grpc_server import EngineCalls, EngineServer
from spectandem.tls import ServerTls, server_tls_from_args
from spectandem.v1 import engines_pb2, engines_pb2_grpc

SERVICE_NAME = engines_pb2.DESCRIPTOR.services_by_name["Drafter"].full_name


class DrafterServicer(engines_pb2_grpc.DrafterServicer):
    def __init__(self, engine: DrafterEngine, model_name: str = "draft", device: str = "cpu",
                 max_slots: int = 0, max_len: int = 0, receiver: FeatureReceiver | None = None, thread=None,
                 poster: TreePoster | None = None):
        self.model_name, self.device, self.max_slots, self.max_len = model_name, device, max_slots, max_len
        self.calls = EngineCalls("drafter", thread)
        self.drafter = DrafterCalls(engine, receiver, poster)   # called in the engine's turn only
        if poster is not None:
            poster.on_verdicts = self._on_verdicts

    def _on_verdicts(self, body: bytes) -> None:
        """A round's verdicts from the verifier (the tree channel's reading thread): caught up with
        and the next trees drafted in the engine's turn (drafter/next_trees.py)."""
        self.calls.run_internal("draft_next", self.drafter.draft_on_frame, body, self.calls.clock)

    def Prefill(self, request, context):
        return self.calls.run(context, self._prefill, request)

    def Draft(self, request, context):
        return self.calls.run(context, self._draft, request)

    def DraftAhead(self, request, context):
        return self.calls.run(context, self._draft_ahead, request)

    def Extend(self, request, context):
        return self.calls.run(context, self._extend, request)

    def Release(self, request, context):
        return self.calls.run(context, self._release, request)

    def GetInfo(self, request, context):
        return self.calls.peek(context, self._info)

    # The bodies run one at a time (_info beside them: it only reads counters).

    def _prefill(self, request: engines_pb2.DrafterPrefillRequest) -> engines_pb2.DrafterReply:
        items = [codec.drafter_prefill_item_from_msg(m) for m in request.items]
        return engines_pb2.DrafterReply(unknown_request_ids=self.drafter.prefill(items))

    def _draft(self, request: engines_pb2.DraftRequest) -> engines_pb2.DraftReply:
        tags = [codec.tag_from_msg(t) for t in request.tags]
        if not tags:
            raise ValueError("draft request has no requests")
        # Its parts are timed too ("draft.*", inside "draft"'s time).
        clock = self.calls.clock
        with clock.timing("draft.decode"):
            extend = [codec.extend_item_from_msg(m) for m in request.extend]
        if request.post_round:
            tree, known, unknown, posted = self.drafter.draft_posted(tags, list(request.num_steps) or None, extend,
                                                                     request.post_round, clock)
            if posted:
                return engines_pb2.DraftReply(posted=True, posted_tags=[codec.tag_to_msg(t) for t in known],
                                              unknown_request_ids=unknown)
        else:
            tree, known, unknown = self.drafter.draft(tags, list(request.num_steps) or None, extend, clock)
        if tree is None:
            return engines_pb2.DraftReply(unknown_request_ids=unknown)
        with clock.timing("draft.encode"):
            return engines_pb2.DraftReply(tree=codec.draft_tree_to_msg(tree, [t.epoch for t in known]),
                                          unknown_request_ids=unknown)

    def _draft_ahead(self, request: engines_pb2.DraftAheadRequest) -> engines_pb2.DraftAheadReply:
        return codec.ahead_reply_to_msg(self.drafter.draft_ahead(
            [codec.tag_from_msg(t) for t in request.tags], [codec.extend_item_from_msg(m) for m in request.extend]))

    def _extend(self, request: engines_pb2.ExtendRequest) -> engines_pb2.DrafterReply:
        items = [codec.extend_item_from_msg(m) for m in request.items]
        return engines_pb2.DrafterReply(unknown_request_ids=self.drafter.extend(items))

    def _release(self, request: engines_pb2.ReleaseRequest) -> engines_pb2.ReleaseReply:
        outputs = {o.request_id: list(o.token_ids) for o in request.outputs}
        known = self.drafter.release(list(request.request_ids), request.keep_draft, outputs)
        return engines_pb2.ReleaseReply(released=known)

    def _info(self) -> engines_pb2.EngineInfo:
        info = self.drafter.info(self.model_name)
        info.max_slots, info.max_len = self.max_slots, self.max_len
        info.extra["device"] = self.device
        info.calls = self.calls.clock.stats()
        return codec.engine_info_to_msg(info)


# ----------------------------------------------------------------------------------------------
# Building the engine and serving it


def start_drafter_server(engine: DrafterEngine, host: str = "127.0.0.1", port: int = 0,
                         model_name: str = "draft", device: str = "cpu", max_slots: int = 0,
                         max_len: int = 0, tls: ServerTls | None = None,
                         receiver: FeatureReceiver | None = None, thread=None,
                         poster: TreePoster | None = None) -> EngineServer:
    """Serves `engine` on the server's threads; returns the started server (port 0: a free one).
    `tls`: TLS or mTLS on the port (None: plaintext); `receiver`: the feature channel's end;
    `thread`: the one thread that runs its calls (EngineCalls); `poster`: the tree channel's end."""
    servicer = DrafterServicer(engine, model_name, device, max_slots, max_len, receiver, thread, poster)
    return EngineServer.start(lambda s: engines_pb2_grpc.add_DrafterServicer_to_server(servicer, s),
                              SERVICE_NAME, host, port, tls.grpc_credentials() if tls else None)


def serve_drafter(config: EngineConfig, host: str = "0.0.0.0", port: int = 50053, tls: ServerTls | None = None,
                  feature_channel: str | None = None, tree_channel: str | None = None) -> None:
    """Loads the drafter (drafter/factory.py), serves it until SIGTERM/SIGINT. `feature_channel`:
    tcp://HOST:PORT of the verifier's direct feature channel (None: features come inline);
    `tree_channel`: tcp://HOST:PORT of the verifier's tree channel (None: trees in the replies)."""
    cfg, draft_dir, device, max_slots = config.spec, config.draft_dir, config.device, config.max_slots
    if cfg.fused:
        raise ValueError("fused mode runs verify and extend in one process; it cannot be served as a drafter")
    # Connecting runs in the background, while the model loads.
    receiver = FeatureReceiver(feature_channel, device) if feature_channel else None
    poster = TreePoster(tree_channel) if tree_channel else None
    thread = engine_process_thread(device)
    engine, context = build_engine(config)
    name = Path(draft_dir).name if draft_dir is not None else cfg.method

    try:
        server = start_drafter_server(engine, host, port, name, device, max_slots, context, tls=tls, receiver=receiver,
                                      thread=thread, poster=poster)
        print(f"spectandem drafter: {cfg.method} {name}, features "
              f"{codec.feature_layers_to_str(engine.feature_layers)}, listening on {host}:{server.port}", flush=True)
        server.serve_until_signal()
    finally:
        if receiver is not None:
            receiver.close()
        if poster is not None:
            poster.close()


# ----------------------------------------------------------------------------------------------
# Command line (python -m drafter, spectandem drafter)


def run_drafter(args: argparse.Namespace) -> int:
    from spectandem.service_args import spec_from_flags

    cfg, target, draft = spec_from_flags(args)
    if args.kv_blocks is not None:
        raise ValueError("--kv-blocks sizes the verifier's KV pool; a drafter's is --draft-kv-blocks")
    from spectandem.devices import bind_cpu_cores, resolve_flags, set_cpu_threads

    bind_cpu_cores(args.cpu_cores)
    set_cpu_threads(args.threads)
    args = resolve_flags(args, target)
    config = EngineConfig.from_args(args, cfg, target, draft, args.max_slots)
    tls = server_tls_from_args(args)  # flag and file errors before the model loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_drafter(config, args.host, args.port, tls=tls, feature_channel=args.feature_channel,
                  tree_channel=args.tree_channel)
    return 0
