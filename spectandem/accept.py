"""Tree verification: which draft tokens the target accepts, and the one token it adds.

Glossary (the same words are used throughout spectandem):

    tree            Per request, N nodes. Node 0 is the root: the request's last committed token,
                    at position committed_len - 1. Nodes 1..N-1 are draft tokens.
                    `tree_token_ids [B, N]`, `parents [B, N]` (parents[:, 0] == -1 and
                    0 <= parents[b, i] < i), `node_valid [B, N]` (False = padding, never accepted).
    depth           Distance from the root. The token chosen *at* a node of depth d (the token
                    that follows it) is the token at position committed_len + d.
    children        The valid nodes whose parent is a given node, taken in ascending node index
                    ("sibling order").
    target_probs    [B, N, V] float: row i is the target's sampling distribution (temperature,
                    top-k, top-p already applied by spectandem.sampling.logits_to_probs) for the
                    token that follows node i. Written p in the formulas below.
    draft_probs     [B, N, V] float: row i is the distribution q the drafter drew node i's
                    children from, i.i.d., produced by the same logits_to_probs call with the same
                    sampling parameters. Rows of leaves are unused.
    accepted token  A draft token the target keeps. Accepted nodes form a path from the root.
    recovered token The target's token when every child of the last accepted node is rejected
                    (also called the correction token): the target argmax (greedy), the target's
                    own draw (target-only tree sampling), or a draw from the residual
                    norm(max(p - q, 0)) (rejection sampling).
    bonus token     The target's token at the end of a fully accepted path (a leaf): the argmax of,
                    or a draw from, p at that leaf.
    output          The accepted draft tokens followed by exactly one recovered-or-bonus token, so
                    every round emits num_accepted + 1 tokens (num_accepted >= 0).

The three verifiers:

    verify_greedy          Temperature 0: accept a child iff its token is the target argmax.
    verify_tree_sampling   Deterministic drafts (e.g. top-k trees): the target draws its own token
                           x ~ p with the round's uniform and the child with token x, if any, is
                           accepted. Exact by construction, needs no q, and gives the same tokens
                           as seeded plain decoding with the same uniforms (SGLang's target-only
                           tree sampling does the same with a running CDF over the children).
    verify_rejection       Sampled drafts: speculative (rejection) sampling, Leviathan et al. 2023,
                           "Fast Inference from Transformers via Speculative Decoding", and Chen et
                           al. 2023, "Accelerating Large Language Model Decoding with Speculative
                           Sampling"; for several i.i.d. candidates per node, the multi-step
                           speculative sampling of SpecInfer (Miao et al. 2024, ASPLOS).

Uniforms are float64 in (0, 1) from spectandem.rng, one column per depth. Column d belongs to the
token at position committed_len + d, so a round that stops at depth d leaves the uniforms of later
positions untouched for the next round, and no result depends on the rest of the batch:

    uniforms[b, d]           = rng.uniform(seed_b, committed_len_b + d, rng.STREAM_TARGET)
    sample_uniforms[b, d]    = rng.uniform(seed_b, committed_len_b + d, rng.STREAM_TARGET)
    accept_uniforms[b, d, j] = rng.uniform(seed_b, committed_len_b + d, rng.STREAM_ACCEPT, j)
"""

from collections.abc import Callable
from dataclasses import dataclass

import torch

from spectandem.checks import describe, is_integer
from spectandem.sampling import greedy, sample_from_probs

# Probability rows may come from float32 softmax over a large vocabulary; this only catches rows
# that are not distributions at all (logits, masks, unnormalised weights).
_ROW_SUM_TOLERANCE = 1e-4


@dataclass(frozen=True)
class VerifyResult:
    """One round's outcome for B requests; D is the largest node depth in the batch."""

    accepted_nodes: torch.Tensor  # [B, D+1] int64: root (0), then each accepted draft node; -1 pad
    num_accepted: torch.Tensor  # [B] int64: accepted draft nodes, root excluded
    # [B, D+1] int64: the accepted draft tokens, then the recovered-or-bonus token; -1 pad
    output_token_ids: torch.Tensor
    bonus_token_ids: torch.Tensor  # [B] int64: the recovered-or-bonus token (the last real output token)

    def tokens(self, b: int) -> list[int]:
        """Request b's output tokens: num_accepted[b] accepted draft tokens, then one target token."""
        return self.output_token_ids[b, : int(self.num_accepted[b]) + 1].tolist()

    def token_lists(self) -> list[list[int]]:
        """`tokens(b)` of every request, from one host conversion of each tensor."""
        return [row[: k + 1] for row, k in zip(self.output_token_ids.tolist(), self.num_accepted.tolist())]


