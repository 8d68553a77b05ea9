"""Tree drafting over any draft network that can take one step on a set of live branches.

Parameters (SGLang's meaning): `num_steps` S = tree depth; `topk` k = children expanded per
live branch; `num_draft_tokens` N = verified nodes including the root.

Deterministic trees (`expand_topk`):
- step 0 reads the logits the catch-up pass left (no forward): the k best children of the root;
- steps 1..S-1 run the network once on the k live branches; each proposes its k best children,
  scored by the path's SUM of log-probabilities (a broadcast add); the k best of the k*k become
  the next live branches, but all k*k stay candidates;
- the N-1 best candidates overall form the tree. Sorting by score with a stable sort breaks
  ties towards lower candidate ids, and a parent always has a lower id and a score at least
  its child's, so the chosen set is closed under ancestors;
- with topk == 1 and `argmax` set, each step is an argmax of the logits: no softmax anywhere
  and a constant score.

Sampled chains (`sample_chains`, for rejection sampling with draft probabilities): the root gets
k children drawn i.i.d. from its draft distribution q, and each continues as a chain of single
samples. Every node with children then has exactly the i.i.d. sample set the multi-candidate
rejection rule needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol

import torch

from spectandem import rng
from spectandem.messages import ReadyTree
from spectandem.sampling import logits_to_probs, sample_from_probs

if TYPE_CHECKING:   # annotations only (drafter/proposers.py imports this module)
    from drafter.proposers import DraftRequest
    from spectandem.config import SpecConfig


class StepFn(Protocol):
    def __call__(self, step: int, token_ids: torch.Tensor, parent_rows: torch.Tensor,
                 visible: torch.Tensor) -> torch.Tensor:
        """One network step on k live branches per request.

        step: 1-based forward index (depth of the input tokens); token_ids [B, k] target ids;
        parent_rows [B, k]: which row of the previous step's output each branch continues
        (all 0 at step 1: the catch-up row); visible [B, k, step * k] bool: which scratch
        entries of steps 1..step each branch may attend to (its ancestors and itself).
        Returns draft logits [B, k, Vd].
        """


@dataclass
class DraftNodes:
    """What tree drafting makes inside the drafter: the draft nodes without the root, [B, M]
    each (M = number of draft nodes), with q over the draft vocabulary. The engine turns it into
    the round's `spectandem.messages.DraftTree` (root first, request ids and tags, target ids)."""

    token_ids: torch.Tensor   # [B, M] int64 target ids
    parents: torch.Tensor     # [B, M] int64 node index of the parent (0 = root)
    scores: torch.Tensor      # [B, M] float32 summed log-probs
    node_probs: torch.Tensor | None = None  # [B, M + 1, Vd] float64 q per node (root first)


def _extend_visible(visible: torch.Tensor, parent_rows: torch.Tensor, k: int) -> torch.Tensor:
    """visible [B, k, n] of the previous live set -> [B, k, n + k] for branches continuing
    `parent_rows [B, k]`: inherit the parent's row, then see your own new entry."""
    b = visible.shape[0]
    inherited = visible.gather(1, parent_rows[..., None].expand(-1, -1, visible.shape[-1]))
    own = torch.eye(k, dtype=torch.bool, device=visible.device).expand(b, k, k)
    return torch.cat([inherited, own], dim=-1)


def chain_tree(token_ids: torch.Tensor, num_draft_tokens: int) -> DraftNodes:
    """token_ids [B, S] of a chain -> its first min(S, num_draft_tokens - 1) nodes, as
    `expand_topk` selects them (all scores 0, node j + 1's parent is node j)."""
    b, s = token_ids.shape
    m = min(s, num_draft_tokens - 1)
    dev = token_ids.device
    return DraftNodes(token_ids=token_ids[:, :m], parents=torch.arange(m, device=dev).expand(b, m).clone(),
                     scores=torch.zeros(b, m, device=dev))


