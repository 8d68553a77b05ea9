"""drafter.tree.expand_topk (and its _select / _extend_visible) against a scripted step function
and an independent brute force (tests/drafter/tree_oracle.py): a hand-computed tree, random
trees, batches, argmax chains without a softmax, budgets and ties."""

import math

import pytest
import torch

from drafter.tree import _extend_visible, _select, expand_topk
from tests.drafter.tree_oracle import (ScriptedStep, _identity, beam_candidates, check_against_brute_force,
                                       check_closed, node_paths, random_logits)


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
