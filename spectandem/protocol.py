"""The engine protocol: the messages the router exchanges with the drafter and the verifier.

These are the engines' own call and reply types (drafter/engine.py, verifier/engine.py and their
Ray actors and gRPC services take and return them; spectandem/codec.py maps them to the wire's
protobuf messages). The router deals in them as ids, tokens, counts and opaque handles: a draft
tree and a request's features travel as `Any` handles (in-process: the objects; Ray: object refs;
gRPC: serialized protobuf messages).

Every call carries a `Tag` per request (request id, epoch, committed length); an engine refuses
one whose tag is not its own (spectandem.messages.StaleMessage).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spectandem.config import SamplingParams
from spectandem.messages import ReadyTree


@dataclass(frozen=True)
class Tag:
    request_id: str
    epoch: int
    committed_len: int


@dataclass
class VerifierPrefillItem:
    tag: Tag                       # committed_len = prompt length
    prompt_ids: list[int]
    params: SamplingParams         # seed always set
    seed: int
    resume: bool = False           # after preemption: prompt_ids = every committed token, no sampling


@dataclass
class VerifierPrefillResult:
    tag: Tag                       # committed_len = prompt length + 1
    first_token_id: int
    features: Any                  # opaque handle for the drafter, or None
    with_verdicts: bool = False    # its drafter prefill went with the verify's verdicts (verify steps)


@dataclass
class PlainItem:
    """A request decoded without a draft this round (its tree is just the root)."""

    tag: Tag
    last_token_id: int
    # Tokens to decode (greedy only; every item of a round without drafts alike): > 1 runs
    # `steps` plain steps in one call (VerifierEngine.decode).
    steps: int = 1
    # With steps > 1: the router expects to ask for this request's next `steps` tokens (or fewer)
    # in its next call, nothing else changing (no request to admit or ending, the same mode); a
    # verifier that decodes ahead queues that decode (verifier/engine.py).
    again: bool = False


@dataclass
class Verdict:
    """The verifier's verdict for one request of a round: what it commits and the target
    features the drafter's catch-up needs. The verifier engine returns these; its services and
    links hand them on with `features` as the link's handle."""

    tag: Tag                       # committed_len after this round's tokens were committed
    token_ids: list[int]           # accepted drafts, then the bonus or correction token
    num_accepted: int
    num_draft_tokens: int
    # From the engine: [num_accepted + 1, F], the target features at the root and each accepted
    # node (the pairs the drafter's catch-up needs), or None when the drafter reads none. Across
    # a link: that link's opaque handle for them.
    features: Any
    # The verifier sent it to the drafter over the tree channel (a verify with `draft_next`).
    to_drafter: bool = False

    @property
    def request_id(self) -> str:
        return self.tag.request_id

    @property
    def committed_len(self) -> int:
        return self.tag.committed_len


@dataclass
class DrafterPrefillItem:
    tag: Tag                       # committed_len = len(prompt_ids) + 1
    prompt_ids: list[int]
    first_token_id: int
    params: SamplingParams
    seed: int
    features: Any


@dataclass
class ExtendItem:
    tag: Tag                       # committed_len after the round
    token_ids: list[int]
    features: Any


@dataclass
class DraftHandle:
    """A round's trees for `tags` (opaque `payload`; None with no tags). `unknown`: ids of the
    draft call's catch-up the drafter does not hold (no tree for them: re-prefill them).
    `posted`: the drafter sent the trees to the verifier over the tree channel (the draft call's
    `post_round`), and `payload` is None."""

    tags: list[Tag]
    payload: Any
    unknown: list[str] = field(default_factory=list)
    posted: bool = False


@dataclass(frozen=True)
class TreeRoute:
    """A verify's `DraftHandle.payload` when the round's trees come over the tree channel
    (spectandem/channel/trees.py): those the drafter posts as round `round_id`, waited for at
    most `wait_s` seconds. `early_after`, `early_tags`: a round the router makes no draft call
    for, which only the trees the drafter posted early on the verdicts of round `early_after`
    (its previous tree round) serve, where they hold every one of `early_tags` (the round's
    requests, in order); where they do not, the verify goes on at once without them. 0 and ()
    for a round whose draft call posts its trees."""

    round_id: int
    wait_s: float
    early_after: int = 0
    early_tags: tuple = ()


@dataclass
class AheadReply:
    """The drafter's answer to draft_ahead, per tag: whether the tree now being verified came
    from the outcome cache (`hits`; None: there was no cache), and the cache it filled for that
    tree's verdict (`trees`: the round's committed tokens -> the next tree; None where it holds
    none the router may use, e.g. sampled drafts). With it the router verifies a hit's next tree
    without asking the drafter (router/loop.py)."""

    hits: list[bool | None]
    trees: list[dict[tuple[int, ...], ReadyTree] | None]
    unknown: list[str] = field(default_factory=list)   # ids of `extend` the drafter does not hold


@dataclass
class EngineInfo:
    role: str
    model: str
    kind: str
    vocab_size: int
    max_len: int
    max_slots: int
    used_slots: int
    feature_layers: Any = None
    extra: dict = field(default_factory=dict)
    kv: dict = field(default_factory=dict)   # num_blocks, block_size, used_blocks (paged caches)
    # A verifier that decodes ahead: {"taken": decodes that took a queued chunk, "forgotten":
    # queued chunks forgotten unused}; empty otherwise.
    decode_ahead: dict = field(default_factory=dict)
    # The engine's calls: {"busy_s": {kind: seconds inside}, "count": {kind: how many}}
    # (spectandem/call_clock.py, kept by each link's engine side); empty where nothing counts them.
    calls: dict = field(default_factory=dict)