def expand_topk(first_logits: torch.Tensor, step: StepFn, to_target: Callable[[torch.Tensor], torch.Tensor],
                num_steps: int, topk: int, num_draft_tokens: int, argmax: bool) -> DraftNodes:
    """first_logits [B, Vd] from the catch-up pass -> the best num_draft_tokens - 1 nodes."""
    b = first_logits.shape[0]
    k = topk
    dev = first_logits.device
    use_argmax = argmax and k == 1
    if use_argmax:
        tok = first_logits.argmax(-1, keepdim=True)                         # [B, 1]
        score = torch.zeros(b, 1, device=dev)
    else:
        score, tok = torch.log_softmax(first_logits.float(), -1).topk(k, dim=-1)  # [B, k]
    cand_tok, cand_score = [tok], [score]
    cand_parent = [torch.full((b, k), -1, dtype=torch.long, device=dev)]
    live_ids = torch.arange(k, device=dev).expand(b, k)
    live_tok, live_score = tok, score
    parent_rows = torch.zeros(b, k, dtype=torch.long, device=dev)
    visible = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
    offset = k
    for i in range(1, num_steps):
        logits = step(i, to_target(live_tok), parent_rows, visible)        # [B, k, Vd]
        if use_argmax:   # a chain: each step's argmax is the next node, the child of the last
            live_tok = logits.argmax(-1)                                    # [B, 1]
            cand_tok.append(live_tok)
            if i + 1 < num_steps:
                visible = _extend_visible(visible, parent_rows, k)
            continue
        lp, child_tok = torch.log_softmax(logits.float(), -1).topk(k, dim=-1)  # [B, k, k]
        cum = live_score[..., None] + lp                                    # summed log-probs
        flat_tok, flat_score = child_tok.flatten(1), cum.flatten(1)         # [B, k*k]
        cand_tok.append(flat_tok)
        cand_score.append(flat_score)
        cand_parent.append(live_ids.repeat_interleave(k, dim=1))
        live_score, chosen = flat_score.topk(k, dim=-1)                     # [B, k]
        parent_rows = chosen // k
        live_ids = offset + chosen
        offset += k * k
        live_tok = flat_tok.gather(1, chosen)
        if i + 1 < num_steps:
            visible = _extend_visible(visible, parent_rows, k)
    if use_argmax:   # what _select picks of a chain: its nodes in order (every score 0)
        return chain_tree(to_target(torch.cat(cand_tok, 1)), num_draft_tokens)
    return _select(torch.cat(cand_tok, 1), torch.cat(cand_score, 1), torch.cat(cand_parent, 1),
                   num_draft_tokens - 1, to_target)


def _select(tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, budget: int,
            to_target) -> DraftNodes:
    """Global rerank of candidates [B, M] (parent = candidate id, -1 = root) to `budget` nodes.

    Example: scores [-.1, -.5, -.3(parent 0), -.9(parent 0)], budget 2 -> candidates {0, 2},
    node 1 = cand 0 (parent root 0), node 2 = cand 2 (parent node 1).
    """
    b, m = tok.shape
    n_sel = min(budget, m)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :n_sel]
    chosen = torch.sort(order, dim=1).values                                # parents first
    node_of = torch.full((b, m), -1, dtype=torch.long, device=tok.device)
    node_of.scatter_(1, chosen, torch.arange(1, n_sel + 1, device=tok.device).expand(b, n_sel))
    par_cand = parent.gather(1, chosen)
    parents = torch.where(par_cand < 0, torch.zeros_like(par_cand), node_of.gather(1, par_cand.clamp(min=0)))
    assert bool((parents >= 0).all()), "draft tree not closed under ancestors"
    return DraftNodes(token_ids=to_target(tok.gather(1, chosen)), parents=parents,
                     scores=score.gather(1, chosen))


