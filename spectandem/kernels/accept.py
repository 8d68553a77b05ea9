"""Greedy acceptance over draft trees: one Triton program per request on CUDA, a walk over
Python lists on the CPU (`greedy_accept_host`).

The words are spectandem/accept.py's (read its glossary): node 0 is the root, `parents[b, i] < i`,
children are taken in sibling order (ascending node index), and a round outputs `num_accepted`
accepted draft tokens followed by one bonus token (recovered or bonus: the target argmax where
the walk stops).

The walk, per request: at the current node c (the root first), the target's token is
`target_argmax[b, c]`; the accepted child is the first valid child of c in sibling order whose
token equals it (so when two siblings carry the same token, the lower node index wins, as in
verify_greedy's `_child_with_token`); with no such child the walk stops and that token is the
bonus. Example: parents [-1, 0, 0, 1], tokens [r, 7, 7, 9], target_argmax [7, 9, 5, 4] -> nodes 1
and 2 both match 7, node 1 wins; at node 1 the target says 9 = node 3's token; node 3 is a leaf:
accepted_nodes [0, 1, 3, -1], num_accepted 2, output_token_ids [7, 9, 4, -1], bonus 4.

The kernel takes the argmax rather than the logits: `target_logits.argmax(-1)` on the device
(spectandem.sampling.greedy: the lowest id wins a tie) is what verify_greedy compares with, and
the [B, N] ids are all a walk needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from spectandem.accept import verify_greedy
from spectandem.checks import describe
from spectandem.kernels import HAVE_TRITON


class GreedyAcceptance(NamedTuple):
    """spectandem.accept.VerifyResult's fields, padded to the tree width N instead of D+1."""

    accepted_nodes: torch.Tensor  # [B, N] int64: root (0), then each accepted draft node; -1 pad
    num_accepted: torch.Tensor  # [B] int64: accepted draft nodes, root excluded
    output_token_ids: torch.Tensor  # [B, N] int64: accepted draft tokens, then the bonus token; -1 pad
    bonus_token_ids: torch.Tensor  # [B] int64


if HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _greedy_accept_kernel(
        argmax_ptr, tokens_ptr, parents_ptr, valid_ptr,  # [B, N] each; valid as uint8
        accepted_ptr, output_ptr,  # [B, N] int64
        num_accepted_ptr, bonus_ptr,  # [B] int64
        num_nodes,
        stride_ab, stride_tb, stride_pb, stride_vb, stride_acc_b, stride_out_b,
        BLOCK_N: tl.constexpr,
    ):
        b = tl.program_id(0)
        idx = tl.arange(0, BLOCK_N)
        in_tree = idx < num_nodes
        # The whole tree of one request fits in registers; the walk below only reads them.
        target = tl.load(argmax_ptr + b * stride_ab + idx, mask=in_tree, other=-1).to(tl.int64)
        tokens = tl.load(tokens_ptr + b * stride_tb + idx, mask=in_tree, other=-1).to(tl.int64)
        parents = tl.load(parents_ptr + b * stride_pb + idx, mask=in_tree, other=-1).to(tl.int32)
        draft = (tl.load(valid_ptr + b * stride_vb + idx, mask=in_tree, other=0) != 0) & (idx > 0)

        accepted = tl.where(idx == 0, 0, -1).to(tl.int64)  # [BLOCK_N]
        output = tl.full([BLOCK_N], -1, tl.int64)
        current = tl.full([], 0, tl.int32)  # the walk's node
        num_accepted = tl.full([], 0, tl.int32)
        bonus = tl.full([], -1, tl.int64)
        walking = tl.full([], 1, tl.int1)
        # Depth d = step d; the deepest node has depth < N, so the walk has stopped after N steps.
        for depth in range(0, BLOCK_N):
            wanted = tl.sum(tl.where(idx == current, target, 0))
            match = draft & (parents == current) & (tokens == wanted)
            child = tl.min(tl.where(match, idx, BLOCK_N))  # first in sibling order
            moves = walking & (child < BLOCK_N)
            stops = walking & (child >= BLOCK_N)
            child_token = tl.sum(tl.where(idx == child, tokens, 0))
            output = tl.where(moves & (idx == depth), child_token, output)
            output = tl.where(stops & (idx == depth), wanted, output)
            accepted = tl.where(moves & (idx == depth + 1), child.to(tl.int64), accepted)
            bonus = tl.where(stops, wanted, bonus)
            num_accepted = tl.where(moves, depth + 1, num_accepted)
            current = tl.where(moves, child, current)
            walking = moves
        tl.store(accepted_ptr + b * stride_acc_b + idx, accepted, mask=in_tree)
        tl.store(output_ptr + b * stride_out_b + idx, output, mask=in_tree)
        tl.store(num_accepted_ptr + b, num_accepted.to(tl.int64))
        tl.store(bonus_ptr + b, bonus)


