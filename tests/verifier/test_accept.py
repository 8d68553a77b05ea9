"""spectandem.accept on hand-built trees with peaked logits, where the answer is known."""

import pytest
import torch

from spectandem import rng
from spectandem.sampling import logits_to_probs
from spectandem.accept import VerifyResult, verify_greedy, verify_rejection, verify_tree_sampling

P = -1  # padding in accepted_nodes / output_token_ids
VOCAB = 20


def _tree(parents: list[list[int]], tokens: list[list[int]], valid: list[list[bool]] | None = None):
    parents_t = torch.tensor(parents, dtype=torch.int64)
    tokens_t = torch.tensor(tokens, dtype=torch.int64)
    valid_t = torch.ones_like(parents_t, dtype=torch.bool) if valid is None else torch.tensor(valid)
    return tokens_t, parents_t, valid_t


def _peaked_logits(batch: int, num_nodes: int, argmax: dict[tuple[int, int], int], default: int = 0):
    """[B, N, VOCAB] logits: 10 at argmax[(b, node)] (else at `default`), 0 elsewhere."""
    logits = torch.zeros(batch, num_nodes, VOCAB)
    logits[:, :, default] = 10.0
    for (b, node), token in argmax.items():
        logits[b, node, default] = 0.0
        logits[b, node, token] = 10.0
    return logits


def _uniforms(batch: int, width: int, stream: int = rng.STREAM_TARGET, seed: int = 0) -> torch.Tensor:
    positions = torch.arange(width).expand(batch, width)
    seeds = (torch.arange(batch) + seed).unsqueeze(1).expand(batch, width)
    return rng.uniforms(seeds, positions, stream)


def _assert_result(result: VerifyResult, accepted_nodes, num_accepted, output_token_ids) -> None:
    assert result.accepted_nodes.tolist() == accepted_nodes
    assert result.num_accepted.tolist() == num_accepted
    assert result.output_token_ids.tolist() == output_token_ids
    expected_bonus = [row[n] for row, n in zip(output_token_ids, num_accepted)]
    assert result.bonus_token_ids.tolist() == expected_bonus
    fields = (result.accepted_nodes, result.num_accepted, result.output_token_ids, result.bonus_token_ids)
    assert all(field.dtype == torch.int64 for field in fields)


CHAIN = _tree([[-1, 0, 1, 2]], [[9, 1, 2, 3]])  # root token 9, drafts 1 -> 2 -> 3


def test_full_chain_accepted_plus_bonus() -> None:
    logits = _peaked_logits(1, 4, {(0, 0): 1, (0, 1): 2, (0, 2): 3, (0, 3): 4})
    result = verify_greedy(*CHAIN, logits)
    _assert_result(result, [[0, 1, 2, 3]], [3], [[1, 2, 3, 4]])
    assert result.tokens(0) == [1, 2, 3, 4]


def test_early_mismatch_emits_the_correction() -> None:
    logits = _peaked_logits(1, 4, {(0, 0): 1, (0, 1): 5, (0, 2): 3, (0, 3): 4})
    result = verify_greedy(*CHAIN, logits)
    _assert_result(result, [[0, 1, P, P]], [1], [[1, 5, P, P]])
    assert result.tokens(0) == [1, 5]


def test_first_draft_rejected() -> None:
    logits = _peaked_logits(1, 4, {(0, 0): 7, (0, 1): 2, (0, 2): 3})
    _assert_result(verify_greedy(*CHAIN, logits), [[0, P, P, P]], [0], [[7, P, P, P]])


def test_root_only_gives_the_bonus_only() -> None:
    tree = _tree([[-1], [-1]], [[4], [6]])
    result = verify_greedy(*tree, _peaked_logits(2, 1, {(0, 0): 5, (1, 0): 11}))
    _assert_result(result, [[0], [0]], [0, 0], [[5], [11]])
    assert result.tokens(1) == [11]


def test_second_sibling_matches() -> None:
    # root -> {1: token 4, 2: token 7, 3: token 9}; node 4 (token 6) under node 2.
    tree = _tree([[-1, 0, 0, 0, 2]], [[0, 4, 7, 9, 6]])
    logits = _peaked_logits(1, 5, {(0, 0): 7, (0, 2): 6, (0, 4): 13})
    _assert_result(verify_greedy(*tree, logits), [[0, 2, 4]], [2], [[7, 6, 13]])


def test_equal_sibling_tokens_take_the_first_in_node_order() -> None:
    tree = _tree([[-1, 0, 0, 2]], [[0, 5, 5, 8]])
    logits = _peaked_logits(1, 4, {(0, 0): 5, (0, 1): 3, (0, 2): 8})
    _assert_result(verify_greedy(*tree, logits), [[0, 1, P]], [1], [[5, 3, P]])