def sample_chains(first_logits: torch.Tensor, step: StepFn, to_target, num_steps: int, topk: int,
                  num_draft_tokens: int, temperatures: list[float], top_ks: list[int], top_ps: list[float],
                  seeds: list[int], committed_lens: list[int]) -> DraftNodes:
    """k chains of sampled drafts from the root. Node of depth d in chain j has index
    1 + (d - 1) * k + j. Draws come from `rng` keyed by (seed, position, STREAM_DRAFT, j)."""
    b = first_logits.shape[0]
    k = topk
    depth = max(1, min(num_steps, (num_draft_tokens - 1) // k))
    dev = first_logits.device

    def probs_of(logits: torch.Tensor) -> torch.Tensor:                     # [B, r, Vd] -> float64
        return torch.stack([logits_to_probs(logits[i], temperatures[i], top_ks[i], top_ps[i]) for i in range(b)])

    def draw(probs: torch.Tensor, d: int) -> torch.Tensor:                  # probs [B, k, Vd] -> [B, k]
        out = torch.empty(b, k, dtype=torch.long, device=dev)
        for j in range(k):
            u = torch.tensor([rng.uniform(seeds[i], committed_lens[i] - 1 + d, rng.STREAM_DRAFT, j)
                              for i in range(b)], dtype=torch.float64)
            out[:, j] = sample_from_probs(probs[:, j], u)
        return out

    q_root = probs_of(first_logits[:, None])                                # [B, 1, Vd]
    node_probs = [q_root]
    tok = draw(q_root.expand(-1, k, -1), 1)
    toks, scores = [tok], [q_root[:, 0].gather(1, tok).log()]
    parent_rows = torch.zeros(b, k, dtype=torch.long, device=dev)
    visible = torch.eye(k, dtype=torch.bool, device=dev).expand(b, k, k)
    for d in range(2, depth + 1):
        q = probs_of(step(d - 1, to_target(tok), parent_rows, visible))    # [B, k, Vd]
        node_probs.append(q)
        tok = draw(q, d)
        toks.append(tok)
        scores.append(scores[-1] + q.gather(2, tok[..., None])[..., 0].log())
        parent_rows = torch.arange(k, device=dev).expand(b, k)
        visible = _extend_visible(visible, parent_rows, k)
    # With num_draft_tokens - 1 < k only the first num_draft_tokens - 1 root draws fit the budget.
    m = min(depth * k, num_draft_tokens - 1)
    node_idx = torch.arange(1, m + 1, device=dev)
    parents = torch.where(node_idx <= k, 0, node_idx - k).expand(b, m)
    vd = first_logits.shape[-1]
    probs = torch.zeros(b, m + 1, vd, dtype=torch.float64, device=dev)
    probs[:, 0] = q_root[:, 0]
    for d, q in enumerate(node_probs[1:], start=1):                         # rows of depth-d nodes
        probs[:, 1 + (d - 1) * k: 1 + d * k] = q
    return DraftNodes(token_ids=to_target(torch.cat(toks, 1)[:, :m]), parents=parents.clone(),
                     scores=torch.cat(scores, 1)[:, :m].float(), node_probs=probs)


def host_lists(token_ids: torch.Tensor, parents: torch.Tensor, scores: torch.Tensor) -> tuple[list, list, list]:
    """A drafted tree's token_ids, parents, scores (DraftNodes's, on the host) as nested lists,
    each converted once: `ready_rows` then picks rows without a tensor op per row."""
    return token_ids.tolist(), parents.tolist(), scores.float().tolist()


def ready_rows(root: int, lists: tuple[list, list, list], row: int) -> ReadyTree:
    """Request `row` of a drafted tree (`host_lists`) as the verifier's rows under `root`, the
    request's last committed token."""
    return ReadyTree((root, *lists[0][row]), (-1, *lists[1][row]), (0.0, *lists[2][row]))


def draft_tree(reqs: list[DraftRequest], first: torch.Tensor, step, to_target, cfg: SpecConfig,
           vocab_size: int, num_steps: int | None = None) -> DraftNodes:
    """Deterministic top-k trees (argmax chains when topk == 1), or sampled chains whose
    draft probabilities are returned over the target vocabulary [B, M + 1, vocab_size]."""
    sampled = {r.sample_drafts for r in reqs}
    assert len(sampled) == 1, "the drafter engine drafts sampled and deterministic requests in separate calls"
    steps = min(num_steps or cfg.num_steps, cfg.num_steps)
    if not sampled.pop():
        return expand_topk(first, step, to_target, steps, cfg.topk, cfg.num_draft_tokens, argmax=True)
    tree = sample_chains(first, step, to_target, steps, cfg.topk, cfg.num_draft_tokens,
                         [r.params.temperature for r in reqs], [r.params.top_k for r in reqs],
                         [r.params.top_p for r in reqs], [r.seed for r in reqs],
                         [r.committed_len for r in reqs])
    probs = tree.node_probs                                                   # [B, M + 1, Vd]
    if probs.shape[-1] != vocab_size or not torch.equal(to_target(torch.arange(probs.shape[-1])),
                                                        torch.arange(probs.shape[-1])):
        full = probs.new_zeros(*probs.shape[:2], vocab_size)
        full[..., to_target(torch.arange(probs.shape[-1], device=probs.device))] = probs
        tree.node_probs = full
    return tree
