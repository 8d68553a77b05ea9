"""drafter.tree against a scripted step function and an independent brute force.

The scripted step reconstructs each live branch's path from `parent_rows` (as a real proposer
gathers its previous hidden rows) and returns logits that depend on (request, whole path), so a
wrong parent row, token or request shows up as a different tree. The brute force enumerates
paths in float64 and re-runs the candidate pool of SGLang / the EAGLE reference (engines.md
2.1): the k best children of the root, then per step the k best children of each of the k live
branches, all k*k kept as candidates and the k best expanded; the tree is the N-1 best.
"""

import math

import pytest
import torch

from drafter.tree import TreeDraft, _extend_visible, _select, expand_topk, sample_chains
from spectandem import rng
from spectandem.sampling import logits_to_probs, sample_from_probs


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

def node_paths(tree: TreeDraft, b: int, distinct: bool = True) -> list[tuple[int, ...]]:
    """Paths of the draft nodes of request b; asserts parents precede children and, for top-k
    trees, that no path repeats (sampled chains draw i.i.d. and may repeat)."""
    paths = [()]
    for j, (t, p) in enumerate(zip(tree.token_ids[b].tolist(), tree.parents[b].tolist())):
        assert 0 <= p <= j, f"node {j + 1} has parent {p}: not an earlier node"
        paths.append(paths[p] + (t,))
    nodes = paths[1:]
    assert not distinct or len(set(nodes)) == len(nodes), "duplicate node"
    return nodes


def check_closed(tree: TreeDraft, b: int, distinct: bool = True) -> list[tuple[int, ...]]:
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


# ---------------------------------------------------------------- hand-computed tree

ROOT = [0.04, 0.62, 0.28, 0.03, 0.02, 0.01]
TABLE = {                        # next-token probabilities keyed by the input token
    0: [0.10, 0.20, 0.30, 0.15, 0.15, 0.10],
    1: [0.04, 0.02, 0.03, 0.50, 0.40, 0.01],
    2: [0.01, 0.02, 0.03, 0.04, 0.20, 0.70],
    3: [0.10, 0.05, 0.05, 0.05, 0.05, 0.70],
    4: [0.05, 0.45, 0.30, 0.10, 0.05, 0.05],
    5: [0.30, 0.10, 0.10, 0.20, 0.25, 0.05],
}


def _table_logits(b, path):
    return torch.tensor(TABLE[path[-1]], dtype=torch.float64).log()


# Candidates (k=2, S=3), as products of probabilities:
#   c0 = 1 (.62)            c1 = 2 (.28)                               root's children
#   c2 = 1>3 (.31)  c3 = 1>4 (.248)  c4 = 2>5 (.196)  c5 = 2>4 (.056)  step 1; live c2, c3
#   c6 = 1>3>5 (.217)  c7 = 1>3>0 (.031)  c8 = 1>4>1 (.1116)  c9 = 1>4>2 (.0744)   step 2
# Ranking: c0 .62, c2 .31, c1 .28, c3 .248, c6 .217, c4 .196, c8, c9, c5, c7.
HAND = {
    6: dict(tokens=[1, 2, 3, 4, 5], parents=[0, 0, 1, 1, 3], probs=[.62, .28, .31, .248, .217]),
    7: dict(tokens=[1, 2, 3, 4, 5, 5], parents=[0, 0, 1, 1, 2, 3], probs=[.62, .28, .31, .248, .196, .217]),
}


@pytest.mark.parametrize("num_draft_tokens", sorted(HAND))
def test_hand_computed_tree(num_draft_tokens) -> None:
    first = torch.tensor(ROOT).log()[None]
    step = ScriptedStep(_table_logits, 1)
    tree = expand_topk(first, step, _identity, num_steps=3, topk=2, num_draft_tokens=num_draft_tokens,
                       argmax=False)
    want = HAND[num_draft_tokens]
    assert tree.token_ids.tolist() == [want["tokens"]]
    assert tree.parents.tolist() == [want["parents"]]
    assert tree.token_ids.dtype == tree.parents.dtype == torch.int64
    assert tree.scores.dtype == torch.float32
    torch.testing.assert_close(tree.scores[0], torch.tensor(want["probs"]).log(), atol=1e-5, rtol=0)
    check_against_brute_force(tree, step, _table_logits, first, 0, 2, 3, num_draft_tokens)
    # the step function ran twice (S - 1 forwards): on the root's children, then on c2, c3,
    # which both continue row 0 (token 1) of the first step's output
    assert [c["token_ids"].tolist() for c in step.calls] == [[[1, 2]], [[3, 4]]]
    assert [c["parent_rows"].tolist() for c in step.calls] == [[[0, 0]], [[0, 0]]]
    assert step.calls[0]["visible"].tolist() == [[[True, False], [False, True]]]
    assert step.calls[1]["visible"].tolist() == [[[True, False, True, False], [True, False, False, True]]]