def test_ragged_batch_with_padding() -> None:
    # Request 1 has one draft; its padding nodes carry tokens equal to the target argmax and
    # must still never be accepted.
    tree = _tree(
        [[-1, 0, 1, 2], [-1, 0, 1, -1]],
        [[0, 1, 2, 3], [0, 3, 4, -1]],
        [[True, True, True, True], [True, True, False, False]],
    )
    argmax = {(0, 0): 1, (0, 1): 2, (0, 2): 3, (0, 3): 6, (1, 0): 3, (1, 1): 4}
    logits = _peaked_logits(2, 4, argmax)
    result = verify_greedy(*tree, logits)
    _assert_result(result, [[0, 1, 2, 3], [0, 1, P, P]], [3, 1], [[1, 2, 3, 6], [3, 4, P, P]])


def test_output_width_is_the_deepest_valid_node() -> None:
    tree = _tree([[-1, 0, 1, 2]], [[0, 1, 2, 3]], [[True, True, False, False]])
    result = verify_greedy(*tree, _peaked_logits(1, 4, {(0, 0): 1, (0, 1): 2}))
    _assert_result(result, [[0, 1]], [1], [[1, 2]])


def _next_to_parents(next_token: list[int], next_sibling: list[int]) -> list[int]:
    """SGLang's first-child / next-sibling lists -> parent indices."""
    parents = [-1] * len(next_token)
    for node, first_child in enumerate(next_token):
        child = first_child
        while child != -1:
            parents[child] = node
            child = next_sibling[child]
    return parents


def _sglang_golden_tree():
    candidates = [[0, 1, 2, 3, 4, 5], [7, 8, 9, 10, 11, 12]]
    next_token = [[1, 2, -1, 4, 5, -1], [4, 2, 3, -1, 5, -1]]
    next_sibling = [[-1, 3, -1, -1, -1, -1], [-1, -1, -1, -1, 1, -1]]
    parents = [_next_to_parents(t, s) for t, s in zip(next_token, next_sibling)]
    assert parents == [[-1, 0, 1, 0, 3, 4], [-1, 0, 1, 2, 0, 4]]
    # The target's argmax after each node; every other node falls back to 18.
    logits = _peaked_logits(2, 6, {(0, 0): 3, (0, 3): 4, (0, 4): 5, (1, 0): 11, (1, 4): 12}, default=18)
    return _tree(parents, candidates), logits


SGLANG_ACCEPTED = [[0, 3, 4, 5], [0, 4, 5, P]]  # sgl-kernel: accept_index [[0,3,4,5],[6,10,11,-1]]
SGLANG_OUTPUT = [[3, 4, 5, 18], [11, 12, 18, P]]


def test_sglang_golden_tree() -> None:
    tree, logits = _sglang_golden_tree()
    _assert_result(verify_greedy(*tree, logits), SGLANG_ACCEPTED, [3, 2], SGLANG_OUTPUT)


def test_tree_sampling_with_a_near_deterministic_target_reproduces_greedy() -> None:
    tree, logits = _sglang_golden_tree()
    target_probs = logits_to_probs(logits, temperature=0.01)
    for seed in range(5):
        uniforms = _uniforms(2, 6, seed=seed)  # D + 1 = 4 columns are used, the rest ignored
        result = verify_tree_sampling(*tree, target_probs, uniforms)
        _assert_result(result, SGLANG_ACCEPTED, [3, 2], SGLANG_OUTPUT)


def test_rejection_with_one_hot_targets_reproduces_greedy() -> None:
    tree, logits = _sglang_golden_tree()
    target_probs = logits_to_probs(logits, temperature=0.01)
    # Every draft node claims q = uniform over the vocabulary: p(x)/q(x) is VOCAB or 0.
    draft_probs = torch.full((2, 6, VOCAB), 1.0 / VOCAB, dtype=torch.float64)
    accept = torch.stack([_uniforms(2, 4, rng.STREAM_ACCEPT, seed) for seed in (0, 9)], dim=2)
    result = verify_rejection(*tree, target_probs, draft_probs, accept, _uniforms(2, 4))
    _assert_result(result, SGLANG_ACCEPTED, [3, 2], SGLANG_OUTPUT)


def _one_draft_case(target_row: list[float], draft_row: list[float], draft_token: int):
    tree = _tree([[-1, 0]], [[0, draft_token]])
    target_probs = torch.tensor([[target_row, target_row]], dtype=torch.float64)
    draft_probs = torch.tensor([[draft_row, draft_row]], dtype=torch.float64)
    return tree, target_probs, draft_probs