def greedy_accept(
    target_argmax: torch.Tensor,  # [B, N] integer
    tree_token_ids: torch.Tensor,  # [B, N] integer
    parents: torch.Tensor,  # [B, N] integer
    node_valid: torch.Tensor,  # [B, N] bool
) -> GreedyAcceptance:
    """The kernel for CUDA tensors when Triton is installed, the host walk for CPU tensors,
    verify_greedy otherwise."""
    if target_argmax.is_cuda and HAVE_TRITON:
        return greedy_accept_triton(target_argmax, tree_token_ids, parents, node_valid)
    if not target_argmax.is_cuda:
        return greedy_accept_host(target_argmax, tree_token_ids, parents, node_valid)
    return greedy_accept_ref(target_argmax, tree_token_ids, parents, node_valid)


def greedy_accept_host(
    target_argmax: torch.Tensor,  # [B, N] integer
    tree_token_ids: torch.Tensor,  # [B, N] integer
    parents: torch.Tensor,  # [B, N] integer
    node_valid: torch.Tensor,  # [B, N] bool
) -> GreedyAcceptance:
    """The walk on the host over Python lists: each request's children indexed once, then one
    step a depth; what a small tree costs here is the few list operations, not a tensor op a
    step. Checks the tree's structure as verify_greedy does (a valid root with parent -1, every
    valid draft node's parent a valid earlier node)."""
    _check_inputs(target_argmax, tree_token_ids, parents, node_valid)
    batch_size, num_nodes = tree_token_ids.shape
    argmax, tokens = target_argmax.tolist(), tree_token_ids.tolist()
    pars, valid = parents.tolist(), node_valid.tolist()
    accepted = [[-1] * num_nodes for _ in range(batch_size)]
    output = [[-1] * num_nodes for _ in range(batch_size)]
    num_accepted, bonus = [0] * batch_size, [0] * batch_size
    for b in range(batch_size):
        par, ok, tok, target = pars[b], valid[b], tokens[b], argmax[b]
        if not ok[0] or par[0] != -1:
            raise ValueError(f"request {b}: the root (node 0) must be valid with parent -1, got valid {ok[0]}, "
                             f"parent {par[0]}")
        children: list[list[int]] = [[] for _ in range(num_nodes)]
        for i in range(1, num_nodes):
            if ok[i]:
                p = par[i]
                if not (0 <= p < i and ok[p]):
                    raise ValueError(f"parents[{b}, {i}] = {p}: a valid draft node needs a valid parent "
                                     f"earlier in the tree")
                children[p].append(i)
        acc, out = accepted[b], output[b]
        acc[0], current, depth = 0, 0, 0
        while True:
            wanted = target[current]
            child = next((c for c in children[current] if tok[c] == wanted), -1)
            if child < 0:
                out[depth], bonus[b], num_accepted[b] = wanted, wanted, depth
                break
            out[depth] = tok[child]
            depth += 1
            acc[depth], current = child, child
    device = tree_token_ids.device
    return GreedyAcceptance(torch.tensor(accepted, dtype=torch.int64, device=device).view(batch_size, num_nodes),
                            torch.tensor(num_accepted, dtype=torch.int64, device=device),
                            torch.tensor(output, dtype=torch.int64, device=device).view(batch_size, num_nodes),
                            torch.tensor(bonus, dtype=torch.int64, device=device))


