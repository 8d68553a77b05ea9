"""Random draft trees and their accepted paths, for the runner tests that verify and commit
rounds (tests/verifier/test_graphs_cpu.py, test_triton_attention_cpu.py and their GPU twins)."""

from __future__ import annotations

import torch


def random_trees(g: torch.Generator, b: int, n: int):
    """(token ids, parents, valid), each [B, N]: random trees whose parents precede their
    children; row i ends in i % 3 padding nodes (where N > 3), token id -1 there."""
    parents = torch.full((b, n), -1, dtype=torch.long)
    valid = torch.ones(b, n, dtype=torch.bool)
    for i in range(b):
        live = n - (i % 3 if n > 3 else 0)
        for j in range(1, live):
            parents[i, j] = int(torch.randint(0, j, (1,), generator=g))
        valid[i, live:] = False
    return torch.randint(1, 4096, (b, n), generator=g).masked_fill(~valid, -1), parents, valid


def accepted_paths(parents: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, N]: the root-first path to each row's last valid node, -1 padded."""
    b, n = parents.shape
    out = torch.full((b, n), -1, dtype=torch.long)
    for i in range(b):
        node, path = int(valid[i].nonzero().max()), []
        while node >= 0:
            path.append(node)
            node = int(parents[i, node])
        out[i, : len(path)] = torch.tensor(path[::-1])
    return out
