"""The greedy walk the verifier runs on the CPU (spectandem/kernels/accept.py greedy_accept_host)
gives verify_greedy's results on every tree: random valid trees whose siblings often share a
token, the tie rule (the lower node index wins), and the trees it refuses."""

import pytest
import torch

from spectandem.kernels.accept import greedy_accept, greedy_accept_host, greedy_accept_ref
from tests.gpu.test_kernels import random_tree


@pytest.mark.parametrize("batch, num_nodes", [(1, 1), (1, 5), (3, 2), (8, 16), (64, 5), (5, 64)])
def test_host_walk_equals_verify_greedy_on_random_trees(batch, num_nodes):
    for seed in range(20):
        gen = torch.Generator().manual_seed(1000 * num_nodes + seed)
        tokens, parents, valid = random_tree(gen, batch, num_nodes, 3, "cpu")
        argmax = torch.randint(0, 3, (batch, num_nodes), generator=gen)
        got = greedy_accept_host(argmax, tokens, parents, valid)
        expected = greedy_accept_ref(argmax, tokens, parents, valid)
        for name, a, e in zip(got._fields, got, expected):
            assert torch.equal(a, e), f"{name}: host walk {a.tolist()} != verify_greedy {e.tolist()} (seed {seed})"


def test_cpu_tensors_take_the_host_walk_with_the_tie_rule():
    tokens = torch.tensor([[5, 7, 7, 9, 9]])
    parents = torch.tensor([[-1, 0, 0, 2, 1]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    argmax = torch.tensor([[7, 9, 9, 3, 4]])
    got = greedy_accept(argmax, tokens, parents, valid)
    assert got.accepted_nodes.tolist() == [[0, 1, 4, -1, -1]] and got.num_accepted.tolist() == [2]
    assert got.output_token_ids.tolist() == [[7, 9, 4, -1, -1]] and got.bonus_token_ids.tolist() == [4]


@pytest.mark.parametrize("defect", ["root_invalid", "root_parent", "parent_after", "parent_padding"])
def test_malformed_trees_are_refused(defect):
    tokens = torch.tensor([[5, 7, 8, 9]])
    parents = torch.tensor([[-1, 0, 1, 2]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    if defect == "root_invalid":
        valid[0, 0] = False
    elif defect == "root_parent":
        parents[0, 0] = 0
    elif defect == "parent_after":
        parents[0, 2] = 3
    else:
        valid[0, 1] = False                       # node 2 hangs off padding
    with pytest.raises(ValueError, match="root|parent"):
        greedy_accept_host(torch.zeros(1, 4, dtype=torch.long), tokens, parents, valid)
    with pytest.raises(ValueError):
        greedy_accept_ref(torch.zeros(1, 4, dtype=torch.long), tokens, parents, valid)
