"""What flows between drafter and verifier, as plain dataclasses (protobuf only at the edges).

Every message carries, per request, the request id and the committed length it belongs to;
an engine rejects a message whose committed length is not its own (a draft of another round).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


class StaleMessage(ValueError):
    """A message tagged with a committed length (round) other than the receiver's."""


@dataclass
class DraftTree:
    """One round's draft trees for B requests, N nodes each.

    Node 0 is the root: the request's last committed token, at position committed_len - 1.
    A node of depth d holds the draft for position committed_len - 1 + d. Parents precede
    their children. Example (topk 2, 4 nodes): token_ids [r, a, b, c], parents [-1, 0, 0, 1]
    is r -> {a, b}, a -> c.
    """

    request_ids: list[str]
    committed_lens: list[int]        # the tag: each request's committed length when drafted
    token_ids: torch.Tensor          # [B, N] int64 target token ids (-1 on padding)
    parents: torch.Tensor            # [B, N] int64, -1 for the root and padding
    node_valid: torch.Tensor         # [B, N] bool
    scores: torch.Tensor             # [B, N] float32 summed draft log-probs (root 0)
    # [B, N, V] float64: row i is the distribution q the children of node i were sampled from;
    # None when no request's drafts were sampled.
    draft_probs: torch.Tensor | None = None
    sampled: list[bool] = field(default_factory=list)  # per request: children drawn from q

    def __post_init__(self):
        b, n = self.token_ids.shape
        assert len(self.request_ids) == len(self.committed_lens) == b
        assert self.parents.shape == self.node_valid.shape == self.scores.shape == (b, n)
        if not self.sampled:
            self.sampled = [False] * b
        assert len(self.sampled) == b
        assert self.draft_probs is None or self.draft_probs.shape[:2] == (b, n)

    @property
    def num_nodes(self) -> int:
        return self.token_ids.shape[1]

    def select(self, request_ids: list[str]) -> "DraftTree":
        """The rows of these requests, in this order."""
        rows = [self.request_ids.index(r) for r in request_ids]
        idx = torch.tensor(rows, dtype=torch.long)
        return DraftTree(request_ids=list(request_ids), committed_lens=[self.committed_lens[i] for i in rows],
                         token_ids=self.token_ids[idx], parents=self.parents[idx], node_valid=self.node_valid[idx],
                         scores=self.scores[idx],
                         draft_probs=None if self.draft_probs is None else self.draft_probs[idx],
                         sampled=[self.sampled[i] for i in rows])

    def num_draft_tokens(self) -> list[int]:
        """Valid draft nodes of each request (root excluded)."""
        return self.node_valid[:, 1:].sum(1).tolist()


@dataclass
class PrefillOutput:
    request_id: str
    first_token_id: int              # sampled from the logits after the prompt
    features: torch.Tensor | None    # [prompt_len, F]


@dataclass(frozen=True)
class ReadyTree:
    """One request's next tree, drafted ahead for one outcome of the round in flight (drafter/
    ahead.py), as host lists: node 0 is the outcome's bonus token (the root), then the drafts.
    The router holds these so that, on a hit, it sends the next verify without asking the
    drafter (router/loop.py); `trees_from_ready` makes them the rows `DrafterEngine.draft`
    would have made."""

    token_ids: tuple[int, ...]       # root first; -1 on padding
    parents: tuple[int, ...]         # -1 for the root and padding
    scores: tuple[float, ...]        # summed draft log-probs (float32 values), root 0


def trees_from_ready(request_ids: list[str], committed_lens: list[int], ready: list[ReadyTree]) -> DraftTree:
    """The round's DraftTree from each request's ready tree (deterministic drafts: no q), padded
    to the widest; a node is valid where its token is not -1."""
    b, n = len(ready), max(len(t.token_ids) for t in ready)
    # In numpy: this runs on the host between a verdict and the next launch (twice a round).
    token_ids = np.full((b, n), -1, dtype=np.int64)
    parents = np.full((b, n), -1, dtype=np.int64)
    scores = np.full((b, n), float("-inf"), dtype=np.float32)
    for i, t in enumerate(ready):
        m = len(t.token_ids)
        token_ids[i, :m], parents[i, :m], scores[i, :m] = t.token_ids, t.parents, t.scores
    return DraftTree(request_ids=list(request_ids), committed_lens=list(committed_lens),
                     token_ids=torch.from_numpy(token_ids), parents=torch.from_numpy(parents),
                     node_valid=torch.from_numpy(token_ids >= 0), scores=torch.from_numpy(scores))


def root_only_tree(request_ids: list[str], committed_lens: list[int], last_tokens: list[int]) -> DraftTree:
    """A round without drafts (plain decoding): each tree is just its root."""
    b = len(request_ids)
    return DraftTree(request_ids=list(request_ids), committed_lens=list(committed_lens),
                     token_ids=torch.tensor(last_tokens, dtype=torch.long).reshape(b, 1),
                     parents=torch.full((b, 1), -1, dtype=torch.long), node_valid=torch.ones(b, 1, dtype=torch.bool),
                     scores=torch.zeros(b, 1))


def concat_trees(a: DraftTree, b: DraftTree) -> DraftTree:
    """Rows of `a` then rows of `b`, padded to the wider node count."""
    n = max(a.num_nodes, b.num_nodes)

    def pad(t: DraftTree, x: torch.Tensor, fill) -> torch.Tensor:
        if x.shape[1] == n:
            return x
        extra = x.new_full((x.shape[0], n - x.shape[1], *x.shape[2:]), fill)
        return torch.cat([x, extra], dim=1)

    probs = None
    if a.draft_probs is not None or b.draft_probs is not None:
        vocab = (a.draft_probs if a.draft_probs is not None else b.draft_probs).shape[-1]
        parts = []
        for t in (a, b):
            p = t.draft_probs if t.draft_probs is not None else torch.zeros(len(t.request_ids), t.num_nodes, vocab,
                                                                              dtype=torch.float64)
            parts.append(pad(t, p, 0.0))
        probs = torch.cat(parts)
    return DraftTree(
        request_ids=a.request_ids + b.request_ids, committed_lens=a.committed_lens + b.committed_lens,
        token_ids=torch.cat([pad(a, a.token_ids, -1), pad(b, b.token_ids, -1)]),
        parents=torch.cat([pad(a, a.parents, -1), pad(b, b.parents, -1)]),
        node_valid=torch.cat([pad(a, a.node_valid, False), pad(b, b.node_valid, False)]),
        scores=torch.cat([pad(a, a.scores, float("-inf")), pad(b, b.scores, float("-inf"))]),
        draft_probs=probs, sampled=a.sampled + b.sampled)