@pytest.mark.parametrize("k, num_steps, num_draft_tokens, vocab, salt", [
    (2, 3, 6, 16, 1),
    (2, 4, 8, 16, 2),
    (3, 4, 12, 24, 3),
    (4, 3, 16, 32, 4),
    (3, 1, 3, 8, 5),    # no forward at all: the root's best children only
])
def test_matches_brute_force(k, num_steps, num_draft_tokens, vocab, salt) -> None:
    logits_of = random_logits(vocab, salt)
    first = torch.randn(1, vocab, generator=torch.Generator().manual_seed(salt)) * 3
    step = ScriptedStep(logits_of, 1)
    tree = expand_topk(first, step, _identity, num_steps, k, num_draft_tokens, argmax=False)
    assert tree.token_ids.shape == (1, num_draft_tokens - 1)
    assert len(step.calls) == num_steps - 1
    check_against_brute_force(tree, step, logits_of, first, 0, k, num_steps, num_draft_tokens)


def test_batch_larger_than_topk_each_request_alone() -> None:
    b, k, num_steps, n, vocab = 5, 2, 4, 10, 20
    logits_of = random_logits(vocab, salt=11)
    first = torch.randn(b, vocab, generator=torch.Generator().manual_seed(11)) * 3
    step = ScriptedStep(logits_of, b)
    tree = expand_topk(first, step, _identity, num_steps, k, n, argmax=False)
    assert tree.token_ids.shape == tree.parents.shape == tree.scores.shape == (b, n - 1)
    shapes = set()
    for i in range(b):
        alone_step = ScriptedStep(lambda _, path, i=i: logits_of(i, path), 1)
        alone = expand_topk(first[i: i + 1], alone_step, _identity, num_steps, k, n, argmax=False)
        assert torch.equal(tree.token_ids[i], alone.token_ids[0]), i
        assert torch.equal(tree.parents[i], alone.parents[0]), i
        torch.testing.assert_close(tree.scores[i], alone.scores[0], atol=1e-6, rtol=0)
        check_against_brute_force(tree, step, logits_of, first, i, k, num_steps, n)
        shapes.add(tuple(tree.parents[i].tolist()))
    assert len(shapes) > 1, "the requests should have differently shaped trees"


# ---------------------------------------------------------------- argmax chains

def _raise(*args, **kwargs):
    raise AssertionError("a softmax ran on the argmax path")


@pytest.mark.parametrize("num_steps, num_draft_tokens", [(4, 5), (4, 3), (1, 2), (3, 8)])
def test_topk1_argmax_chain_without_softmax(monkeypatch, num_steps, num_draft_tokens) -> None:
    b, vocab, shift = 3, 32, 1000
    logits_of = random_logits(vocab, salt=21)
    first = torch.randn(b, vocab, generator=torch.Generator().manual_seed(21))
    to_target = lambda t: t + shift                                          # noqa: E731
    step = ScriptedStep(lambda i, path: logits_of(i, path), b)
    with monkeypatch.context() as m:
        for owner in (torch, torch.nn.functional, torch.special):
            m.setattr(owner, "softmax", _raise)
            m.setattr(owner, "log_softmax", _raise)
        m.setattr(torch.Tensor, "softmax", _raise)
        m.setattr(torch.Tensor, "log_softmax", _raise)
        with pytest.raises(AssertionError):
            torch.zeros(3).softmax(0)
        tree = expand_topk(first, step, to_target, num_steps, 1, num_draft_tokens, argmax=True)
    m_nodes = min(num_steps, num_draft_tokens - 1)
    assert tree.token_ids.shape == (b, m_nodes)
    for i in range(b):
        chain = [int(first[i].argmax()) + shift]
        while len(chain) < m_nodes:
            chain.append(int(logits_of(i, tuple(chain)).argmax()) + shift)
        assert tree.token_ids[i].tolist() == chain
        assert tree.parents[i].tolist() == list(range(m_nodes))
    assert torch.equal(tree.scores, torch.zeros_like(tree.scores)), "argmax chains have a constant score"
    # the step function was fed target ids of the chain, each continuing row 0
    for c in step.calls:
        assert c["parent_rows"].eq(0).all()
        assert (c["token_ids"] >= shift).all()


