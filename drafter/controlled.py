"""Controlled acceptance: a benchmark-only proposer whose drafts the target accepts at a chosen
rate. Not in the production registry (drafter/engine.py): `spectandem bench` builds it with plans
from truths it computes beforehand, and `spectandem serve --benchmark-acceptance-rate A` (through
drafter/factory.py) with plans from truths it learns from the requests it has seen (`TruthBook`).

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

Served (`truths` given): a greedy request that ends (finished, cancelled or preempted) leaves its
prompt and committed tokens in the `TruthBook`: the router sends them with its release
(`learn_output`), whether this drafter held the request or not, and the engine's
`request_ended` records what the drafter itself caught up on; a later greedy request
whose tokens are a prefix of a recorded truth drafts that truth's plan, drawn at rate a from
digests of the truth's tokens (`prefix_plan`: every process draws the same plan). Positions
past the truth, requests with no truth, sampled requests and requests whose committed tokens
leave their truth keep the inner proposer's drafts, row by row and position by position: one
batch mixes them.

Draft ahead (drafter/ahead.py: while a round is verified, the drafter drafts the next round for
its likeliest outcomes) needs the drafter's ranking of the tokens at a position, not only its
first choice. The controlled drafter's ranking at position p: first its draft, drafts[p], then
its second guess, seconds[p], which is drawn like the first: where the first guess is wrong, the
second is the truth with probability a, and another token otherwise (never the first guess). An
outcome cache that holds one tree per accept length (the correction at a wrong draft being the
second guess, the bonus after a fully accepted chain the next position's first guess) then hits
with probability a^(M+1) + (1 - a^M) * a. The forks of draft ahead run the real head (absorbing
their paths, the log-probabilities, the trees), so the cost of drafting ahead is real too.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections import OrderedDict
from dataclasses import dataclass

import torch

from drafter.ahead_chains import rank_chain_outcomes
from drafter.ahead import ahead_owner
from drafter.tree import chain_tree
from drafter.proposers import Proposer


@dataclass(frozen=True)
class DraftPlan:
    """One request's planned drafts: drafts[p] is the draft for position p."""

    truth: tuple[int, ...]     # prompt + the target's greedy continuation
    drafts: tuple[int, ...]    # same length; equal to truth over the prompt
    seconds: tuple[int, ...] = ()   # the second guess per position (draft ahead), never drafts[p]
    rate: float = 1.0               # the acceptance rate a the plan was drawn at


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
    # Second guesses from a stream of their own: the drafts of a seed stay those of earlier runs.
    rng2 = random.Random(seed + ":second")
    seconds = list(drafts)
    for p in range(prompt_len, len(truth)):
        right = drafts[p] != truth[p] and rng2.random() < acceptance_rate
        seconds[p] = truth[p] if right else _other(rng2, vocab_size, {truth[p], drafts[p]})
    return DraftPlan(tuple(truth), tuple(drafts), tuple(seconds), acceptance_rate)


def _other(rng: random.Random, vocab_size: int, avoid: set[int]) -> int:
    """A token of the vocabulary outside `avoid` (at most 2 tokens; the vocabulary has more)."""
    while True:
        t = rng.randrange(vocab_size)
        if t not in avoid:
            return t


def expected_accept_length(acceptance_rate: float, num_drafts: int) -> float:
    """1 + a + ... + a^M for a chain of M drafts with per-position acceptance rate a."""
    return sum(acceptance_rate ** i for i in range(num_drafts + 1))


def expected_ahead_hit_rate(acceptance_rate: float, num_drafts: int) -> float:
    """The chance that a round's outcome is in an outcome cache holding every accept length's
    best guess (module docstring): the whole chain and the next first guess right, or a wrong
    draft whose second guess is right."""
    a = acceptance_rate
    return a ** (num_drafts + 1) + (1 - a ** num_drafts) * a


