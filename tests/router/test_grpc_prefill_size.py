"""A drafter prefill over gRPC whose features come to more than one call should carry
(router/links_grpc.py `GrpcDrafterLink.prefill`): it goes in several calls, each within the
link's call size, every item once and in order; an item over the channel's limit is refused
(ValueError, which the router turns into decoding without drafts) before anything is sent. A
real grpc.aio server with a drafter service that records the calls it gets."""

from __future__ import annotations

import asyncio

import grpc
import torch

from router.links_grpc import GrpcDrafterLink
from spectandem.config import SamplingParams
from spectandem.grpc_server import CHANNEL_OPTIONS
from spectandem.protocol import DrafterPrefillItem, Tag
from spectandem.v1 import engines_pb2, engines_pb2_grpc

FEATURE_BYTES = 3 * 64 * 4   # one token's features: [1, 192] fp32


class _Recording(engines_pb2_grpc.DrafterServicer):
    def __init__(self):
        self.calls: list[list[str]] = []

    async def Prefill(self, request, context):
        self.calls.append([m.tag.request_id for m in request.items])
        return engines_pb2.DrafterReply(unknown_request_ids=[m.tag.request_id for m in request.items
                                                             if m.tag.request_id.endswith("-x")])


def _item(rid: str, tokens: int) -> DrafterPrefillItem:
    feats = torch.zeros(tokens, FEATURE_BYTES // 4)
    return DrafterPrefillItem(Tag(rid, 0, tokens + 1), list(range(tokens)), 5, SamplingParams(), 0, feats)


def _run(items, **link_args):
    async def main():
        servicer = _Recording()
        server = grpc.aio.server(options=CHANNEL_OPTIONS)
        engines_pb2_grpc.add_DrafterServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        link = GrpcDrafterLink(f"127.0.0.1:{port}", 10.0, **link_args)
        try:
            try:
                return await link.prefill(items), servicer.calls
            except ValueError as exc:
                return exc, servicer.calls
        finally:
            await link.close()
            await server.stop(0)

    return asyncio.run(main())


def test_a_large_prefill_goes_in_several_calls_each_within_the_call_size():
    items = [_item(f"r{i}", 100) for i in range(10)] + [_item("r10-x", 100)]   # about 77 KB each
    unknown, calls = _run(items, call_bytes=200_000)
    assert [rid for call in calls for rid in call] == [i.tag.request_id for i in items]
    assert [len(c) for c in calls] == [2, 2, 2, 2, 2, 1]
    assert unknown == ["r10-x"]   # the replies' unknown ids, gathered over the calls


def test_a_prefill_within_the_call_size_is_one_call():   # negative control of the split
    items = [_item(f"r{i}", 100) for i in range(10)]
    _, calls = _run(items)
    assert len(calls) == 1 and len(calls[0]) == 10


def test_an_item_over_the_channel_limit_is_refused_before_anything_is_sent():
    items = [_item("small", 10), _item("long", 4000)]   # about 3 MB of features
    exc, calls = _run(items, max_message_bytes=1_000_000)
    assert isinstance(exc, ValueError) and calls == []
    assert "request long" in str(exc) and "limit of 1000000" in str(exc)
