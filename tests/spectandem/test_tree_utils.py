"""spectandem.tree: ancestor masks and depths of draft trees, by hand and against a plain walk."""

import random

import torch

from spectandem.tree import ancestor_mask, ancestor_mask_loop, node_depths, node_depths_loop, tree_shape


def _walk_reference(parents: list[int], valid: list[bool]) -> tuple[list[list[bool]], list[int]]:
    """Per node: the set {itself} + its ancestors (only for valid nodes) and its depth."""
    n = len(parents)
    mask = [[i == j for j in range(n)] for i in range(n)]
    depth = [0] * n
    for i in range(n):
        if not valid[i]:
            continue
        p = parents[i]
        while p >= 0:
            mask[i][p] = True
            depth[i] += 1
            p = parents[p]
    return mask, depth


def test_hand_example() -> None:
    # root 0 -> {1, 2}; 1 -> 3; 3 -> 4
    parents = torch.tensor([[-1, 0, 0, 1, 3]])
    valid = torch.ones(1, 5, dtype=torch.bool)
    expected = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 1, 0, 1, 0],
        [1, 1, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(ancestor_mask(parents, valid)[0], expected)
    assert node_depths(parents, valid).tolist() == [[0, 1, 1, 2, 3]]


def test_docstring_example() -> None:
    parents = torch.tensor([[-1, 0, 0, 1]])
    valid = torch.ones(1, 4, dtype=torch.bool)
    assert ancestor_mask(parents, valid)[0, 3].tolist() == [True, True, False, True]


def test_padding_rows_see_only_themselves() -> None:
    # Row 0: a chain of 3 then two padding nodes (parent -1). Row 1: a full tree of 5.
    # Row 2: padding whose parent pointer is set but which is marked invalid must not inherit.
    parents = torch.tensor([[-1, 0, 1, -1, -1],
                            [-1, 0, 0, 2, 2],
                            [-1, 0, 1, 2, 3]])
    valid = torch.tensor([[1, 1, 1, 0, 0],
                          [1, 1, 1, 1, 1],
                          [1, 1, 0, 0, 0]], dtype=torch.bool)
    mask = ancestor_mask(parents, valid)
    eye = torch.eye(5, dtype=torch.bool)
    assert torch.equal(mask[0, 3], eye[3]) and torch.equal(mask[0, 4], eye[4])
    assert mask[0, 2].tolist() == [True, True, True, False, False]
    assert mask[1, 4].tolist() == [True, False, True, False, True]
    for i in (2, 3, 4):
        assert torch.equal(mask[2, i], eye[i]), i
    assert node_depths(parents, valid).tolist() == [[0, 1, 2, 0, 0], [0, 1, 1, 2, 2], [0, 1, 0, 0, 0]]


def test_root_only_tree() -> None:
    parents = torch.tensor([[-1], [-1]])
    valid = torch.ones(2, 1, dtype=torch.bool)
    assert ancestor_mask(parents, valid).tolist() == [[[True]], [[True]]]
    assert node_depths(parents, valid).tolist() == [[0], [0]]


def _random_tree(rng: random.Random, n: int) -> tuple[list[int], list[bool]]:
    size = rng.randint(1, n)
    parents = [-1] + [rng.randrange(i) for i in range(1, size)] + [-1] * (n - size)
    valid = [True] * size + [False] * (n - size)
    return parents, valid


def test_batch_equals_rows_and_reference() -> None:
    rng = random.Random(0)
    n = 9
    trees = [_random_tree(rng, n) for _ in range(16)]
    parents = torch.tensor([p for p, _ in trees])
    valid = torch.tensor([v for _, v in trees])
    mask = ancestor_mask(parents, valid)
    depth = node_depths(parents, valid)
    assert mask.shape == (16, n, n) and mask.dtype == torch.bool
    assert depth.shape == (16, n) and depth.dtype == torch.int64
    for b, (p, v) in enumerate(trees):
        ref_mask, ref_depth = _walk_reference(p, v)
        assert mask[b].tolist() == ref_mask, b
        assert depth[b].tolist() == ref_depth, b
        assert torch.equal(ancestor_mask(parents[b: b + 1], valid[b: b + 1])[0], mask[b])
        assert torch.equal(node_depths(parents[b: b + 1], valid[b: b + 1])[0], depth[b])
        # depth = number of ancestors = row sum - 1 (the mask's self entry), for valid nodes
        assert torch.equal((mask[b].sum(-1) - 1)[valid[b]], depth[b][valid[b]])


def test_host_pass_equals_the_device_loop() -> None:
    """tree_shape (numpy, what host tensors take) against the torch loop (what device tensors
    take), run here on CPU tensors: random trees with padding anywhere, full chains (its shortcut),
    chains ending in padding, one node."""
    g = torch.Generator().manual_seed(0)
    for trial in range(300):
        b, n = int(torch.randint(1, 6, (1,), generator=g)), int(torch.randint(1, 20, (1,), generator=g))
        parents = torch.full((b, n), -1, dtype=torch.long)
        for j in range(1, n):
            parents[:, j] = torch.randint(-1, j, (b,), generator=g)
        if trial % 3 == 0:
            parents = torch.arange(-1, n - 1).expand(b, n).clone()
        valid = torch.rand(b, n, generator=g) > (0.25 if trial % 2 else 0.0)
        if trial % 6 == 3:
            valid = torch.arange(n).expand(b, n) < torch.randint(1, n + 1, (b, 1), generator=g)
        depth, mask = tree_shape(parents, valid)
        assert torch.equal(depth, node_depths_loop(parents, valid)), (parents, valid)
        assert torch.equal(mask, ancestor_mask_loop(parents, valid)), (parents, valid)
