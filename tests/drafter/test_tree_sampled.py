"""drafter.tree.sample_chains against a scripted step function (tests/drafter/tree_oracle.py):
the chain layout, each node's q row and keyed draw, the budget, and one-hot q."""

import math

import pytest
import torch

from drafter.tree import sample_chains
from spectandem import rng
from spectandem.sampling import logits_to_probs, sample_from_probs
from tests.drafter.tree_oracle import ScriptedStep, _identity, check_closed, node_paths, random_logits


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
