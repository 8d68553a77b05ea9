"""What the SDK (spectandem/client.py) sends and receives: the results it returns (`Chunk`,
`Completion`) made from `spectandem.v1.Generation`'s responses, and the requests it builds from a
prompt and `SamplingParams`. No channel, retry or deadline here: those are the client's."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import grpc

from spectandem.config import SamplingParams
from spectandem.errors import InternalError
from spectandem.v1 import common_pb2, generation_pb2

# How soon a channel tries again to connect to a server it could not reach: gRPC's own backoff
# (1 s, growing 1.6x a try up to 120 s) noticed a server that came up after 7 s about 1.8 s late,
# and after a long outage it waits up to two minutes between tries. A server that starts (an
# engine loading its model) or comes back is seen within 0.1-1 s.
RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                     ("grpc.max_reconnect_backoff_ms", 1000)]

Prompt = str | Sequence[int]


# ---------------------------------------------------------------------------------- results

@dataclass(frozen=True)
class Chunk:
    """Tokens committed since the previous chunk. `finish_reason` ("stop", "length", "abort") and
    `stats` (as in `Completion.stats`) are set on the last chunk only."""

    token_ids: list[int]
    text: str
    finish_reason: str | None = None
    stats: dict | None = None
    request_id: str = ""


@dataclass(frozen=True)
class Completion:
    """A whole completion. `stats`: num_rounds, draft_tokens, accepted_tokens, accept_length
    (committed tokens per round, bonus included), fallback_rounds (rounds decoded without a
    draft because the drafter was unavailable), plain_rounds (without a draft because speculation
    was switched off) and prompt_tokens."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> Completion:
        """Join a whole stream's chunks (the last one carrying the finish reason)."""
        if not chunks or chunks[-1].finish_reason is None:
            raise InternalError(grpc.StatusCode.INTERNAL, "the stream ended without a finish_reason")
        last = chunks[-1]
        return cls(request_id=last.request_id, text="".join(c.text for c in chunks),
                   token_ids=[t for c in chunks for t in c.token_ids], finish_reason=last.finish_reason,
                   stats=last.stats or {})


def _stats_dict(s: common_pb2.SpecStats, prompt_tokens: int) -> dict:
    # accept_length from the integer counts (the wire float32 would print as 2.3333332538604736),
    # rounded as the in-process `Stats.as_dict` does.
    accept_length = (s.accepted_tokens + s.num_rounds) / s.num_rounds if s.num_rounds else 0.0
    return {"num_rounds": s.num_rounds, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "accept_length": round(accept_length, 4), "fallback_rounds": s.fallback_rounds,
            "plain_rounds": s.plain_rounds, "prompt_tokens": prompt_tokens}


class _ChunkReader:
    """Turns one stream's responses into Chunks; remembers the prompt length (first response) for
    the last chunk's stats, and whether anything has arrived (after which no retry is allowed)."""

    def __init__(self):
        self.started = False
        self.prompt_tokens = 0

    def chunk(self, r: generation_pb2.GenerateResponse) -> Chunk:
        if not self.started:
            self.started = True
            self.prompt_tokens = r.prompt_tokens
        stats = _stats_dict(r.stats, self.prompt_tokens) if r.HasField("stats") else None
        return Chunk(token_ids=list(r.token_ids), text=r.text, finish_reason=r.finish_reason or None,
                     stats=stats, request_id=r.request_id)


# ---------------------------------------------------------------------------------- requests

def params_to_proto(p: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p,
                                    top_k=p.top_k, stop_token_ids=p.stop_token_ids, stop=p.stop,
                                    ignore_eos=p.ignore_eos)
    if p.seed is not None:  # unset = the server draws one
        msg.seed = p.seed
    return msg


def build_request(prompt: Prompt, params: SamplingParams | None, request_id: str | None
                  ) -> generation_pb2.GenerateRequest:
    req = generation_pb2.GenerateRequest(request_id=request_id or "",
                                         params=params_to_proto(params or SamplingParams()))
    if isinstance(prompt, str):
        req.text = prompt
        return req
    try:
        if isinstance(prompt, (bytes, bytearray)):
            raise TypeError
        req.token_ids.ids.extend(operator.index(t) for t in prompt)  # numpy ints welcome
    except TypeError:
        raise TypeError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}") from None
    return req


def _model_info_dict(info: generation_pb2.ModelInfo) -> dict:
    """ModelInfo's fields by name; None for an optional field the server left unset."""
    return {f.name: getattr(info, f.name) if not f.has_presence or info.HasField(f.name) else None
            for f in info.DESCRIPTOR.fields}
