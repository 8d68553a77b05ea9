"""What the router keeps per request, what it streams, and what it counts. No torch here."""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

from router.detok import Detokenizer
from router.pipeline import AHEAD_EDGE
from spectandem.protocol import Tag
from spectandem.config import SamplingParams


@dataclass
class StreamEvent:
    """What a request's stream carries inside the router: tokens committed since the previous
    event, in the server's own terms (the gRPC server and the HTTP front turn it into their
    responses; the SDK's public `spectandem.Chunk` is made from those)."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    prompt_tokens: int = 0


@dataclass
class Failure:
    code: str          # a grpc.StatusCode name: UNAVAILABLE, INTERNAL, RESOURCE_EXHAUSTED, ...
    message: str


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # queued, never admitted
    RUNNING = "running"        # in the running batch
    PREEMPTED = "preempted"    # taken out of the batch for KV room, queued to resume
    FINISHED = "finished"      # ended by EOS, a stop, max_tokens or the context
    FAILED = "failed"          # ended by an error (its Failure was streamed)
    CANCELLED = "cancelled"    # ended by its client (cancel, disconnect, deadline)


ENDED = frozenset({RequestStatus.FINISHED, RequestStatus.FAILED, RequestStatus.CANCELLED})


@dataclass(eq=False)   # identity: a request is itself, never equal to another
class ServedRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    detok: Detokenizer
    epoch: int = 0
    tokens: list[int] = field(default_factory=list)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    status: RequestStatus = RequestStatus.WAITING
    on_verifier: bool = False
    on_drafter: bool = False         # the drafter holds this request's state, in sync
    detached: bool = False           # admitted while "auto" had settled on plain: no drafter (router/pipeline.py)
    drafter_refused: bool = False    # the drafter refused its prefill: it decodes without drafts
    num_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    fallback_rounds: int = 0         # rounds without a draft because the drafter was unavailable
    plain_rounds: int = 0            # rounds without a draft because speculation was switched off
    started: float = field(default_factory=time.monotonic)
    admit_seq: int = -1              # order of first admission (preemption takes the latest)
    drafter_kept: bool = False       # preempted; the drafter keeps its next tree until released
    # Catch-ups held back (router/loop.py): those of rounds this request decoded plainly, and
    # an all-hit verdict's (the next verify goes out first). The drafter gets them in order, in
    # one call: with the next draft-ahead call, before the next draft, before the next round's
    # own catch-up, or before a preempting release.
    backlog: list = field(default_factory=list)
    # Draft ahead (router/loop.py): the outcome trees the drafter filled for the round in flight
    # (committed_len it was verified at, outcome -> ReadyTree), and the next tree they gave for
    # the verdict (committed_len, ReadyTree): verified without a draft call.
    ahead_trees: tuple | None = None
    next_tree: tuple | None = None

    @property
    def done(self) -> bool:
        """It has ended: nothing more is streamed, and its id may be used again."""
        return self.status in ENDED

    @property
    def resuming(self) -> bool:
        return self.status is RequestStatus.PREEMPTED

    @property
    def committed_len(self) -> int:
        return len(self.prompt_ids) + len(self.tokens)

    def tag(self) -> Tag:
        return Tag(self.request_id, self.epoch, self.committed_len)

    def context_left(self, max_len: int) -> int:
        """How many tokens a context of max_len still holds for it."""
        return max_len - self.committed_len + 1

    def tokens_left(self, max_len: int) -> int:
        """How many tokens it may still generate: its max_tokens, and a context of max_len."""
        return min(self.params.max_tokens - len(self.tokens), self.context_left(max_len))

    def stats(self) -> dict:
        al = (self.accepted_tokens + self.num_rounds) / self.num_rounds if self.num_rounds else 0.0
        return {"num_rounds": self.num_rounds, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accept_length": round(al, 4),
                "fallback_rounds": self.fallback_rounds, "plain_rounds": self.plain_rounds}


@dataclass
class RouterCounters:
    """Monotonic counters since start (read by GetServerStats, `spectandem stats` and /metrics)."""

    rounds: int = 0                  # verification rounds (one batched verify each)
    num_drafts: int = 0              # request-rounds verified with a draft
    draft_tokens: int = 0            # draft tokens verified
    accepted_tokens: int = 0         # draft tokens accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [i]: drafts accepted at depth i + 1
    # Request-rounds decoded without a draft while a drafter is configured, by cause: the drafter
    # was unavailable (absent, failing, too slow, or it refused the request) ...
    fallback_rounds: int = 0
    # ... or speculation was switched off: "auto" chose plain, the acceptance switch, a request
    # admitted without the drafter, a tree that does not fit the context; or the request joined
    # beside the round's draft (router/loop.py `_admits_beside_draft`).
    plain_rounds: int = 0
    drafter_outages: int = 0         # times the drafter became unavailable
    preemptions: int = 0
    resumes: int = 0
    stale_dropped: int = 0           # replies of an old epoch or committed length, dropped unapplied
    draft_ahead_hits: int = 0
    draft_ahead_misses: int = 0
    ready_trees: int = 0             # request-rounds verified with a tree the router held (no draft call)
    posted_trees: int = 0            # request-rounds whose trees went drafter -> verifier (the tree channel)
    early_tree_rounds: int = 0       # rounds the early trees (drafted on the last verdicts) served without a draft call
    detached_admissions: int = 0     # requests admitted without the drafter ("auto" settled on plain)
    detached_running: int = 0        # running requests that left the drafter when "auto" settled on plain
    mixed_prefills: int = 0          # requests sent with a round's verify to be prefilled in its step (RouterConfig.mixed_prefill)
    # Those whose drafter prefill went with that verify's verdicts, the verifier to the drafter
    # over the tree channel, instead of a prefill call (router/loop.py `_sequential_round`).
    prefills_with_verdicts: int = 0
    # Verification rounds by the pipeline mode that ran them (router/pipeline.py); they add up to `rounds`.
    mode_rounds: dict[str, int] = field(default_factory=dict)
    requests_admitted: int = 0
    requests_finished: int = 0
    requests_failed: int = 0
    requests_cancelled: int = 0

    def add_accepted(self, num_accepted: int) -> None:
        if len(self.accepted_per_pos) < num_accepted:
            self.accepted_per_pos.extend([0] * (num_accepted - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    max_len: int                     # context length (prompt + completion)
    eos_token_ids: tuple[int, ...]
    lookahead: int                   # cache entries past the committed prefix a round may write
    want_features: bool              # the drafter reads target features
    max_running: int = 64            # requests in the running batch (engine slots)
    drafter_timeout: float = 10.0    # seconds a drafter call may take before the round goes on without it
    probe_interval: float = 1.0      # seconds between health probes of a failed engine
    kv_blocks: int = 0               # verifier KV pool (0: not paged, unlimited here)
    kv_block_size: int = 16
    draft_kv_blocks: int = 0         # drafter KV pool (0: none or unlimited)
    draft_kv_block_size: int = 16
    # "sequential": draft, verify, extend per round; "pingpong": two micro-batches overlap the
    # drafter with the verifier; "ahead": the drafter prepares the next trees for the likeliest
    # outcomes while the verifier verifies (router/pipeline.py); "auto": measured choice.
    pipeline: str = "auto"
    pingpong_min_batch: int = 2
    # How much faster "ahead" must measure than sequential and ping-pong to be kept over them in
    # "auto" (router/pipeline.py: AHEAD_EDGE; serve sets AHEAD_EDGE_OWN_STREAM where the drafter
    # drafts ahead on a GPU stream of its own in the router's process).
    ahead_edge: float = AHEAD_EDGE
    # Draft lengths "auto" also tries from 2 * pingpong_min_batch requests (tree depth caps, for
    # requests whose tokens do not depend on the tree).
    short_draft_steps: tuple[int, ...] = (1, 2)
    # Requests whose drafts are sampled at this setting (SamplingParams.drafts_sampled): speculation
    # is never switched off for them (a plain round changes their seeded tokens). For the others a
    # plain round draws the same tokens as a speculative one, so switching off is invisible. Must
    # equal the drafter's setting.
    draft_sampling_min_temperature: float = 0.5
    mode_window: int = 8                      # rounds per measurement of a pipeline mode in "auto"
    max_keep_seconds: float = 4.0             # "auto" keeps a mode at most this long between measurements
    adaptive_window: int = 64                 # drafted request-rounds per acceptance check (0: off)
    adaptive_min_accept_length: float = 1.1   # below this, drafting costs more than it gains
    adaptive_off_rounds: int = 32             # plain rounds before speculation is tried again
    # Tokens a plain round decodes per request when every request of the round is greedy and
    # undrafted (VerifierEngine.decode: the steps chained on the device, one call and one wait
    # for all). 1: a plain round is one step. Bounded by each request's remaining max_tokens and
    # context; tokens stream in chunks of this many, and new requests join between rounds.
    plain_steps: int = 1
    # Benchmark mode (serve --benchmark-acceptance-rate): the drafter learns each request's output
    # (drafter/controlled.py): a greedy request's prompt and committed tokens go with its release
    # (router/loop.py `_release_on_drafter`), whether the drafter holds it or not.
    drafter_learns_outputs: bool = False
    # A sequential round admits new requests while the drafter drafts for the running ones (the
    # verifier prefills meanwhile: router/loop.py `_admits_beside_draft`; serve --overlap-admission,
    # off by default). Off: they ride in the round's verify step (`mixed_prefill`), else admission
    # comes first.
    admit_beside_draft: bool = False
    # New requests are prefilled in the step of the round's verify, their prompts' tokens beside
    # the running requests' (router/loop.py `_mixes`; serve --mixed-prefill, on by default); where
    # the verifier cannot carry them all, it prefills the rest on its own. Off: a prefill of their own.
    mixed_prefill: bool = True
    # The drafter sends a sequential round's trees straight to the verifier over the tree channel
    # (spectandem/channel/trees.py), so the round's draft and verify calls go out together
    # (router/loop.py `_sequential_round`). Serve turns it on where it opened the channel.
    tree_channel: bool = False

    def __post_init__(self):
        if self.pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {', '.join(PIPELINES)}; got {self.pipeline!r}")
        if not self.ahead_edge >= 1.0:
            raise ValueError(f"ahead_edge must be >= 1.0 (ahead kept only where it measured at least as fast), "
                             f"got {self.ahead_edge}")
        if any(n < 1 for n in self.short_draft_steps):
            raise ValueError(f"short_draft_steps must be >= 1, got {self.short_draft_steps}")
        if isinstance(self.plain_steps, bool) or not isinstance(self.plain_steps, int) or self.plain_steps < 1:
            raise ValueError(f"plain_steps must be an integer >= 1, got {self.plain_steps!r}")


PIPELINES = ("auto", "sequential", "pingpong", "ahead")
