"""The reference speculative loop, in one process. Read this first.

    prefill  : verifier runs the prompt, samples the first token, returns the prompt's features;
               drafter absorbs them (its catch-up pass)
    repeat   : drafter.draft   -> a tree per request (root = last committed token)
               verifier.verify -> accepted drafts + one bonus/correction token per request,
                                  and the target features of the accepted path
               commit          -> append tokens, stop on a stop token / max_tokens / context end
               drafter.extend  -> catch-up on the accepted tokens with the real target features

Every later process split (Ray actors, gRPC services, the router) must produce exactly the tokens
this loop produces. `LocalCompletion.stats` counts rounds, drafted and accepted tokens;
accept_length = committed tokens per verification round, bonus included.
"""

from __future__ import annotations

from dataclasses import dataclass, field


from spectandem.config import SamplingParams
from spectandem.messages import concat_trees, root_only_tree


@dataclass
class Stats:
    num_rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0

    @property
    def accept_length(self) -> float:
        return (self.accepted_tokens + self.num_rounds) / self.num_rounds if self.num_rounds else 0.0

    def as_dict(self) -> dict:
        return {"num_rounds": self.num_rounds, "draft_tokens": self.draft_tokens,
                "accepted_tokens": self.accepted_tokens, "accept_length": round(self.accept_length, 4)}


@dataclass
class LocalCompletion:
    """One request's result in process (LocalSpeculator, the reference loop): token ids and
    `Stats`, no text. The SDK's `spectandem.Completion` is what a server returns."""

    request_id: str
    prompt_ids: list[int]
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    stats: Stats = field(default_factory=Stats)


def take_tokens(num_generated: int, tokens: list[int], params: SamplingParams, eos: tuple[int, ...],
                committed_len: int, max_len: int) -> tuple[int, str | None]:
    """How many of a round's `tokens` a completion keeps, and why it ends (None: it goes on).

    It ends after a stop token (eos unless ignore_eos), at max_tokens, or when the committed
    sequence fills the context. Shared by this loop and the router, so both stop alike."""
    stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos))
    for i, t in enumerate(tokens):
        if t in stops:
            return i + 1, "stop"
        if num_generated + i + 1 >= params.max_tokens:
            return i + 1, "length"
    return len(tokens), ("length" if committed_len >= max_len else None)


def _append(c: LocalCompletion, tokens: list[int], params: SamplingParams, eos: tuple[int, ...],
            committed_len: int, max_len: int) -> None:
    n, reason = take_tokens(len(c.token_ids), tokens, params, eos, committed_len, max_len)
    c.token_ids.extend(tokens[:n])
    c.finish_reason = reason


def generate(verifier, drafter, prompts: list[list[int]], params: list[SamplingParams],
             eos_token_ids: tuple[int, ...] = (), lookahead: int = 1,
             request_ids: list[str] | None = None, fused=None, ahead: bool = False) -> list[LocalCompletion]:
    """Speculative generation for a batch of prompts. `drafter` None means plain decoding;
    `lookahead` is how many cache entries past the committed prefix a round may write on either
    side (tree nodes, draft scratch). `fused` (a FusedStep) makes verify + extend + the next
    draft one call per round. `ahead`: the drafter fills its outcome cache for each round's
    trees before they are verified (what the router overlaps with the verify)."""
    ids = request_ids or [f"req-{i}" for i in range(len(prompts))]
    seeds = [p.resolved_seed() for p in params]
    by_id = {rid: (LocalCompletion(rid, list(p)), sp) for rid, p, sp in zip(ids, prompts, params)}
    for out in verifier.prefill(ids, prompts, params, seeds):
        c, sp = by_id[out.request_id]
        _append(c, [out.first_token_id], sp, eos_token_ids, len(c.prompt_ids) + 1, verifier.max_len)
        if drafter is not None and c.finish_reason is None:
            drafter.add(out.request_id, c.prompt_ids, out.first_token_id, sp, seeds[ids.index(out.request_id)],
                        out.features)
    active = [rid for rid in ids if by_id[rid][0].finish_reason is None]
    next_tree = None  # fused mode: the next round's draft, made in the same step
    while active:
        lens = [verifier.committed_len(rid) for rid in active]
        # Speculate where the whole round still fits in the context; the rest decode plainly.
        fits = [rid for rid, n in zip(active, lens) if drafter is not None and n - 1 + lookahead <= verifier.max_len]
        rest = [(rid, n) for rid, n in zip(active, lens) if rid not in fits]
        plain = root_only_tree([r for r, _ in rest], [n for _, n in rest], [by_id[r][0].token_ids[-1] for r, _ in rest])
        if fits and not rest and fused is not None:
            tree = next_tree.select(fits) if next_tree is not None else drafter.draft(fits)
            outs, next_tree = fused(tree)
        else:
            tree = drafter.draft(fits) if fits else None
            if tree is not None and ahead:
                drafter.draft_ahead(fits)
            tree = plain if tree is None else (tree if not rest else concat_trees(tree, plain))
            outs, next_tree = verifier.verify(tree), None
        still = []
        for out in outs:
            c, sp = by_id[out.request_id]
            c.stats.num_rounds += 1
            c.stats.draft_tokens += out.num_draft_tokens
            c.stats.accepted_tokens += out.num_accepted
            _append(c, out.token_ids, sp, eos_token_ids, out.committed_len, verifier.max_len)
            if c.finish_reason is None:
                still.append(out)
            else:
                verifier.release(out.request_id)
                if drafter is not None:
                    drafter.remove(out.request_id)
        if drafter is not None and still and next_tree is None:
            drafter.extend(still)
        active = [o.request_id for o in still]
    for rid in ids:
        verifier.release(rid)
    return [by_id[rid][0] for rid in ids]
