"""Tree structure helpers shared by drafter and verifier, vectorised over the batch."""

from __future__ import annotations

import functools

import numpy as np
import torch


def ancestor_mask(parents: torch.Tensor, node_valid: torch.Tensor) -> torch.Tensor:
    """parents [B, N] (parents precede children; -1 for root/padding), node_valid [B, N]
    -> [B, N, N] bool, True where column j is node i itself or one of its ancestors.

    Example: parents [-1, 0, 0, 1] -> row 3 is [1, 1, 0, 1] (3 sees root 0, its parent 1, itself).
    Invalid nodes see only themselves.
    """
    if parents.device.type == "cpu":
        return tree_shape(parents, node_valid)[1]
    return ancestor_mask_loop(parents, node_valid)


def ancestor_mask_loop(parents: torch.Tensor, node_valid: torch.Tensor) -> torch.Tensor:
    """`ancestor_mask` in torch ops on the tensors' device (a loop over the nodes)."""
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
    if parents.device.type == "cpu":
        return tree_shape(parents, node_valid)[0]
    return node_depths_loop(parents, node_valid)


def node_depths_loop(parents: torch.Tensor, node_valid: torch.Tensor) -> torch.Tensor:
    """`node_depths` in torch ops on the tensors' device (a loop over the nodes)."""
    depth = torch.zeros_like(parents)
    rows = torch.arange(parents.shape[0], device=parents.device)
    for i in range(1, parents.shape[1]):
        p = parents[:, i]
        ok = node_valid[:, i] & (p >= 0)
        depth[:, i] = torch.where(ok, depth[rows, p.clamp(min=0)] + 1, 0)
    return depth


def tree_shape(parents: torch.Tensor, node_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`node_depths` and `ancestor_mask` of host tensors in one pass, in numpy: a verify step
    prepares them on the host every round, where torch's per-op dispatch cost (four ops per node
    and function, ~0.5 ms for a 16-node tree) would keep the GPU waiting.
    -> (depth [B, N] int64, mask [B, N, N] bool)."""
    depth, mask = tree_shape_np(parents.numpy(), node_valid.numpy())
    return torch.from_numpy(depth), torch.from_numpy(mask)


def tree_shape_np(par: np.ndarray, node_valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`tree_shape` on numpy arrays: par [B, N] int64, node_valid [B, N] bool."""
    b, n = par.shape
    ok = node_valid.astype(bool) & (par >= 0)
    if ok[:, 1:].all() and (par == np.arange(-1, n - 1)).all():   # every row a full chain: node i sees 0..i
        return np.broadcast_to(np.arange(n), (b, n)).copy(), np.broadcast_to(tril_mask(n), (b, n, n)).copy()
    mask = np.broadcast_to(np.eye(n, dtype=bool), (b, n, n)).copy()
    depth = np.zeros((b, n), dtype=np.int64)
    rows = np.arange(b)
    # A node without a valid parent link inherits from itself: its row stays the identity, its
    # depth (not yet set) stays 0.
    link = np.where(ok, par, np.arange(n))
    step = ok.astype(np.int64)
    for i in range(1, n):
        p = link[:, i]
        mask[:, i] |= mask[rows, p]
        depth[:, i] = depth[rows, p] + step[:, i]
    return depth, mask


@functools.lru_cache(maxsize=64)
def tril_mask(n: int) -> np.ndarray:
    t = np.tril(np.ones((n, n), dtype=bool))
    t.flags.writeable = False
    return t