def prefix_plan(truth: list[int], acceptance_rate: float, vocab_size: int) -> DraftPlan:
    """A served truth's plan, drawn as `plan_drafts` draws (first guess right with probability a,
    second guess right with probability a where the first is wrong), each position's draws from
    a digest of the truth's tokens up to it: every process, and every truth that extends the
    same tokens, gets the same drafts there."""
    if not 0.0 <= acceptance_rate <= 1.0:
        raise ValueError(f"acceptance rate must be in [0, 1], got {acceptance_rate}")
    digest = hashlib.blake2b(b"spectandem controlled acceptance", digest_size=32).digest()
    drafts, seconds = [], []
    for tok in truth:
        digest = hashlib.blake2b(digest + int(tok).to_bytes(8, "little"), digest_size=32).digest()
        u = [int.from_bytes(digest[k: k + 8], "little") for k in (0, 8, 16, 24)]
        first = tok if u[0] / 2 ** 64 < acceptance_rate else (tok + 1 + u[1] % (vocab_size - 1)) % vocab_size
        right = first != tok and u[2] / 2 ** 64 < acceptance_rate
        drafts.append(first)
        seconds.append(tok if right else _nth_other(u[3], vocab_size, {tok, first}))
    return DraftPlan(tuple(truth), tuple(drafts), tuple(seconds), acceptance_rate)


def _nth_other(n: int, vocab_size: int, avoid: set[int]) -> int:
    """The (n mod its count)-th token of the vocabulary outside `avoid`."""
    t = n % (vocab_size - len(avoid))
    for a in sorted(avoid):
        if t >= a:
            t += 1
    return t


class TruthBook:
    """Truths learned while serving: the committed tokens (prompt + output) of greedy requests
    that ended. A request whose tokens are a proper prefix of a recorded truth gets that truth's
    plan at `rate` (`prefix_plan`), drawn once per truth, when it is recorded. Truths are looked
    up by their first tokens (each truth is indexed under its prefixes of 1 to `key_len` tokens, a request by its
    first `key_len` tokens or all of them), then checked. A truth that a recorded one extends is not kept; at
    most `capacity` truths are, the least recently used going first."""

    def __init__(self, rate: float, vocab_size: int, capacity: int = 4096, key_len: int = 8):
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {rate}")
        if capacity < 1 or key_len < 1:
            raise ValueError(f"capacity and key_len must be >= 1, got {capacity}, {key_len}")
        self.rate, self.vocab_size, self.capacity, self.key_len = rate, vocab_size, capacity, key_len
        self._truths: OrderedDict[tuple[int, ...], DraftPlan] = OrderedDict()   # truth -> its plan
        self._by_key: dict[tuple[int, ...], dict[tuple[int, ...], None]] = {}   # prefix -> truths (an ordered set)

    def __len__(self) -> int:
        return len(self._truths)

    def _keys(self, truth: tuple[int, ...]):
        return (truth[:k] for k in range(1, min(len(truth), self.key_len) + 1))

    def record(self, token_ids) -> None:
        """Keeps `token_ids` as a truth, unless a recorded truth already extends it; drops the
        recorded truths it extends."""
        truth = tuple(token_ids)
        if not truth:
            return
        bucket = self._by_key.get(truth[: self.key_len], {})
        for t in bucket:
            if t[: len(truth)] == truth:
                self._truths.move_to_end(t)
                return
        shorter = [truth[:k] for k in range(1, min(len(truth), self.key_len)) if truth[:k] in self._truths]
        for t in shorter + [t for t in bucket if truth[: len(t)] == t]:   # the truths it extends
            self._drop(t)
        # Its plan is drawn now, when the request that taught it ends, not by the first request
        # that drafts from it: drawing hashes every token, and a served benchmark's measured pass
        # would pay for it in its rounds.
        self._truths[truth] = prefix_plan(list(truth), self.rate, self.vocab_size)
        for key in self._keys(truth):
            self._by_key.setdefault(key, {})[truth] = None
        while len(self._truths) > self.capacity:
            self._drop(next(iter(self._truths)))

    def _drop(self, truth: tuple[int, ...]) -> None:
        del self._truths[truth]
        for key in self._keys(truth):
            bucket = self._by_key[key]
            del bucket[truth]
            if not bucket:
                del self._by_key[key]

    def plan(self, token_ids) -> DraftPlan | None:
        """The plan of a recorded truth that `token_ids` is a proper prefix of; None without one."""
        tokens = tuple(token_ids)
        for t in self._by_key.get(tokens[: self.key_len], ()):
            if len(t) > len(tokens) and t[: len(tokens)] == tokens:
                plan = self._truths[t]
                self._truths.move_to_end(t)
                return plan
        return None


