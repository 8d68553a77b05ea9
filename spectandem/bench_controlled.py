"""Controlled acceptance for `spectandem bench`: a benchmark-only proposer whose drafts the
target accepts at a chosen rate. Not in the production registry (drafter/engine.py).

Glossary:
- truth: a request's prompt followed by the target's own greedy continuation, computed
  beforehand by plain greedy decoding of the same target;
- acceptance rate a: the probability that the draft for a position is the truth; otherwise it
  is another token, drawn once per position (deterministic per seed), so a position is either
  always right or always wrong, whichever round drafts it;
- chain of M drafts: under greedy verification a round accepts the drafts up to the first wrong
  one, whose position then gets the target's token (the correction). Positions are independent,
  so the expected accept length (committed tokens per round) is 1 + a + ... + a^M. Accepted
  over drafted tokens is lower than a: the drafts after a wrong one are never reached.

`ControlledProposer` wraps a real EAGLE proposer: catch-up and proposal run the real head (the
drafting cost is real), then the proposed chain's tokens are replaced by the planned drafts.
Greedy verification keeps the output exactly the target's greedy output.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftPlan:
    """One request's planned drafts: drafts[p] is the draft for position p."""

    truth: tuple[int, ...]     # prompt + the target's greedy continuation
    drafts: tuple[int, ...]    # same length; equal to truth over the prompt


def plan_drafts(truth: list[int], prompt_len: int, acceptance_rate: float, vocab_size: int, seed: str) -> DraftPlan:
    """Each position past the prompt keeps the truth with probability `acceptance_rate`, else
    becomes another token of the vocabulary. `seed` (a string, e.g. "0:request-3") fixes it."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {acceptance_rate}")
    rng = random.Random(seed)  # str seeds hash with SHA-512: the same plan in every process
    drafts = list(truth)
    for p in range(prompt_len, len(truth)):
        if rng.random() >= acceptance_rate:
            drafts[p] = (truth[p] + 1 + rng.randrange(vocab_size - 1)) % vocab_size   # never truth[p]
    return DraftPlan(tuple(truth), tuple(drafts))


def expected_accept_length(acceptance_rate: float, num_drafts: int) -> float:
    """1 + a + ... + a^M for a chain of M drafts with per-position acceptance rate a."""
    return sum(acceptance_rate ** i for i in range(num_drafts + 1))


class ControlledProposer:
    """A chain proposer (topk 1) that drafts each request's `DraftPlan` after running `inner`.

    Requests must be greedy (deterministic drafts); `plans` is keyed by request id. Requests
    whose committed tokens left their truth (a target whose greedy choice differs between the
    plain pass and verification) are listed in `diverged`: their acceptance is no longer the
    planned one."""

    supports_ahead = False   # draft-ahead forks have no plan

    def __init__(self, inner, plans: dict[str, DraftPlan]):
        if inner.cfg.topk != 1:
            raise ValueError(f"controlled acceptance drafts chains (topk 1), got topk {inner.cfg.topk}")
        self.inner, self.plans = inner, plans
        self.cfg = inner.cfg
        self.feature_layers = inner.feature_layers
        self.diverged: set[str] = set()

    def catch_up(self, reqs, num_new, features):
        self.inner.catch_up(reqs, num_new, features)
        for r, n in zip(reqs, num_new):
            truth = self.plans[r.request_id].truth
            if tuple(r.token_ids[-n:]) != truth[r.committed_len - n: r.committed_len]:
                self.diverged.add(r.request_id)

    def propose(self, reqs, num_steps=None):
        if any(r.sample_drafts for r in reqs):
            raise ValueError("controlled acceptance needs deterministic drafts (greedy requests)")
        tree = self.inner.propose(reqs, num_steps)
        m = tree.token_ids.shape[1]
        rows = []
        for r in reqs:
            # Draft node j (depth j + 1) is the draft for position committed_len + j.
            drafts = self.plans[r.request_id].drafts
            n = r.committed_len
            assert n + m <= len(drafts), f"{r.request_id}: plan of {len(drafts)} positions, drafting to {n + m}"
            rows.append(drafts[n: n + m])
        planned = torch.tensor(rows, dtype=torch.long, device=tree.token_ids.device)       # [B, M]
        tree.token_ids = torch.where(tree.token_ids >= 0, planned, tree.token_ids)
        return tree

    def kv_stats(self) -> dict:
        return self.inner.kv_stats()

    def remove(self, request_id):
        self.inner.remove(request_id)
