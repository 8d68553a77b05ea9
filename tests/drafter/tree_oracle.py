"""The oracle of the drafter.tree tests: a scripted step function and an independent brute force.

The scripted step reconstructs each live branch's path from `parent_rows` (as a real proposer
gathers its previous hidden rows) and returns logits that depend on (request, whole path), so a
wrong parent row, token or request shows up as a different tree. The brute force enumerates
paths in float64 and re-runs the candidate pool of SGLang / the EAGLE reference (engines.md
2.1): the k best children of the root, then per step the k best children of each of the k live
branches, all k*k kept as candidates and the k best expanded; the tree is the N-1 best.
"""

import torch

from drafter.tree import DraftNodes


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


class ScriptedStep:
    """A StepFn whose logits are `logits_of(request, path)`, path = target ids from depth 1."""

    def __init__(self, logits_of, batch: int):
        self.logits_of = logits_of
        self.rows = [[()] for _ in range(batch)]   # per request: the path of each previous output row
        self.calls: list[dict] = []

    def __call__(self, step, token_ids, parent_rows, visible):
        b, k = token_ids.shape
        assert step == len(self.calls) + 1
        assert parent_rows.shape == (b, k) and parent_rows.dtype == torch.int64
        assert visible.shape == (b, k, step * k) and visible.dtype == torch.bool
        paths = [[self.rows[i][int(parent_rows[i, j])] + (int(token_ids[i, j]),) for j in range(k)]
                 for i in range(b)]
        self.rows = paths
        self.calls.append(dict(step=step, token_ids=token_ids.clone(), parent_rows=parent_rows.clone(),
                               visible=visible.clone(), paths=paths))
        return torch.stack([torch.stack([self.logits_of(i, p) for p in row]) for i, row in enumerate(paths)]).float()


def random_logits(vocab: int, salt: int = 0, scale: float = 3.0):
    """Deterministic, path-dependent logits: a fresh generator seeded by (salt, request, path)."""
    def logits_of(b: int, path: tuple[int, ...]) -> torch.Tensor:
        s = salt
        for t in (b, *path):
            s = (s * 1_000_003 + t + 7) % (2 ** 61 - 1)
        return torch.randn(vocab, generator=torch.Generator().manual_seed(s), dtype=torch.float64) * scale
    return logits_of


# ---------------------------------------------------------------- brute force (float64)

def _log_probs(logits_of, first, b, path) -> torch.Tensor:
    row = first[b] if not path else logits_of(b, path)
    return torch.log_softmax(row.double(), -1)


def _children(logits_of, first, b, k, path, score):
    vals, toks = _log_probs(logits_of, first, b, path).topk(k)
    return [(score + float(v), path + (int(t),)) for v, t in zip(vals, toks)]


def all_paths(logits_of, first, b, k, depth) -> dict[tuple[int, ...], float]:
    """Every path through the top-k children of every node, depth 1..depth -> summed log-prob."""
    out, frontier = {}, [(0.0, ())]
    for _ in range(depth):
        nxt = [c for score, path in frontier for c in _children(logits_of, first, b, k, path, score)]
        out.update({p: s for s, p in nxt})
        frontier = nxt
    return out


def beam_candidates(logits_of, first, b, k, num_steps) -> tuple[list, list]:
    """The k + (S-1)k^2 candidates (score, path) in global id order, and each step's live paths."""
    cands = _children(logits_of, first, b, k, (), 0.0)
    live, lives = cands, [[p for _, p in cands]]
    for _ in range(1, num_steps):
        step = [c for score, path in live for c in _children(logits_of, first, b, k, path, score)]
        cands = cands + step
        live = sorted(step, key=lambda c: -c[0])[:k]
        lives.append([p for _, p in live])
    return cands, lives


# ---------------------------------------------------------------- tree checks

def node_paths(tree: DraftNodes, b: int, distinct: bool = True) -> list[tuple[int, ...]]:
    """Paths of the draft nodes of request b; asserts parents precede children and, for top-k
    trees, that no path repeats (sampled chains draw i.i.d. and may repeat)."""
    paths = [()]
    for j, (t, p) in enumerate(zip(tree.token_ids[b].tolist(), tree.parents[b].tolist())):
        assert 0 <= p <= j, f"node {j + 1} has parent {p}: not an earlier node"
        paths.append(paths[p] + (t,))
    nodes = paths[1:]
    assert not distinct or len(set(nodes)) == len(nodes), "duplicate node"
    return nodes


def check_closed(tree: DraftNodes, b: int, distinct: bool = True) -> list[tuple[int, ...]]:
    nodes = node_paths(tree, b, distinct)
    chosen = set(nodes)
    for p in nodes:
        assert all(p[:d] in chosen for d in range(1, len(p))), f"{p} misses an ancestor"
    depths = [len(p) for p in nodes]
    assert depths == sorted(depths), "nodes are not ordered by depth"
    return nodes


def check_visible(calls: list[dict], b: int) -> None:
    """At step s, branch j may see the scratch entry of (step s', branch j') iff that entry's path
    is a prefix of branch j's path (an ancestor, or itself): compared with the tree, not the code."""
    for c in calls:
        s = c["step"]
        k = c["token_ids"].shape[1]
        for j, path in enumerate(c["paths"][b]):
            expected = torch.zeros(s * k, dtype=torch.bool)
            for s2 in range(1, s + 1):
                for j2, q in enumerate(calls[s2 - 1]["paths"][b]):
                    expected[(s2 - 1) * k + j2] = path[:s2] == q
            assert torch.equal(c["visible"][b, j], expected), (s, j, c["visible"][b, j], expected)


def check_against_brute_force(tree, step, logits_of, first, b, k, num_steps, num_draft_tokens, tol=1e-5):
    nodes = check_closed(tree, b)
    paths = all_paths(logits_of, first, b, k, num_steps)
    for j, p in enumerate(nodes):
        assert p in paths, f"node {p} is not a path through top-k children"
        assert abs(float(tree.scores[b, j]) - paths[p]) < tol, (p, float(tree.scores[b, j]), paths[p])
    cands, lives = beam_candidates(logits_of, first, b, k, num_steps)
    assert len(cands) == k + (num_steps - 1) * k * k
    best = sorted(cands, key=lambda c: -c[0])[: num_draft_tokens - 1]
    assert set(nodes) == {p for _, p in best}
    # the live branches the step function saw are the brute force's, in score order
    for c in step.calls:
        assert c["paths"][b] == lives[c["step"] - 1], c["step"]
    check_visible(step.calls, b)