class ControlledProposer(Proposer):
    """A chain proposer (topk 1) that drafts each request's `DraftPlan` after running `inner`.

    Without `truths` (the bench): requests must be greedy (deterministic drafts) and `plans`,
    keyed by request id, holds every request's plan. With `truths` (serving): a greedy request's
    plan comes from the book when it is first seen, and ended greedy requests are recorded in it;
    what has no plan keeps the inner proposer's drafts (module docstring). Requests whose
    committed tokens left their truth (a target whose greedy choice differs between the plain
    pass and verification) are listed in `diverged`: their acceptance is no longer the planned
    one (served, they draft the inner proposer's drafts from then on)."""

    # Its one-pass calls run the inner proposer's where it has them, else the catch-up first.
    has_catch_up_propose = has_catch_up_ahead_chains = True

    def __init__(self, inner, plans: dict[str, DraftPlan] | None = None, ahead: bool = True,
                 truths: TruthBook | None = None):
        """`ahead`: draft ahead (when `inner` can) with the plan's guesses (module docstring)."""
        if inner.cfg.topk != 1:
            raise ValueError(f"controlled acceptance drafts chains (topk 1), got topk {inner.cfg.topk}")
        self.inner, self.plans, self.truths = inner, ({} if plans is None else plans), truths
        self.cfg = inner.cfg
        self.feature_layers = inner.feature_layers
        self.diverged: set[str] = set()
        self.supports_ahead = ahead and inner.supports_ahead
        self._fork_len: dict[str, int] = {}   # draft-ahead fork -> its committed length

    @property
    def device(self):
        """The inner proposer's device: the drafter's link computes on a CUDA stream of its own
        there (router/links_local.py: engine_device), as it does for the inner proposer alone."""
        return self.inner.device

    def _plan(self, request_id: str) -> DraftPlan | None:
        """A request's plan; a draft-ahead fork has its request's (drafter/ahead.py). Served:
        None where the request has none."""
        owner = ahead_owner(request_id)
        return self.plans[owner] if self.truths is None else self.plans.get(owner)

    def _plan_of(self, r) -> DraftPlan | None:
        """`_plan` for a DraftRequest; served, a greedy request seen for the first time looks up
        its truth (its committed tokens a prefix of a recorded one)."""
        if self.truths is not None and r.request_id not in self.plans and ahead_owner(r.request_id) == r.request_id:
            self.plans[r.request_id] = self.truths.plan(r.token_ids) if r.params.greedy else None
        return self._plan(r.request_id)

    def request_ended(self, req) -> None:
        """Served: a greedy request that ends (finished, cancelled, preempted) leaves its committed
        tokens as a truth (drafter/engine.py calls this before `remove`)."""
        if self.truths is not None and req.params.greedy:
            self.truths.record(req.token_ids)

    def learn_output(self, token_ids) -> None:
        """Served: a greedy request's whole output, sent with its release (it may never have
        been on this drafter: admitted without it, or its last rounds never caught up)."""
        if self.truths is not None:
            self.truths.record(token_ids)

    def catch_up(self, reqs, num_new, features):
        self.inner.catch_up(reqs, num_new, features)
        self._check_truth(reqs, num_new)

    def _check_truth(self, reqs, num_new):
        for r, n in zip(reqs, num_new):
            plan = self._plan_of(r)
            if plan is None:
                continue
            truth = plan.truth
            if tuple(r.token_ids[-n:]) != truth[r.committed_len - n: r.committed_len]:
                self.diverged.add(r.request_id)
                if self.truths is not None:
                    self.plans[r.request_id] = None

    def stage_features(self, features):
        return self.inner.stage_features(features)

    def _check_greedy(self, reqs):
        if self.truths is None and any(r.sample_drafts for r in reqs):
            raise ValueError("controlled acceptance needs deterministic drafts (greedy requests)")

    def propose(self, reqs, num_steps=None):
        self._check_greedy(reqs)
        return self._planned(reqs, self.inner.propose(reqs, num_steps))

    def fuses_catch_up(self, num_new):
        return self.inner.fuses_catch_up(num_new)

    def catch_up_group(self, num_new):
        return self.inner.catch_up_group(num_new)

    def catch_up_propose(self, reqs, num_new, features, num_steps=None):
        """`catch_up` then `propose`, in the inner proposer's one pass when it has one
        (`EagleProposer.catch_up_propose`): the plan's drafts, the real cost."""
        self._check_greedy(reqs)
        one_pass = self.inner.catch_up_propose if self.inner.has_catch_up_propose else None
        tree = self._caught_up(one_pass, reqs, num_new, features, num_steps)
        return self.propose(reqs, num_steps) if tree is None else self._planned(reqs, tree)

    def _caught_up(self, one_pass, reqs, num_new, features, *args):
        """The inner proposer's one-pass call (a catch-up, then a pass), checking the committed
        tokens against the truth; None (only the catch-up run) when it has none (`one_pass` None)."""
        if one_pass is None:
            self.catch_up(reqs, num_new, features)
            return None
        try:
            return one_pass(reqs, num_new, features, *args)
        finally:   # the catch-up has run unless the inner proposer failed before it
            self._check_truth(reqs, num_new)

    def _planned(self, reqs, tree):
        """The inner proposer's chains with the plan's drafts in their place (served: where a
        request has a plan, up to its truth's end; sampled requests keep theirs)."""
        m = tree.token_ids.shape[1]
        rows, spans = [], []
        for r in reqs:
            # Draft node j (depth j + 1) is the draft for position committed_len + j.
            plan = None if r.sample_drafts else self._plan_of(r)
            n = r.committed_len
            if self.truths is None:
                assert n + m <= len(plan.drafts), \
                    f"{r.request_id}: plan of {len(plan.drafts)} positions, drafting to {n + m}"
            row = list(plan.drafts[n: n + m]) if plan is not None else []
            spans.append(len(row))
            rows.append(row + [0] * (m - len(row)))
        if not any(spans):
            return tree
        dev = tree.token_ids.device
        cuda = dev.type == "cuda"
        # From pinned memory on a GPU: from pageable memory the copy would wait for the drafting.
        planned = torch.empty(len(rows), m, dtype=torch.long, pin_memory=cuda)   # [B, M]
        planned.numpy()[:] = rows
        use = tree.token_ids >= 0
        if min(spans) < m:   # rows (or their ends) without a plan keep the inner drafts
            within = torch.empty(len(rows), m, dtype=torch.bool, pin_memory=cuda)
            within.numpy()[:] = [[j < k for j in range(m)] for k in spans]
            use = use & (within.to(dev, non_blocking=True) if cuda else within)
        if cuda:
            planned = planned.to(dev, non_blocking=True)
        tree.token_ids = torch.where(use, planned, tree.token_ids)
        return tree

    # Draft ahead: the forks are the inner proposer's; only the ranking is the plan's.
    def ahead_fork(self, src_id, dst_id):
        self.inner.ahead_fork(src_id, dst_id)

    def ahead_absorb(self, reqs, num_new):
        self.inner.ahead_absorb(reqs, num_new)
        for r in reqs:
            self._fork_len[r.request_id] = r.committed_len

    def supports_ahead_chains(self, batch: int) -> bool:
        return self.supports_ahead and self.inner.supports_ahead_chains(batch)

    def ahead_chains(self, reqs, chains, width):
        """Chains drafted ahead in one pass (drafter/ahead_chains.py): the inner proposer's pass
        runs (its cost is drafting ahead's) and its outcomes are dropped where there is a plan;
        the plan ranks the outcomes (`_ranking`, as `ahead_logprobs` does for the forks) and
        gives their trees."""
        real = self.inner.ahead_chains(reqs, chains, width)
        return self._planned_outcomes(reqs, chains, width, real)

    def catch_up_ahead_chains(self, reqs, num_new, features, chains, width):
        """`catch_up` then `ahead_chains`, in the inner proposer's one pass when it has one
        (`EagleProposer.catch_up_ahead_chains`): the plan's outcomes, the real cost."""
        one_pass = self.inner.catch_up_ahead_chains if self.inner.has_catch_up_ahead_chains else None
        real = self._caught_up(one_pass, reqs, num_new, features, chains, width)
        if real is None:
            return self.ahead_chains(reqs, chains, width)
        return self._planned_outcomes(reqs, chains, width, real)

    def _planned_outcomes(self, reqs, chains, width, real):
        """Per request, the plan's outcome cache; served, the inner proposer's (`real`) where the
        request has no plan or the outcomes' trees would draft past its truth."""
        steps = self.cfg.max_draft_nodes   # a chain's length
        out = []
        for r, chain, inner in zip(reqs, chains, real):
            plan, n = self._plan_of(r), r.committed_len
            if self.truths is not None and (plan is None or n + len(chain) + 1 + steps > len(plan.drafts)):
                out.append(inner)
                continue
            chosen = rank_chain_outcomes(chain, [self._ranking(plan, n + k) for k in range(len(chain) + 1)], width)
            rows = [plan.drafts[n + k + 1: n + k + 1 + steps] for k, _ in chosen]
            assert all(len(row) == steps for row in rows), f"{r.request_id}: plan of {len(plan.drafts)} positions"
            tree = chain_tree(torch.tensor(rows, dtype=torch.long), self.cfg.num_draft_tokens) if rows else None
            out.append({tuple(chain[:k]) + (b,): (tree, i) for i, (k, b) in enumerate(chosen)})
        return out

    @staticmethod
    def _ranking(plan: DraftPlan, p: int) -> dict[int, float]:
        """The controlled drafter's log-probabilities for position p: the first guess a, the
        second (1 - a) a, every other token 0 (left out)."""
        if p >= len(plan.drafts):
            return {}
        log = lambda x: math.log(x) if x > 0 else float("-inf")
        return {plan.seconds[p]: log((1 - plan.rate) * plan.rate), plan.drafts[p]: log(plan.rate)}

    def ahead_logprobs(self, request_ids):
        """[len(request_ids), V]: each fork's log-probabilities for the position it predicts (its
        committed length), from the plan: the first guess a, the second (1 - a) a (the chance that
        it is the target's token), every other token 0. An outcome's score (drafter/ahead.py) is
        then the log of its probability. The real head's log-probabilities are computed (their
        cost is drafting ahead's) and kept only for served forks without a plan there."""
        real = self.inner.ahead_logprobs(request_ids).float().cpu()   # the real path's copy too
        out = torch.full_like(real, float("-inf"))
        for i, fid in enumerate(request_ids):
            plan, p = self._plan(fid), self._fork_len[fid]
            if self.truths is not None and (plan is None or p >= len(plan.drafts)):
                out[i] = real[i]
                continue
            for tok, lp in self._ranking(plan, p).items():
                out[i, tok] = lp
        return out

    def warm_up(self, max_batch, progress=None):
        return self.inner.warm_up(max_batch, progress)

    def kv_stats(self) -> dict:
        return self.inner.kv_stats()

    def remove(self, request_id):
        self._fork_len.pop(request_id, None)
        if self.truths is not None:
            self.plans.pop(request_id, None)
            self.diverged.discard(request_id)
        self.inner.remove(request_id)
