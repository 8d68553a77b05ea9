"""Links to a drafter and a verifier in other processes, over gRPC (spectandem.v1.Drafter and
spectandem.v1.Verifier; servers: drafter/service.py, verifier/service.py).

The router still never decodes a tensor: a verifier's features arrive as `Tensor` messages and
are handed to the drafter unchanged, and a drafter's trees travel as the `DraftTreeMsg` inside
`DraftHandle.payload` (serialized bytes through this process; decoded only by the verifier).

Status codes -> link errors (servers: spectandem/grpc_server.py):
    FAILED_PRECONDITION                      -> StaleMessage (a tag did not match)
    INVALID_ARGUMENT                         -> ValueError
    UNAVAILABLE, DEADLINE_EXCEEDED, CANCELLED,
    INTERNAL, connection failure, any other  -> EngineUnavailable
Every call has a deadline (`timeout_s`), so a dead or hung engine costs at most that long.
"""

from __future__ import annotations

import asyncio

import grpc

from router.links import GRPC_CALL_TIMEOUT_S, EngineUnavailable
from spectandem.protocol import (AheadReply, DraftHandle, DrafterPrefillItem, EngineInfo, ExtendItem, PlainItem,
                                 Tag, TreeRoute, Verdict, VerifierPrefillItem, VerifierPrefillResult)
from spectandem import codec
from spectandem.grpc_server import LINK_CHANNEL_OPTIONS, MAX_MESSAGE_BYTES, PREFILL_CALL_BYTES
from spectandem.messages import DraftTree, StaleMessage
from spectandem.v1 import engines_pb2, engines_pb2_grpc


class _GrpcLink:
    role = "engine"

    def __init__(self, address: str, timeout_s: float | None = GRPC_CALL_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None):
        """`address` is host:port; `timeout_s` the deadline of every call (None: none);
        `credentials` TLS (spectandem/tls.py; None: plaintext). Construct links inside the event
        loop that uses them (grpc.aio channels belong to one loop)."""
        self.address, self.timeout_s = address, timeout_s
        self.channel = (grpc.aio.secure_channel(address, credentials, options=LINK_CHANNEL_OPTIONS) if credentials
                        else grpc.aio.insecure_channel(address, options=LINK_CHANNEL_OPTIONS))

    async def _call(self, method, request):
        return await self._reply(method(request, timeout=self.timeout_s))

    async def _reply(self, call):
        """The reply of a started call, its failure as the router's errors."""
        try:
            return await call
        except grpc.aio.AioRpcError as exc:
            code, details = exc.code(), exc.details() or ""
            if code == grpc.StatusCode.FAILED_PRECONDITION:
                raise StaleMessage(details) from None
            if code == grpc.StatusCode.INVALID_ARGUMENT:
                raise ValueError(f"{self.role}: {details}") from None   # may reach a client: no address
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details:
                # The same call would fail again: refused, not an engine that is down.
                raise ValueError(f"{self.role}: message over the engine link's limit: {details}") from None
            raise EngineUnavailable(f"{self.role} at {self.address}: {code.name}: {details}") from exc

    async def wait_ready(self, timeout_s: float) -> None:
        """Waits until the channel connects (a server still loading its model is not there yet)."""
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(f"{self.role} at {self.address}: not reachable after {timeout_s} s") from None

    async def close(self) -> None:
        await self.channel.close()


class GrpcVerifierLink(_GrpcLink):
    role = "verifier"

    def __init__(self, address: str, timeout_s: float | None = GRPC_CALL_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None, hands_verdicts: bool = False):
        """`hands_verdicts`: the verifier has a tree channel to its drafter, over which it sends
        the verdicts a verify's `draft_next` names (router/links.py)."""
        super().__init__(address, timeout_s, credentials)
        self.stub = engines_pb2_grpc.VerifierStub(self.channel)
        self.hands_verdicts = hands_verdicts

    async def prefill(self, items: list[VerifierPrefillItem], want_features: bool) -> list[VerifierPrefillResult]:
        request = engines_pb2.VerifierPrefillRequest(items=[codec.verifier_prefill_item_to_msg(i) for i in items],
                                                     want_features=want_features)
        reply = await self._call(self.stub.Prefill, request)
        return [codec.verifier_prefill_result_from_msg(r) for r in reply.results]

    async def verify(self, draft: DraftHandle | None, plain: list[PlainItem], want_features: bool,
                     on_launch=None, draft_next: dict[str, int] | None = None) -> list[Verdict]:
        return (await self.verify_prefill(draft, plain, want_features, [], False, on_launch, draft_next))[0]

    async def verify_prefill(self, draft: DraftHandle | None, plain: list[PlainItem], want_features: bool,
                             items: list[VerifierPrefillItem], prefill_features: bool,
                             on_launch=None, draft_next: dict[str, int] | None = None,
                             ) -> tuple[list[Verdict], list[VerifierPrefillResult]]:
        route = draft.payload if draft is not None and isinstance(draft.payload, TreeRoute) else None
        request = engines_pb2.VerifyRequest(tree=draft.payload if draft is not None and route is None else None,
                                            plain=[codec.plain_item_to_msg(p) for p in plain],
                                            want_features=want_features,
                                            prefill=[codec.verifier_prefill_item_to_msg(i) for i in items],
                                            prefill_features=prefill_features, draft_next=draft_next or {})
        if route is not None:   # the trees come over the tree channel
            request.tree_round, request.tree_wait_ms = route.round_id, max(1, round(route.wait_s * 1000))
            if route.early_after:
                request.early_after = route.early_after
                request.early_tags.extend(codec.tag_to_msg(t) for t in route.early_tags)
        call = self.stub.Verify(request, timeout=self.timeout_s)   # its send goes next on the event loop
        if on_launch is not None:
            # The verifier is another process: nothing here to wait for. What on_launch hands the
            # loop (the round's tokens to their streams) comes after the send, never before it.
            on_launch()
        reply = await self._reply(call)
        return ([codec.verdict_from_msg(r) for r in reply.results],
                [codec.verifier_prefill_result_from_msg(r) for r in reply.prefilled])

    async def features(self, tag: Tag):
        reply = await self._call(self.stub.Features, engines_pb2.FeaturesRequest(tag=codec.tag_to_msg(tag)))
        return reply.features if reply.HasField("features") else None

    async def release(self, request_ids: list[str]) -> None:
        await self._call(self.stub.Release, engines_pb2.ReleaseRequest(request_ids=request_ids))

    async def info(self) -> EngineInfo:
        return codec.engine_info_from_msg(await self._call(self.stub.GetInfo, engines_pb2.EngineInfoRequest()))