# ---------------------------------------------------------------- budget and ties

@pytest.mark.parametrize("argmax", [False, True])
def test_budget_larger_than_candidates_keeps_all(argmax) -> None:
    vocab = 10
    logits_of = random_logits(vocab, salt=31)
    first = torch.randn(2, vocab, generator=torch.Generator().manual_seed(31))
    step = ScriptedStep(logits_of, 2)
    tree = expand_topk(first, step, _identity, num_steps=3, topk=1, num_draft_tokens=8, argmax=argmax)
    assert tree.token_ids.shape == (2, 3)                    # k + (S-1)k^2 = 3 candidates
    assert tree.parents.tolist() == [[0, 1, 2]] * 2
    for i in range(2):
        if not argmax:
            check_against_brute_force(tree, step, logits_of, first, i, 1, 3, 8)
        else:
            assert node_paths(tree, i) == [p for _, p in beam_candidates(logits_of, first, i, 1, 3)[0]]

    step = ScriptedStep(logits_of, 2)
    tree = expand_topk(first, step, _identity, num_steps=3, topk=2, num_draft_tokens=40, argmax=argmax)
    assert tree.token_ids.shape == (2, 2 + 2 * 4)
    for i in range(2):
        cands, _ = beam_candidates(logits_of, first, i, 2, 3)
        assert set(check_closed(tree, i)) == {p for _, p in cands}


def test_select_docstring_example() -> None:
    tok = torch.tensor([[10, 11, 12, 13]])
    score = torch.tensor([[-.1, -.5, -.3, -.9]])
    parent = torch.tensor([[-1, -1, 0, 0]])
    tree = _select(tok, score, parent, 2, _identity)
    assert tree.token_ids.tolist() == [[10, 12]]
    assert tree.parents.tolist() == [[0, 1]]
    torch.testing.assert_close(tree.scores, torch.tensor([[-.1, -.3]]))


def test_select_breaks_ties_towards_lower_ids() -> None:
    # A chain of 60 probability-one candidates (all scores 0): only the lowest ids are closed.
    m = 60
    tok = torch.arange(m)[None]
    parent = (torch.arange(m) - 1)[None]
    for budget in (1, 17, 30, 59, 80):
        tree = _select(tok, torch.zeros(1, m), parent, budget, _identity)
        n = min(budget, m)
        assert tree.token_ids.tolist() == [list(range(n))]
        assert tree.parents.tolist() == [list(range(n))]


def test_extend_visible_example() -> None:
    # k = 2 after step 1 (eye); both step-2 branches continue branch 0, then step-3 branches
    # continue branches 1 and 0 of step 2.
    vis = torch.eye(2, dtype=torch.bool)[None]
    vis = _extend_visible(vis, torch.tensor([[0, 0]]), 2)
    assert vis.int().tolist() == [[[1, 0, 1, 0], [1, 0, 0, 1]]]
    vis = _extend_visible(vis, torch.tensor([[1, 0]]), 2)
    assert vis.int().tolist() == [[[1, 0, 0, 1, 1, 0], [1, 0, 1, 0, 0, 1]]]