@dataclass(frozen=True)
class _Tree:
    token_ids: torch.Tensor  # [B, N] int64
    children: torch.Tensor  # [B, N, max(K, 1)] int64: child node ids in sibling order, -1 padded
    has_children: torch.Tensor  # [B, N] bool
    max_depth: int  # D
    max_children: int  # K, over all nodes of the batch


def verify_greedy(
    tree_token_ids: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    node_valid: torch.Tensor,  # [B, N] bool
    target_logits: torch.Tensor,  # [B, N, V] float
) -> VerifyResult:
    """Longest path of children whose token is the target argmax at their parent; bonus = argmax there."""
    tree = _build_tree(tree_token_ids, parents, node_valid)
    _check_scores("target_logits", target_logits, tree)
    _check_draft_tokens(tree, node_valid, target_logits.shape[2])

    def step(rows: torch.Tensor, nodes: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        target_token = greedy(target_logits[rows, nodes])  # [R]
        return _child_with_token(tree, rows, nodes, target_token), target_token

    return _walk(tree, step)


def verify_tree_sampling(
    tree_token_ids: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    node_valid: torch.Tensor,  # [B, N] bool
    target_probs: torch.Tensor,  # [B, N, V] float
    uniforms: torch.Tensor,  # [B, >= D+1] float64
) -> VerifyResult:
    """Target-only tree sampling for deterministic drafts.

    At the current node of depth d, x = sample_from_probs(target_probs[b, node], uniforms[b, d]).
    If a child has token x (the first in sibling order, should several), it is accepted and the
    walk continues from it; otherwise x is the recovered (or, at a leaf, bonus) token. Every
    emitted token is a draw from p with the uniform of its position, exactly as plain decoding.
    """
    tree = _build_tree(tree_token_ids, parents, node_valid)
    vocab_size = _check_probs("target_probs", target_probs, tree, node_valid)
    _check_draft_tokens(tree, node_valid, vocab_size)
    _check_uniforms("uniforms", uniforms, (tree.token_ids.shape[0], tree.max_depth + 1))

    def step(rows: torch.Tensor, nodes: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        target_token = sample_from_probs(target_probs[rows, nodes], uniforms[rows, depth])  # [R]
        return _child_with_token(tree, rows, nodes, target_token), target_token

    return _walk(tree, step)


def verify_rejection(
    tree_token_ids: torch.Tensor,  # [B, N] int64
    parents: torch.Tensor,  # [B, N] int64
    node_valid: torch.Tensor,  # [B, N] bool
    target_probs: torch.Tensor,  # [B, N, V] float
    draft_probs: torch.Tensor,  # [B, N, V] float
    accept_uniforms: torch.Tensor,  # [B, >= D+1, >= K] float64
    sample_uniforms: torch.Tensor,  # [B, >= D+1] float64
) -> VerifyResult:
    """Recursive rejection sampling over a tree of sampled drafts.

    At the current node of depth d, with p = target_probs[node] and q = draft_probs[node], the
    children are tried in sibling order. Child j with token x and coin u = accept_uniforms[b, d, j]
    is accepted iff q(x) > 0 and u * q(x) <= p(x), i.e. with probability min(1, p(x)/q(x)). On
    rejection the target becomes the residual p <- norm(max(p - q, 0)) and the next child is tried
    against it (SpecInfer); the renormalisation matters because the next coin is compared with
    p(x)/q(x). If every child is rejected, the recovered token is drawn from the residual with
    sample_uniforms[b, d]; at a leaf the bonus token is drawn from p with the same column.

    The residual has zero mass only when p == q, where a rejection has probability zero; rounding
    can still get there, and then the original target row stands in for the residual.
    """
    tree = _build_tree(tree_token_ids, parents, node_valid)
    vocab_size = _check_probs("target_probs", target_probs, tree, node_valid)
    _check_probs("draft_probs", draft_probs, tree, tree.has_children, vocab_size)
    _check_draft_tokens(tree, node_valid, vocab_size)
    batch_size, width = tree.token_ids.shape[0], tree.max_depth + 1
    _check_uniforms("accept_uniforms", accept_uniforms, (batch_size, width, tree.max_children))
    _check_uniforms("sample_uniforms", sample_uniforms, (batch_size, width))

    def step(rows: torch.Tensor, nodes: torch.Tensor, depth: int) -> tuple[torch.Tensor, torch.Tensor]:
        target_rows = target_probs[rows, nodes].to(torch.float64)  # [R, V]
        draft_rows = draft_probs[rows, nodes].to(torch.float64)  # [R, V]
        current = target_rows.clone()  # [R, V]: p, then the residual after each rejection
        child = torch.full_like(rows, -1)  # [R]
        undecided = torch.ones_like(rows, dtype=torch.bool)  # [R]
        for j in range(tree.max_children):
            candidate = tree.children[rows, nodes, j]  # [R]
            trying = (undecided & (candidate >= 0)).nonzero().squeeze(1)  # [T] positions in rows
            if trying.numel() == 0:
                break
            token = tree.token_ids[rows[trying], candidate[trying]]  # [T]
            q_token = draft_rows[trying, token]
            p_token = current[trying, token]
            coin = accept_uniforms[rows[trying], depth, j]
            accept = (q_token > 0) & (coin * q_token <= p_token)
            child[trying[accept]] = candidate[trying[accept]]
            undecided[trying[accept]] = False
            rejected = trying[~accept]
            residual = _residual(current[rejected], draft_rows[rejected])
            current[rejected] = _renormalise(residual, target_rows[rejected])
        final_token = torch.full_like(rows, -1)  # [R]
        stopping = undecided.nonzero().squeeze(1)
        if stopping.numel() > 0:
            final_token[stopping] = sample_from_probs(
                current[stopping], sample_uniforms[rows[stopping], depth]
            )
        return child, final_token

    return _walk(tree, step)


def _residual(
    target_probs_row: torch.Tensor,  # [..., V] float64
    draft_probs_row: torch.Tensor,  # [..., V] float64
) -> torch.Tensor:
    """max(p - q, 0), unnormalised: what is left of p after the draft's share has been offered."""
    return (target_probs_row - draft_probs_row).clamp(min=0.0)


def _renormalise(
    residual: torch.Tensor,  # [R, V] float64
    fallback: torch.Tensor,  # [R, V] float64: the original target rows
) -> torch.Tensor:
    """residual / its mass; rows of zero mass (reachable only through rounding) take the fallback row."""
    mass = residual.sum(dim=-1, keepdim=True)  # [R, 1]
    return torch.where(mass > 0, residual / mass.clamp(min=torch.finfo(torch.float64).tiny), fallback)


Step = Callable[[torch.Tensor, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor]]


def _walk(tree: _Tree, step: Step) -> VerifyResult:
    """Advance every request from its root one depth at a time, all active requests at once.

    `step(rows, nodes, depth)` gets the active requests ([R] batch indices) and their current
    node ([R] node indices, all at `depth`) and returns ([R] accepted child node or -1,
    [R] recovered-or-bonus token, read only where the child is -1).
    """
    batch_size, width = tree.token_ids.shape[0], tree.max_depth + 1
    accepted_nodes = torch.full((batch_size, width), -1, dtype=torch.int64)
    accepted_nodes[:, 0] = 0
    output_token_ids = torch.full((batch_size, width), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch_size, dtype=torch.int64)
    bonus_token_ids = torch.full((batch_size,), -1, dtype=torch.int64)
    rows = torch.arange(batch_size)
    nodes = torch.zeros(batch_size, dtype=torch.int64)
    for depth in range(width):
        if rows.numel() == 0:
            break
        child, final_token = step(rows, nodes, depth)
        moved = child >= 0
        stop_rows = rows[~moved]
        assert bool((final_token[~moved] >= 0).all()), "a stopping request got no final token"
        bonus_token_ids[stop_rows] = final_token[~moved]
        output_token_ids[stop_rows, depth] = final_token[~moved]
        rows, nodes = rows[moved], child[moved]
        if rows.numel() == 0:
            break
        assert depth + 1 < width, "a request walked past the deepest node"
        accepted_nodes[rows, depth + 1] = nodes
        output_token_ids[rows, depth] = tree.token_ids[rows, nodes]
        num_accepted[rows] = depth + 1
    return VerifyResult(accepted_nodes, num_accepted, output_token_ids, bonus_token_ids)


def _child_with_token(
    tree: _Tree,
    rows: torch.Tensor,  # [R] batch indices
    nodes: torch.Tensor,  # [R] current node of each row
    token: torch.Tensor,  # [R] int64
) -> torch.Tensor:
    """[R] the first child (sibling order) of each node whose token equals `token`, else -1."""
    children = tree.children[rows, nodes]  # [R, K]
    child_tokens = tree.token_ids[rows.unsqueeze(1), children.clamp(min=0)]  # [R, K]
    match = (children >= 0) & (child_tokens == token.unsqueeze(1))  # [R, K]
    first = match.to(torch.int8).argmax(dim=1, keepdim=True)  # [R, 1]; first True, or 0 if none
    return torch.where(match.any(dim=1), children.gather(1, first).squeeze(1), -1)


def _build_tree(
    tree_token_ids: torch.Tensor,  # [B, N] integer
    parents: torch.Tensor,  # [B, N] integer
    node_valid: torch.Tensor,  # [B, N] bool
) -> _Tree:
    """Validate the tree and index it: depths, and each node's children in sibling order."""
    for name, value in (("tree_token_ids", tree_token_ids), ("parents", parents)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or not is_integer(value):
            raise ValueError(f"{name} must be a 2-D integer tensor [B, N], got {describe(value)}")
    if not isinstance(node_valid, torch.Tensor) or node_valid.dtype != torch.bool:
        raise ValueError(f"node_valid must be a bool tensor [B, N], got {describe(node_valid)}")
    shapes = {tuple(t.shape) for t in (tree_token_ids, parents, node_valid)}
    if len(shapes) != 1 or tree_token_ids.shape[1] < 1:
        raise ValueError(
            f"tree_token_ids {tuple(tree_token_ids.shape)}, parents {tuple(parents.shape)} and "
            f"node_valid {tuple(node_valid.shape)} must share one shape [B, N] with N >= 1"
        )
    batch_size, num_nodes = tree_token_ids.shape
    parents = parents.to(torch.int64)
    if not node_valid[:, 0].all():
        raise ValueError(f"node_valid[:, 0] (the roots) must be True, got {node_valid[:, 0].tolist()}")
    if (parents[:, 0] != -1).any():
        raise ValueError(f"parents[:, 0] (the roots) must be -1, got {parents[:, 0].tolist()}")
    node_ids = torch.arange(num_nodes)
    draft = node_valid & (node_ids > 0)  # [B, N] valid non-root nodes
    in_order = (parents >= 0) & (parents < node_ids)
    # Padding may hold any parent; clamp so indexing by it is safe, its values are never used.
    parents = parents.clamp(0, num_nodes - 1)
    parent_valid = node_valid.gather(1, parents)
    bad = draft & ~(in_order & parent_valid)
    if bad.any():
        b, i = (int(v) for v in bad.nonzero()[0])
        raise ValueError(
            f"parents[{b}, {i}] = {int(parents[b, i])}: a valid draft node needs a valid parent "
            f"with a smaller index (0 <= parent < {i})"
        )

    depth = torch.zeros(batch_size, num_nodes, dtype=torch.int64)
    for i in range(1, num_nodes):  # parents come before children, so one pass suffices
        depth[:, i] = depth.gather(1, parents[:, i : i + 1]).squeeze(1) + 1
    max_depth = int(depth[draft].max()) if draft.any() else 0

    # Sibling rank: how many valid siblings come before the node.
    # parents [[-1, 0, 0, 1]] -> rank [[0, 0, 1, 0]]: nodes 1 and 2 are children 0 and 1 of node 0.
    same_parent = (parents.unsqueeze(2) == parents.unsqueeze(1)) & draft.unsqueeze(1)  # [B, N, N]: [b, i, j]
    earlier = node_ids.unsqueeze(1) > node_ids.unsqueeze(0)  # [N, N]: [i, j] = j < i
    rank = (same_parent & earlier).sum(dim=2)  # [B, N]
    max_children = int(rank[draft].max()) + 1 if draft.any() else 0
    children = torch.full((batch_size, num_nodes, max(max_children, 1)), -1, dtype=torch.int64)
    b_idx, i_idx = draft.nonzero(as_tuple=True)
    children[b_idx, parents[b_idx, i_idx], rank[b_idx, i_idx]] = i_idx
    return _Tree(
        token_ids=tree_token_ids.to(torch.int64),
        children=children,
        has_children=children[:, :, 0] >= 0,
        max_depth=max_depth,
        max_children=max_children,
    )


def _check_draft_tokens(tree: _Tree, node_valid: torch.Tensor, vocab_size: int) -> None:
    draft = node_valid.clone()  # [B, N]
    draft[:, 0] = False
    out_of_range = draft & ((tree.token_ids < 0) | (tree.token_ids >= vocab_size))
    if out_of_range.any():
        b, i = (int(v) for v in out_of_range.nonzero()[0])
        raise ValueError(
            f"tree_token_ids[{b}, {i}] = {int(tree.token_ids[b, i])} is a valid draft node but not "
            f"in the vocabulary [0, {vocab_size})"
        )


def _check_scores(name: str, scores: torch.Tensor, tree: _Tree, vocab_size: int | None = None) -> int:
    """Checks a [B, N, V] float tensor against the tree; returns V."""
    expected = tuple(tree.token_ids.shape)
    if (
        not isinstance(scores, torch.Tensor)
        or not scores.dtype.is_floating_point
        or scores.dim() != 3
        or tuple(scores.shape[:2]) != expected
        or scores.shape[2] < 1
    ):
        raise ValueError(f"{name} must be a float tensor [B, N, V] with [B, N] = {list(expected)}, "
                         f"got {describe(scores)}")
    if vocab_size is not None and scores.shape[2] != vocab_size:
        raise ValueError(f"{name} has V = {scores.shape[2]} but target_probs has V = {vocab_size}")
    return scores.shape[2]


def _check_probs(
    name: str,
    probs: torch.Tensor,  # [B, N, V]
    tree: _Tree,
    rows_used: torch.Tensor,  # [B, N] bool: the rows that must be distributions
    vocab_size: int | None = None,
) -> int:
    """Checks that the used rows are probability distributions; returns V."""
    vocab_size = _check_scores(name, probs, tree, vocab_size)
    used = probs[rows_used].to(torch.float64)  # [M, V]
    if used.numel() == 0:
        return vocab_size
    row_sum = used.sum(dim=-1)  # [M]
    not_distribution = ~torch.isfinite(row_sum) | (used.amin(dim=-1) < 0)
    not_distribution |= ~((row_sum - 1).abs() <= _ROW_SUM_TOLERANCE)
    if not_distribution.any():
        first = int(not_distribution.nonzero()[0, 0])
        b, i = (int(v) for v in rows_used.nonzero()[first])
        raise ValueError(
            f"{name}[{b}, {i}] is not a probability distribution (sum {row_sum[first].item()!r}, "
            f"min {used[first].min().item()!r}); pass logits_to_probs output"
        )
    return vocab_size


def _check_uniforms(name: str, value: torch.Tensor, min_shape: tuple[int, ...]) -> None:
    """float64, shape at least min_shape (extra trailing columns are ignored), used part in (0, 1)."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != torch.float64
        or value.dim() != len(min_shape)
        or value.shape[0] != min_shape[0]
        or any(have < need for have, need in zip(value.shape[1:], min_shape[1:]))
    ):
        raise ValueError(f"{name} must be float64 with shape {list(min_shape)} (or more columns), "
                         f"got {describe(value)}")
    used = value[tuple(slice(0, n) for n in min_shape)]
    if not ((used > 0) & (used < 1)).all():
        bad = used[~((used > 0) & (used < 1))][0].item()
        raise ValueError(f"{name} must lie in the open interval (0, 1), got {bad!r}")
