"""The verifier as a gRPC service (spectandem.v1.Verifier): a thin servicer that decodes the
protobuf messages, calls verifier/service_core.py on a VerifierEngine and encodes the replies.

    python -m verifier --target DIR [--method eagle3 --draft DIR | --feature-layers 2,4,5] --port N

The verifier returns the target features the drafter reads, so it must know which: given by
--feature-layers ("none", "final" or comma-separated HuggingFace hidden-state indices), or
derived from --method and the draft head's config.json. With --feature-channel tcp://HOST:PORT
they go to the drafter over a direct channel (spectandem/channel.py; this process listens
there) and the replies carry ChannelRefs; until it is up, or once it broke, they go inline.
With --tree-channel tcp://HOST:PORT this process listens there for its drafter's trees
(spectandem/channel/trees.py): a Verify whose `tree_round` is set takes that round's trees from it.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch

from spectandem import codec
from spectandem.after_reply import AfterReply
from spectandem.channel import FeatureSender, TreeMailbox
from spectandem.config import EngineConfig, SpecConfig, is_cuda
from spectandem.devices import SmallForwards, engine_process_thread
from spectandem.feature_layers import resolve_feature_layers
from spectandem.service_args import add_verifier_args, refuse_tree_flags  # noqa: F401 (add_verifier_args re-exported)
from spectandem.grpc_server import EngineCalls, EngineServer
from spectandem.protocol import TreeRoute
from spectandem.tls import ServerTls, server_tls_from_args
from spectandem.v1 import engines_pb2, engines_pb2_grpc
from verifier.engine import VerifierEngine
from verifier.factory import build_engine
from verifier.service_core import forward_tokens, verifier_features, verifier_info, verifier_prefill, verify_call

SERVICE_NAME = engines_pb2.DESCRIPTOR.services_by_name["Verifier"].full_name


class VerifierServicer(engines_pb2_grpc.VerifierServicer):
    def __init__(self, engine: VerifierEngine, model_name: str = "target", device: str = "cpu",
                 sender: FeatureSender | None = None, thread=None, trees: TreeMailbox | None = None,
                 after: AfterReply | None = None, threads: int = 1, one_thread_up_to: int = 0,
                 one_thread_cores: list[int] | None = None):
        """`after`: where a call leaves the work its reply does not wait for (the decode ahead; the
        feature channel's copies where `sender` was made with its `later`); None: one of its own.
        `threads`: the torch threads of `thread` (the engine's CPU thread; None: the calls run on
        the gRPC handler threads, one torch thread each); `one_thread_up_to`, `one_thread_cores`:
        forwards of at most that many tokens run on one torch thread, on those cores where given
        (spectandem.devices.SmallForwards)."""
        self.engine, self.model_name, self.device, self.sender = engine, model_name, device, sender
        self.trees = trees
        self.small = SmallForwards(one_thread_up_to, threads if thread is not None else 1, one_thread_cores)
        self.calls = EngineCalls("verifier", thread, after if after is not None else AfterReply(thread, device))

    def Prefill(self, request, context):
        return self.calls.run(context, self._prefill, request)

    def Verify(self, request, context):
        return self.calls.run(context, self._verify, request)

    def Features(self, request, context):
        return self.calls.run(context, self._features, request)

    def Release(self, request, context):
        return self.calls.run(context, self._release, request)

    def GetInfo(self, request, context):
        return self.calls.peek(context, self._info)

    # The bodies run one at a time (_info beside them: it only reads counters).

    def _prefill(self, request: engines_pb2.VerifierPrefillRequest) -> engines_pb2.VerifierPrefillReply:
        items = [codec.verifier_prefill_item_from_msg(m) for m in request.items]
        with self.small.placed(forward_tokens(None, [], items)):
            results = verifier_prefill(self.engine, items, request.want_features, self.sender)
        return engines_pb2.VerifierPrefillReply(results=[codec.verifier_prefill_result_to_msg(r) for r in results])

    def _verify(self, request: engines_pb2.VerifyRequest) -> engines_pb2.VerifyReply:
        # Its parts are timed too ("verify.*", inside "verify"'s time): decoding the request,
        # waiting for the trees of the tree channel, the engine, the features' hand-off, encoding.
        clock = self.calls.clock
        with clock.timing("verify.decode"):
            plain = [codec.plain_item_from_msg(m) for m in request.plain]
            items = [codec.verifier_prefill_item_from_msg(m) for m in request.prefill]
            tree, tags = codec.draft_tree_from_msg(request.tree) if request.HasField("tree") else (None, [])
        route = None
        if request.tree_round:
            if tree is not None:
                raise ValueError("verify request has both a tree and a tree_round")
            route = TreeRoute(request.tree_round, request.tree_wait_ms / 1000, request.early_after,
                              tuple(codec.tag_from_msg(t) for t in request.early_tags))
        elif tree is None and not plain:
            raise ValueError("verify request has neither a tree nor plain items")
        results, prefilled = verify_call(self.engine, tree, tags, route, plain, request.want_features, items,
                                         request.prefill_features, dict(request.draft_next), trees=self.trees,
                                         sender=self.sender, small=self.small, clock=clock, after=self.calls.after)
        with clock.timing("verify.encode"):
            return engines_pb2.VerifyReply(results=[codec.verdict_to_msg(r) for r in results],
                                           prefilled=[codec.verifier_prefill_result_to_msg(r) for r in prefilled])

    def _features(self, request: engines_pb2.FeaturesRequest) -> engines_pb2.FeaturesReply:
        feats = verifier_features(self.engine, codec.tag_from_msg(request.tag))
        return engines_pb2.FeaturesReply(features=codec.optional_tensor_to_msg(feats))

    def _release(self, request: engines_pb2.ReleaseRequest) -> engines_pb2.ReleaseReply:
        known = [r for r in request.request_ids if r in self.engine.requests]
        for r in known:
            self.engine.release(r)
        return engines_pb2.ReleaseReply(released=len(known))

    def _info(self) -> engines_pb2.EngineInfo:
        info = verifier_info(self.engine, self.model_name)
        info.extra.update(device=self.device, one_thread_forwards=self.small.count)
        if self.sender is not None:
            info.extra["feature_channel"] = self.sender.state
            info.extra.update(feature_ring_messages=self.sender.ring_messages,
                              feature_group_messages=self.sender.group_messages)
        if self.trees is not None:
            info.extra.update(tree_channel=self.trees.state, early_trees_taken=self.trees.early_taken)
        info.calls = self.calls.clock.stats()
        return codec.engine_info_to_msg(info)


# ----------------------------------------------------------------------------------------------
# Building the engine and serving it


def start_verifier_server(engine: VerifierEngine, host: str = "127.0.0.1", port: int = 0,
                          model_name: str = "target", device: str = "cpu",
                          tls: ServerTls | None = None, sender: FeatureSender | None = None,
                          thread=None, trees: TreeMailbox | None = None,
                          after: AfterReply | None = None, threads: int = 1,
                          one_thread_up_to: int = 0, one_thread_cores: list[int] | None = None) -> EngineServer:
    """Serves `engine` on the server's threads; returns the started server (port 0: a free one).
    `tls`: TLS or mTLS on the port (None: plaintext); `sender`: the feature channel's end;
    `thread`: the one thread that runs its calls (EngineCalls), `threads` its torch threads;
    `trees`: the tree channel's end; `after`: the calls' work after their replies;
    `one_thread_up_to`, `one_thread_cores`: VerifierServicer's."""
    servicer = VerifierServicer(engine, model_name, device, sender, thread, trees, after, threads, one_thread_up_to,
                                one_thread_cores)
    return EngineServer.start(lambda s: engines_pb2_grpc.add_VerifierServicer_to_server(servicer, s),
                              SERVICE_NAME, host, port, tls.grpc_credentials() if tls else None)


def serve_verifier(config: EngineConfig, feature_layers: str | None = None, host: str = "0.0.0.0", port: int = 50052,
                   tls: ServerTls | None = None, feature_channel: str | None = None,
                   tree_channel: str | None = None, one_thread_up_to: int = 0,
                   one_thread_cores: list[int] | None = None) -> None:
    """Loads the target (verifier/factory.py), serves it until SIGTERM/SIGINT. `config.draft_dir`
    is read only for the feature layers (see resolve_feature_layers). `feature_channel`:
    tcp://HOST:PORT of the direct channel to the drafter (None: features go inline);
    `tree_channel`: tcp://HOST:PORT where this process takes its drafter's trees (None: in the
    Verify requests only); `one_thread_up_to`, `one_thread_cores`: --one-thread-up-to and
    --one-thread-cores (VerifierServicer)."""
    target_dir, device = config.target_dir, config.device
    layers = resolve_feature_layers(feature_layers, config.spec.method, config.draft_dir, target_dir)
    threads = torch.get_num_threads()   # the engine thread's (engine_process_thread leaves this one with one)
    thread = engine_process_thread(device)
    # A verify's features go into the channel after its reply (spectandem/after_reply.py).
    after = AfterReply(thread, device)
    # Connecting runs in the background, while the model loads.
    sender = FeatureSender(feature_channel, device, later=after.later) if feature_channel else None
    trees = TreeMailbox(tree_channel) if tree_channel else None
    engine = build_engine(config, layers)

    try:
        server = start_verifier_server(engine, host, port, Path(target_dir).name, device, tls=tls, sender=sender,
                                       thread=thread, trees=trees, after=after, threads=threads,
                                       one_thread_up_to=one_thread_up_to, one_thread_cores=one_thread_cores)
        print(f"spectandem verifier: {Path(target_dir).name}, features {codec.feature_layers_to_str(layers)}, "
              f"listening on {host}:{server.port}", flush=True)
        server.serve_until_signal()
    finally:
        after.close()
        if sender is not None:
            sender.close()
        if trees is not None:
            trees.close()


# ----------------------------------------------------------------------------------------------
# Command line (python -m verifier, spectandem verifier)


def verifier_spec(args: argparse.Namespace) -> SpecConfig:
    """The drafter's method and tree as the verifier's flags give them (the depth the head states
    where --num-steps is not given: EngineConfig resolves it): the tree widths whose graphs it
    captures at start."""
    return SpecConfig(method=args.method, num_steps=args.num_steps, topk=args.topk,
                      num_draft_tokens=args.num_draft_tokens)


def run_verifier(args: argparse.Namespace) -> int:
    from spectandem.demo import demo_paths

    if args.method == "none":
        refuse_tree_flags(args)
    target, draft = args.target, args.draft
    if target is None:
        target, demo_draft = demo_paths(args.method)
        draft = draft or demo_draft
    from spectandem.devices import bind_cpu_cores, check_cores, resolve_flags, set_cpu_threads

    SmallForwards.check(args.one_thread_up_to, args.one_thread_cores)
    if args.one_thread_cores is not None:   # among the cores it was started with, before --cpu-cores binds it
        check_cores(args.one_thread_cores, "--one-thread-cores")
    bind_cpu_cores(args.cpu_cores)
    set_cpu_threads(args.threads)
    args = resolve_flags(args, target)
    if args.one_thread_cores is not None and is_cuda(str(args.device)):
        raise ValueError(f"--one-thread-cores places CPU forwards; this verifier computes on {args.device}")
    config = EngineConfig.from_args(args, verifier_spec(args), target, draft, args.max_slots)
    tls = server_tls_from_args(args)  # flag and file errors before the model loads
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    serve_verifier(config, args.feature_layers, args.host, args.port, tls=tls, feature_channel=args.feature_channel,
                   tree_channel=args.tree_channel, one_thread_up_to=args.one_thread_up_to,
                   one_thread_cores=args.one_thread_cores)
    return 0