def test_rejection_coin_compares_u_with_p_over_q() -> None:
    tree, target_probs, draft_probs = _one_draft_case([0.2, 0.3, 0.5], [0.1, 0.6, 0.3], draft_token=1)
    sample_uniforms = torch.tensor([[0.99, 0.01]], dtype=torch.float64)  # correction -> last residual id
    # p/q = 0.5 at token 1: coin 0.5 accepts (u * q <= p), 0.5 + 1e-9 rejects.
    coins = torch.tensor([[[0.5], [0.5]]], dtype=torch.float64)
    accepted = verify_rejection(*tree, target_probs, draft_probs, coins, sample_uniforms)
    _assert_result(accepted, [[0, 1]], [1], [[1, 0]])
    coins = torch.tensor([[[0.5 + 1e-9], [0.5]]], dtype=torch.float64)
    rejected = verify_rejection(*tree, target_probs, draft_probs, coins, sample_uniforms)
    # Residual max(p - q, 0) = [0.1, 0, 0.2]: the correction is never the rejected token.
    _assert_result(rejected, [[0, P]], [0], [[2, P]])


def test_rejection_never_accepts_a_token_the_draft_gave_zero_probability() -> None:
    tree, target_probs, draft_probs = _one_draft_case([0.0, 1.0, 0.0], [0.5, 0.0, 0.5], draft_token=1)
    tiny = torch.full((1, 2, 1), 2.0**-53, dtype=torch.float64)
    half = torch.full((1, 2), 0.5, dtype=torch.float64)
    result = verify_rejection(*tree, target_probs, draft_probs, tiny, half)
    # Rejected, then recovered from the residual, which is p itself here.
    _assert_result(result, [[0, P]], [0], [[1, P]])


def test_rejection_zero_mass_residual_falls_back_to_the_target_row() -> None:
    # p <= q everywhere through a rounding-size difference: the residual is all zeros.
    tree, target_probs, draft_probs = _one_draft_case([0.5, 0.5 - 1e-9, 0.0], [0.5, 0.5, 0.0], 1)
    coin = torch.full((1, 2, 1), 1.0 - 1e-10, dtype=torch.float64)  # > p/q = 1 - 2e-9: rejected
    for u, expected in ((0.25, 0), (0.75, 1)):
        sample_uniforms = torch.full((1, 2), u, dtype=torch.float64)
        result = verify_rejection(*tree, target_probs, draft_probs, coin, sample_uniforms)
        _assert_result(result, [[0, P]], [0], [[expected, P]])


def test_rejection_leaf_bonus_is_drawn_from_the_target() -> None:
    tree = _tree([[-1, 0]], [[0, 2]])
    target_probs = torch.tensor([[[0.0, 0.0, 1.0], [0.6, 0.4, 0.0]]], dtype=torch.float64)
    draft_probs = torch.tensor([[[0.0, 0.0, 1.0], [0.0, 0.0, 0.0]]], dtype=torch.float64)  # leaf row unused
    coins = torch.full((1, 2, 1), 0.9, dtype=torch.float64)
    for u, bonus in ((0.5, 0), (0.7, 1)):
        sample_uniforms = torch.tensor([[0.1, u]], dtype=torch.float64)
        result = verify_rejection(*tree, target_probs, draft_probs, coins, sample_uniforms)
        _assert_result(result, [[0, 1]], [1], [[2, bonus]])


# --------------------------------------------------------------------------- invalid input


def _valid_inputs():
    tokens, parents, valid = _tree([[-1, 0, 1], [-1, 0, 0]], [[0, 1, 2], [0, 3, 4]])
    target_probs = torch.full((2, 3, 5), 0.2, dtype=torch.float64)
    return dict(
        tree_token_ids=tokens, parents=parents, node_valid=valid, target_probs=target_probs,
        draft_probs=target_probs.clone(), accept_uniforms=torch.full((2, 3, 2), 0.5, dtype=torch.float64),
        sample_uniforms=torch.full((2, 3), 0.5, dtype=torch.float64),
    )


def test_valid_inputs_are_accepted() -> None:
    verify_rejection(**_valid_inputs())


def _broken(**changes):
    inputs = _valid_inputs()
    inputs.update(changes)
    return inputs


