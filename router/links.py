"""How the router reaches the drafter and the verifier: one small async interface, three
implementations (in-process in router/links_local.py; Ray actors in router/links_ray.py; gRPC
stubs in router/links_grpc.py), whose methods are the RPCs of the `Verifier` and `Drafter`
services of proto/spectandem/v1/engines.proto (and `ready_handle`, a handle made locally).

The router deals in ids, tokens and counts. Tensors never pass through it as tensors: a draft
tree and a request's features travel as opaque handles that one link returns and the other
accepts (in-process: the objects; Ray: object refs, moved actor to actor by the object store;
gRPC: serialized protobuf messages).

Errors: a link raises `EngineUnavailable` when its engine cannot be reached or failed; the
router then falls back (drafter) or fails the affected requests with UNAVAILABLE (verifier).
A `StaleMessage` from an engine means a tag (epoch, committed length) did not match.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from spectandem.messages import DraftTree
from spectandem.protocol import (AheadReply, DraftHandle, DrafterPrefillItem, EngineInfo, ExtendItem, PlainItem,
                                 Tag, Verdict, VerifierPrefillItem, VerifierPrefillResult)


# The deadline of every call the router makes to an engine process, unless serve's
# --engine-call-timeout says otherwise: a verifier that does not answer within it fails the
# requests it holds. Ray's is longer: an actor call also waits for Ray's own scheduling.
GRPC_CALL_TIMEOUT_S = 30.0
RAY_CALL_TIMEOUT_S = 120.0


class EngineUnavailable(Exception):
    """The engine behind a link is unreachable or failed."""


class EngineStartError(RuntimeError):
    """An engine that serve started failed before it was ready (the message carries its own error)."""


class DuplicateRequest(Exception):
    """A request id that a request which has not ended already uses (ALREADY_EXISTS on the wire)."""


class VerifierLink(Protocol):
    async def prefill(self, items: list[VerifierPrefillItem], want_features: bool) -> list[VerifierPrefillResult]: ...

    async def verify(self, draft: DraftHandle | None, plain: list[PlainItem], want_features: bool,
                     on_launch: Callable[[], None] | None = None) -> list[Verdict]:
        """Verifies the drafted trees and the plain rows in one batch; results in the order
        draft.tags then plain. A `draft.payload` that is a spectandem.protocol.TreeRoute (links to other processes):
        the trees are those the drafter posts over the tree channel for that round, and the
        requests of trees that do not come get no result. `on_launch()` (from any thread) once the verifier's host work
        before the forward is done: the router starts the drafter's work of an "ahead" round
        then, which in-process engines (one Python lock) would otherwise make the verifier wait
        for. Links to other processes call it at once.

        A link whose `hands_verdicts` is True (in-process engines with a worker thread each,
        router/links_local.py) also takes `draft_next` (request id -> committed length): the
        verdicts of those requests go straight to the drafter, which catches up and drafts the
        next trees of those whose new committed length is below the bound, so the next draft
        call for the same tags finds them made. The router still sends that call, with the same
        catch-up, and the drafter leaves out what it already absorbed."""

    async def verify_prefill(self, draft: DraftHandle | None, plain: list[PlainItem], want_features: bool,
                             items: list[VerifierPrefillItem], prefill_features: bool,
                             on_launch: Callable[[], None] | None = None
                             ) -> tuple[list[Verdict], list[VerifierPrefillResult]]:
        """`verify` with `items` prefilled in the same step where the verifier carries them
        (else before it, as `prefill` would) -> (the verdicts, the prefill results in the items'
        order, with features where `prefill_features`). A refused item refuses the whole call
        (ValueError) before anything runs. `draft_next` as `verify`'s, where `hands_verdicts`."""

    async def features(self, tag: Tag) -> Any:
        """Features of every committed position but the last (to rebuild a drafter's state)."""

    async def release(self, request_ids: list[str]) -> None: ...

    async def info(self) -> EngineInfo: ...

    async def close(self) -> None: ...


class DrafterLink(Protocol):
    async def prefill(self, items: list[DrafterPrefillItem]) -> list[str]:
        """Returns the ids it did not take (none normally)."""

    async def draft(self, tags: list[Tag], num_steps: list[int | None] | None = None,
                    extend: list[ExtendItem] = (), post_round: int = 0) -> DraftHandle:
        """The round's trees; per tag, a new one at most `num_steps[i]` deep (None: as configured).
        `extend` first (as `extend` would): the handle leaves out the tags of the ids it reports
        unknown (`DraftHandle.unknown`), and has no payload when no tag is left. `post_round`
        (nonzero; links to engines with a tree channel, spectandem/channel/trees.py): the drafter
        sends the trees to the verifier as that round instead (`DraftHandle.posted`, no payload),
        or says it could not (`posted` False, the trees in the payload)."""

    async def draft_ahead(self, tags: list[Tag], extend: list[ExtendItem] = ()) -> AheadReply:
        """Called while the trees of `tags` are verified: fill the outcome cache for them, after
        absorbing `extend` (as `extend` would; its unknown ids come back in the reply, and their
        tags get no cache)."""

    def ready_handle(self, tree: DraftTree, tags: list[Tag]) -> DraftHandle:
        """A handle the verifier link takes for a tree the router built (`trees_from_ready`)."""

    async def extend(self, items: list[ExtendItem]) -> list[str]:
        """Returns the request ids the drafter does not know (it restarted): re-prefill them."""

    async def release(self, request_ids: list[str], keep_draft: bool = False,
                      outputs: dict[str, list[int]] | None = None) -> None:
        """keep_draft: keep each request's next tree for its re-prefill (preemption). `outputs`
        (benchmark mode: RouterConfig.drafter_learns_outputs): request id -> its prompt and
        committed tokens, for greedy requests that ended, held by the drafter or not."""

    async def info(self) -> EngineInfo: ...

    async def close(self) -> None: ...