class GrpcDrafterLink(_GrpcLink):
    role = "drafter"

    def __init__(self, address: str, timeout_s: float | None = GRPC_CALL_TIMEOUT_S,
                 credentials: grpc.ChannelCredentials | None = None, call_bytes: int = PREFILL_CALL_BYTES,
                 max_message_bytes: int = MAX_MESSAGE_BYTES):
        """`call_bytes`: a prefill whose items (their features inline) come to more goes in
        several calls, each at most this size where its items allow; `max_message_bytes`: the
        channel's limit, over which an item is refused before anything is sent."""
        super().__init__(address, timeout_s, credentials)
        self.stub = engines_pb2_grpc.DrafterStub(self.channel)
        self.call_bytes, self.max_message_bytes = call_bytes, max_message_bytes

    async def prefill(self, items: list[DrafterPrefillItem]) -> list[str]:
        msgs = [codec.drafter_prefill_item_to_msg(i) for i in items]
        sizes = [m.ByteSize() for m in msgs]
        for item, size in zip(items, sizes):
            if size > self.max_message_bytes - 1024:
                raise ValueError(f"drafter prefill of request {item.tag.request_id}: {size} bytes, over the engine "
                                 f"link's limit of {self.max_message_bytes} (use a feature channel)")
        unknown: list[str] = []
        start = 0
        while start < len(msgs):   # consecutive items up to call_bytes (at least one a call)
            end, total = start + 1, sizes[start]
            while end < len(msgs) and total + sizes[end] <= self.call_bytes:
                total += sizes[end]
                end += 1
            request = engines_pb2.DrafterPrefillRequest(items=msgs[start:end])
            unknown += (await self._call(self.stub.Prefill, request)).unknown_request_ids
            start = end
        return unknown

    async def draft(self, tags: list[Tag], num_steps: list[int | None] | None = None,
                    extend: list[ExtendItem] = (), post_round: int = 0) -> DraftHandle:
        request = engines_pb2.DraftRequest(tags=[codec.tag_to_msg(t) for t in tags],
                                           num_steps=[n or 0 for n in num_steps] if num_steps else [],
                                           extend=[codec.extend_item_to_msg(i) for i in extend], post_round=post_round)
        reply = await self._call(self.stub.Draft, request)
        unknown = list(reply.unknown_request_ids)
        if reply.posted:
            return DraftHandle([codec.tag_from_msg(t) for t in reply.posted_tags], None, unknown, posted=True)
        if not reply.HasField("tree"):
            return DraftHandle([], None, unknown)
        return DraftHandle([codec.tag_from_msg(t) for t in reply.tree.tags], reply.tree, unknown)

    async def draft_ahead(self, tags: list[Tag], extend: list[ExtendItem] = ()) -> AheadReply:
        reply = await self._call(self.stub.DraftAhead, engines_pb2.DraftAheadRequest(
            tags=[codec.tag_to_msg(t) for t in tags], extend=[codec.extend_item_to_msg(i) for i in extend]))
        try:
            return codec.ahead_reply_from_msg(reply)
        except ValueError as exc:   # a drafter that sends malformed trees is broken, not the router's caller
            raise EngineUnavailable(f"drafter sent a malformed DraftAheadReply: {exc}") from exc

    def ready_handle(self, tree: DraftTree, tags: list[Tag]) -> DraftHandle:
        return DraftHandle(list(tags), codec.draft_tree_to_msg(tree, [t.epoch for t in tags]))

    async def extend(self, items: list[ExtendItem]) -> list[str]:
        request = engines_pb2.ExtendRequest(items=[codec.extend_item_to_msg(i) for i in items])
        return list((await self._call(self.stub.Extend, request)).unknown_request_ids)

    async def release(self, request_ids: list[str], keep_draft: bool = False,
                      outputs: dict[str, list[int]] | None = None) -> None:
        ended = [engines_pb2.EndedOutput(request_id=rid, token_ids=ids) for rid, ids in (outputs or {}).items()]
        await self._call(self.stub.Release, engines_pb2.ReleaseRequest(request_ids=request_ids, keep_draft=keep_draft,
                                                                       outputs=ended))

    async def info(self) -> EngineInfo:
        return codec.engine_info_from_msg(await self._call(self.stub.GetInfo, engines_pb2.EngineInfoRequest()))