def greedy_accept_triton(
    target_argmax: torch.Tensor,  # [B, N] integer
    tree_token_ids: torch.Tensor,  # [B, N] integer
    parents: torch.Tensor,  # [B, N] integer
    node_valid: torch.Tensor,  # [B, N] bool
) -> GreedyAcceptance:
    """Validates shapes and dtypes and launches one program per request. The tree's contents are
    not checked (that needs a host sync): pass trees verify_greedy accepts (`_build_tree`)."""
    if not HAVE_TRITON:
        raise RuntimeError("greedy_accept_triton needs the triton package")
    _check_inputs(target_argmax, tree_token_ids, parents, node_valid)
    batch_size, num_nodes = tree_token_ids.shape
    device = tree_token_ids.device
    for name, value in (("target_argmax", target_argmax), ("tree_token_ids", tree_token_ids),
                        ("parents", parents), ("node_valid", node_valid)):
        if value.device != device:
            raise ValueError(f"{name} is on {value.device}, tree_token_ids on {device}")
        if value.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension, got strides {value.stride()}")
    accepted = torch.empty(batch_size, num_nodes, dtype=torch.int64, device=device)
    output = torch.empty(batch_size, num_nodes, dtype=torch.int64, device=device)
    num_accepted = torch.empty(batch_size, dtype=torch.int64, device=device)
    bonus = torch.empty(batch_size, dtype=torch.int64, device=device)
    if batch_size > 0:
        valid = node_valid.view(torch.uint8)  # same storage; both Triton backends load bytes
        _greedy_accept_kernel[(batch_size,)](
            target_argmax, tree_token_ids, parents, valid, accepted, output, num_accepted, bonus, num_nodes,
            target_argmax.stride(0), tree_token_ids.stride(0), parents.stride(0), valid.stride(0),
            accepted.stride(0), output.stride(0),
            BLOCK_N=triton.next_power_of_2(num_nodes), num_warps=1,
        )
    return GreedyAcceptance(accepted, num_accepted, output, bonus)


def greedy_accept_ref(
    target_argmax: torch.Tensor,  # [B, N] integer
    tree_token_ids: torch.Tensor,  # [B, N] integer
    parents: torch.Tensor,  # [B, N] integer
    node_valid: torch.Tensor,  # [B, N] bool
) -> GreedyAcceptance:
    """verify_greedy itself, on one-hot logits whose argmax is `target_argmax`; its [B, D+1]
    results are padded to N. Runs on the CPU, returns tensors on tree_token_ids' device."""
    _check_inputs(target_argmax, tree_token_ids, parents, node_valid)
    batch_size, num_nodes = tree_token_ids.shape
    argmax = target_argmax.cpu().to(torch.int64)
    draft = node_valid.cpu().clone()
    draft[:, 0] = False
    draft_tokens = tree_token_ids.cpu()[draft]
    vocab_size = 1 + max(int(argmax.max()) if argmax.numel() else 0,
                         int(draft_tokens.max()) if draft_tokens.numel() else 0)
    logits = torch.zeros(batch_size, num_nodes, vocab_size)
    logits.scatter_(2, argmax.clamp(min=0)[:, :, None], 1.0)
    result = verify_greedy(tree_token_ids.cpu(), parents.cpu(), node_valid.cpu(), logits)
    width = result.accepted_nodes.shape[1]
    accepted = torch.full((batch_size, num_nodes), -1, dtype=torch.int64)
    output = torch.full((batch_size, num_nodes), -1, dtype=torch.int64)
    accepted[:, :width] = result.accepted_nodes
    output[:, :width] = result.output_token_ids
    device = tree_token_ids.device
    return GreedyAcceptance(accepted.to(device), result.num_accepted.to(device), output.to(device),
                            result.bonus_token_ids.to(device))


def _check_inputs(target_argmax, tree_token_ids, parents, node_valid) -> None:
    for name, value in (("target_argmax", target_argmax), ("tree_token_ids", tree_token_ids),
                        ("parents", parents)):
        if not isinstance(value, torch.Tensor) or value.dim() != 2 or value.dtype.is_floating_point \
                or value.dtype.is_complex or value.dtype == torch.bool:
            raise ValueError(f"{name} must be a 2-D integer tensor [B, N], got {describe(value)}")
    if not isinstance(node_valid, torch.Tensor) or node_valid.dtype != torch.bool:
        raise ValueError(f"node_valid must be a bool tensor [B, N], got {describe(node_valid)}")
    shapes = {tuple(t.shape) for t in (target_argmax, tree_token_ids, parents, node_valid)}
    if len(shapes) != 1 or tree_token_ids.shape[1] < 1:
        raise ValueError(f"target_argmax {tuple(target_argmax.shape)}, tree_token_ids {tuple(tree_token_ids.shape)}, "
                         f"parents {tuple(parents.shape)} and node_valid {tuple(node_valid.shape)} must share "
                         "one shape [B, N] with N >= 1")