@pytest.mark.parametrize("k, num_steps", [(2, 3), (4, 4)])
@pytest.mark.parametrize("num_draft_tokens", [2, 3, 4, 5, 7, 11, 20, 30, 53])
def test_ties_stay_ancestor_closed(k, num_steps, num_draft_tokens) -> None:
    # Uniform logits: every candidate of a depth ties with every other.
    vocab = 6
    budget = min(num_draft_tokens - 1, k + (num_steps - 1) * k * k)
    step = ScriptedStep(lambda b, path: torch.zeros(vocab), 2)
    tree = expand_topk(torch.zeros(2, vocab), step, _identity, num_steps, k, num_draft_tokens, argmax=False)
    for i in range(2):
        nodes = check_closed(tree, i)
        assert len(nodes) == budget
        depth_score = {len(p): s for p, s in zip(nodes, tree.scores[i].tolist())}
        for p, s in zip(nodes, tree.scores[i].tolist()):
            assert s == pytest.approx(len(p) * math.log(1 / vocab), abs=1e-5)
        assert sorted(depth_score) == list(range(1, len(depth_score) + 1))
    # Probability-one children tie with their parents; every other candidate is -inf.
    one_hot = torch.full((vocab,), float("-inf"))
    one_hot[2] = 0.0
    step = ScriptedStep(lambda b, path: one_hot, 2)
    tree = expand_topk(one_hot.expand(2, vocab).clone(), step, _identity, num_steps, k, num_draft_tokens,
                       argmax=False)
    for i in range(2):
        nodes = check_closed(tree, i)
        assert len(nodes) == budget and nodes[0] == (2,)
        finite = [p for p, s in zip(nodes, tree.scores[i].tolist()) if s == 0.0]
        assert finite == [(2,) * d for d in range(1, min(num_steps, budget) + 1)]


# ---------------------------------------------------------------- sampled chains

def _chains(first, logits_of, k, num_steps, n, temps, top_ks, top_ps, seeds, lens):
    step = ScriptedStep(logits_of, first.shape[0])
    tree = sample_chains(first, step, _identity, num_steps, k, n, temps, top_ks, top_ps, seeds, lens)
    return tree, step


def test_sample_chains_layout_probs_and_draws() -> None:
    b, k, num_steps, n, vocab = 2, 2, 3, 7, 12
    logits_of = random_logits(vocab, salt=41, scale=1.0)
    first = torch.randn(b, vocab, generator=torch.Generator().manual_seed(41))
    temps, top_ks, top_ps = [1.0, 0.8], [0, 6], [1.0, 0.9]
    seeds, lens = [123, 456], [10, 17]
    tree, step = _chains(first, logits_of, k, num_steps, n, temps, top_ks, top_ps, seeds, lens)
    depth = 3
    m = depth * k
    assert tree.token_ids.shape == tree.parents.shape == tree.scores.shape == (b, m)
    assert tree.node_probs.shape == (b, m + 1, vocab) and tree.node_probs.dtype == torch.float64
    assert len(step.calls) == depth - 1

    def node(d, j):
        return 1 + (d - 1) * k + j

    for i in range(b):
        assert tree.parents[i].tolist() == [0] * k + list(range(1, m - k + 1))
        paths = [()] + node_paths(tree, i, distinct=False)
        for d in range(1, depth + 1):
            for j in range(k):
                x = node(d, j)
                assert len(paths[x]) == d
                parent = 0 if d == 1 else node(d - 1, j)
                assert int(tree.parents[i, x - 1]) == parent
                # q rows: the root's and every inner node's are the sampling distributions of
                # the logits at that node; leaves have no children and a zero row
                q_parent = tree.node_probs[i, parent]
                if parent == 0:
                    want = logits_to_probs(first[i], temps[i], top_ks[i], top_ps[i])
                else:
                    # the step function hands out float32 logits
                    want = logits_to_probs(logits_of(i, paths[parent]).float(), temps[i], top_ks[i], top_ps[i])
                torch.testing.assert_close(q_parent, want, atol=1e-12, rtol=0)
                assert float(q_parent.sum()) == pytest.approx(1.0, abs=1e-12)
                # the draw is the inverse CDF of the keyed uniform (seed, position, DRAFT, chain)
                u = torch.tensor([rng.uniform(seeds[i], lens[i] - 1 + d, rng.STREAM_DRAFT, j)],
                                 dtype=torch.float64)
                assert int(tree.token_ids[i, x - 1]) == int(sample_from_probs(q_parent[None], u)[0])
                expected_score = sum(math.log(float(tree.node_probs[i, 0 if e == 1 else node(e - 1, j),
                                                                    paths[node(e, j)][-1]]))
                                     for e in range(1, d + 1))
                assert float(tree.scores[i, x - 1]) == pytest.approx(expected_score, abs=1e-5)
                if d == depth:
                    assert not tree.node_probs[i, x].any()
                else:                                   # inner nodes feed step d on chain j
                    assert int(step.calls[d - 1]["token_ids"][i, j]) == paths[x][-1]
    # chain j sees its own entries of every step so far, nothing of the other chains (whose
    # tokens may coincide with its own, so this is checked by chain index, not by path)
    for c in step.calls:
        own = torch.eye(k, dtype=torch.bool).repeat(1, c["step"])               # [k, step * k]
        assert torch.equal(c["visible"], own.expand(b, k, c["step"] * k)), c["step"]
    for c in step.calls[1:]:
        assert c["parent_rows"].tolist() == [list(range(k))] * b

    again, _ = _chains(first, logits_of, k, num_steps, n, temps, top_ks, top_ps, seeds, lens)
    assert torch.equal(again.token_ids, tree.token_ids)
    assert torch.equal(again.node_probs, tree.node_probs)
    other, _ = _chains(first, logits_of, k, num_steps, n, temps, top_ks, top_ps, [124, 457], lens)
    assert not torch.equal(other.token_ids, tree.token_ids)
    # a request's draws do not depend on its batch
    alone, _ = _chains(first[1:], lambda _, p: logits_of(1, p), k, num_steps, n, temps[1:], top_ks[1:],
                       top_ps[1:], seeds[1:], lens[1:])
    assert torch.equal(alone.token_ids[0], tree.token_ids[1])
    assert torch.equal(alone.node_probs[0], tree.node_probs[1])