BROKEN_INPUTS = {
    "parents shape": _broken(parents=torch.tensor([[-1, 0], [-1, 0]])),
    "token dtype": _broken(tree_token_ids=torch.zeros(2, 3)),
    "node_valid dtype": _broken(node_valid=torch.ones(2, 3, dtype=torch.int64)),
    "root invalid": _broken(node_valid=torch.tensor([[False, True, True], [True, True, True]])),
    "root parent": _broken(parents=torch.tensor([[0, 0, 1], [-1, 0, 0]])),
    "parent after child": _broken(parents=torch.tensor([[-1, 2, 0], [-1, 0, 0]])),
    "parent is itself": _broken(parents=torch.tensor([[-1, 0, 2], [-1, 0, 0]])),
    "parent is padding": _broken(node_valid=torch.tensor([[True, False, True], [True, True, True]])),
    "token out of vocab": _broken(tree_token_ids=torch.tensor([[0, 1, 5], [0, 3, 4]])),
    "negative token": _broken(tree_token_ids=torch.tensor([[0, 1, 2], [0, -1, 4]])),
    "target B": _broken(target_probs=torch.full((1, 3, 5), 0.2, dtype=torch.float64)),
    "draft V": _broken(draft_probs=torch.full((2, 3, 4), 0.25, dtype=torch.float64)),
    "target not normalised": _broken(target_probs=torch.full((2, 3, 5), 0.3, dtype=torch.float64)),
    "draft not normalised": _broken(draft_probs=torch.zeros(2, 3, 5, dtype=torch.float64)),
    "accept float32": _broken(accept_uniforms=torch.full((2, 3, 2), 0.5)),
    "accept too few siblings": _broken(accept_uniforms=torch.full((2, 3, 1), 0.5, dtype=torch.float64)),
    "sample too few depths": _broken(sample_uniforms=torch.full((2, 2), 0.5, dtype=torch.float64)),
    "sample zero": _broken(sample_uniforms=torch.tensor([[0.5, 0.0, 0.5], [0.5] * 3], dtype=torch.float64)),
    "accept one": _broken(accept_uniforms=torch.ones(2, 3, 2, dtype=torch.float64)),
}


@pytest.mark.parametrize("name", list(BROKEN_INPUTS))
def test_invalid_input_raises(name: str) -> None:
    with pytest.raises(ValueError):
        verify_rejection(**BROKEN_INPUTS[name])


def test_greedy_and_tree_sampling_validate_too() -> None:
    tokens, parents, valid = _tree([[-1, 0]], [[0, 7]])
    with pytest.raises(ValueError, match="target_logits"):
        verify_greedy(tokens, parents, valid, torch.zeros(1, 3, 5))
    with pytest.raises(ValueError, match="vocabulary"):
        verify_greedy(tokens, parents, valid, torch.zeros(1, 2, 5))
    with pytest.raises(ValueError, match="uniforms"):
        verify_tree_sampling(tokens, parents, valid, torch.full((1, 2, 8), 0.125, dtype=torch.float64),
                             torch.full((1, 1), 0.5, dtype=torch.float64))


def test_padding_may_hold_anything() -> None:
    # Invalid nodes: token -1, parent out of range; only valid nodes are checked.
    tokens, parents, valid = _tree([[-1, 0, 99]], [[0, 1, -1]], [[True, True, False]])
    result = verify_greedy(tokens, parents, valid, _peaked_logits(1, 3, {(0, 0): 1, (0, 1): 4}))
    _assert_result(result, [[0, 1]], [1], [[1, 4]])


@pytest.mark.parametrize("idx", [[0, 1, 2], [2, 0]])
def test_engine_greedy_walk_on_the_device_path_equals_verify_greedy(idx) -> None:
    """VerifierEngine._greedy_on_device (what greedy rows on a GPU take: one copy of the tree in,
    one of the packed results out; run here on CPU tensors) against verify_greedy, over all rows
    and over a reordered subset."""
    from verifier.engine import VerifierEngine

    tokens, parents, valid = _tree([[-1, 0, 1, 2], [-1, 0, 0, 1], [-1, 0, 1, -1]],
                                   [[0, 1, 2, 3], [0, 5, 4, 7], [0, 3, 4, -1]],
                                   [[True] * 4, [True] * 4, [True, True, False, False]])
    argmax = {(0, 0): 1, (0, 1): 2, (0, 2): 9, (1, 0): 4, (1, 2): 7, (1, 3): 11, (2, 0): 3, (2, 1): 4}
    logits = _peaked_logits(3, 4, argmax)
    sel = torch.tensor(idx)
    every = idx == list(range(3))
    feats = torch.randn(3, 4, 6) if every else None      # gathered on the device only for every row
    got, picked = VerifierEngine._greedy_on_device(logits, idx, (tokens[sel], parents[sel], valid[sel]), feats)
    want = verify_greedy(tokens[sel], parents[sel], valid[sel], logits[sel])
    w = want.accepted_nodes.shape[1]
    if every:   # row b's first num_accepted + 1 entries: its accepted path's features, in order
        for b in range(3):
            path = want.accepted_nodes[b, : int(want.num_accepted[b]) + 1]
            assert torch.equal(picked[b, : len(path)], feats[b, path])
    else:
        assert picked is None
    assert torch.equal(got.accepted_nodes[:, :w], want.accepted_nodes) and bool((got.accepted_nodes[:, w:] == P).all())
    assert torch.equal(got.output_token_ids[:, :w], want.output_token_ids)
    assert torch.equal(got.num_accepted, want.num_accepted) and torch.equal(got.bonus_token_ids, want.bonus_token_ids)
