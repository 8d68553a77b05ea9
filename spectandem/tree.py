"""Tree structure helpers shared by drafter and verifier, vectorised over the batch."""

from __future__ import annotations

import torch


def ancestor_mask(parents: torch.Tensor, node_valid: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (parents precede children; -1 for root/padding), node_valid [B, N]
    -> [B, N, N] bool, True where column j is node i itself or one of its ancestors.

    Example: parents [-1, 0, 0, 1] -> row 3 is [1, 1, 0, 1] (3 sees root 0, its parent 1, itself).
    Invalid nodes see only themselves.
    """
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    mask = eye.expand(b, n, n).clone()
    rows = torch.arange(b, device=parents.device)
    # Parents precede children, so one pass in node order inherits complete ancestor rows.
    for i in range(1, n):
        p = parents[:, i]
        inherit = node_valid[:, i] & (p >= 0)
        mask[:, i] |= mask[rows, p.clamp(min=0)] & inherit[:, None]
    return mask


def node_depths(parents: torch.Tensor, node_valid: torch.Tensor) -> torch.Tensor:
    """[B, N] int64 distance to the root (0 for the root and for padding)."""
    depth = torch.zeros_like(parents)
    rows = torch.arange(parents.shape[0], device=parents.device)
    for i in range(1, parents.shape[1]):
        p = parents[:, i]
        ok = node_valid[:, i] & (p >= 0)
        depth[:, i] = torch.where(ok, depth[rows, p.clamp(min=0)] + 1, 0)
    return depth