@pytest.mark.parametrize("k, num_steps, n", [(2, 5, 6), (1, 4, 3), (3, 2, 20), (3, 3, 3), (4, 2, 2)])
def test_sample_chains_respects_budget(k, num_steps, n) -> None:
    vocab = 8
    logits_of = random_logits(vocab, salt=51)
    first = torch.randn(1, vocab, generator=torch.Generator().manual_seed(51))
    tree, _ = _chains(first, logits_of, k, num_steps, n, [1.0], [0], [1.0], [5], [9])
    m = tree.token_ids.shape[1]
    assert 1 <= m <= n - 1, f"{m} draft nodes exceed the budget of {n - 1}"
    assert m == min(n - 1, k * max(1, min(num_steps, (n - 1) // k)))
    assert tree.node_probs.shape[1] == m + 1
    check_closed(tree, 0, distinct=False)


def test_sample_chains_one_hot_q() -> None:
    b, k, vocab = 2, 3, 10
    logits_of = random_logits(vocab, salt=61)
    first = torch.randn(b, vocab, generator=torch.Generator().manual_seed(61))
    # top_k = 1 makes q one-hot at the argmax: every chain is the argmax chain
    tree, _ = _chains(first, logits_of, k, 3, 10, [1.0, 1.5], [1, 1], [1.0, 1.0], [1, 2], [4, 4])
    for i in range(b):
        chain = [int(first[i].argmax())]
        for _ in range(2):
            chain.append(int(logits_of(i, tuple(chain)).argmax()))
        for j in range(k):
            assert [int(tree.token_ids[i, d * k + j]) for d in range(3)] == chain
        assert torch.equal(tree.scores[i], torch.zeros(3 * k))
    # logits that are -inf except at one token
    hot = torch.full((b, vocab), float("-inf"))
    hot[0, 7], hot[1, 3] = 0.5, -2.0
    tree, _ = _chains(hot, lambda i, p: hot[i], k, 2, 7, [0.7, 1.0], [0, 0], [0.9, 1.0], [8, 9], [5, 6])
    assert tree.token_ids.tolist() == [[7] * 2 * k, [3] * 2 * k]
    assert torch.equal(tree.node_probs[:, 0].argmax(-1), torch.tensor([7, 3]))
    assert tree.node_probs[:, 0].amax(-1).tolist() == [1.0, 1.0]
