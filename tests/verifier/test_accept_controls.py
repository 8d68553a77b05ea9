"""Negative controls of the acceptance-law tests (the protocol: test_accept_distribution.py): each
runs the same machinery on a known bug whose bias is computed in closed form first, and the
chi-square test must flag it; a control too weak to be detected fails its non-centrality check."""

import numpy as np
import pytest
import torch

from spectandem.sampling import logits_to_probs
from tests.verifier.accept_law import (ALPHA, MIN_NONCENTRALITY, VOCAB, _chain_rejection_round, _chisquare_pvalue,
                                       _exact_first_token, _exact_first_token_shared_coin, _first_token_counts,
                                       _generate, _multi_candidate_round, _noncentrality)
from spectandem import accept

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- negative controls


def _single_draft_first_tokens(drawn: torch.Tensor, declared: torch.Tensor, target: torch.Tensor, seed: int):
    """First tokens of one round with one draft; every row of each table is the same distribution."""
    tables = [row.expand(VOCAB, VOCAB).contiguous() for row in (target, drawn, declared)]
    tokens, _ = _generate(_chain_rejection_round(1, *tables), num_tokens=1, seed=seed)
    return _first_token_counts(tokens)


def _assert_control_is_flagged(counts: np.ndarray, target: np.ndarray, biased: np.ndarray) -> None:
    assert _noncentrality(biased, target) > MIN_NONCENTRALITY, "the control's bias is too small to detect"
    assert _chisquare_pvalue(counts, target) < ALPHA
    assert _chisquare_pvalue(counts, biased) > ALPHA  # and the bias is the one predicted


def test_control_stale_draft_probs_is_flagged() -> None:
    target = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0, 0.0], dtype=torch.float64)
    q_new = torch.tensor([0.1, 0.2, 0.3, 0.4, 0.0, 0.0], dtype=torch.float64)  # what the drafter used
    q_old = target.clone()  # last round's q: every draft looks perfect, so output ~ q_new
    counts = _single_draft_first_tokens(q_new, q_old, target, seed=30)
    biased = _exact_first_token(target.numpy(), q_new.numpy(), q_old.numpy(), 1)
    np.testing.assert_allclose(biased, q_new.numpy(), atol=1e-12)
    _assert_control_is_flagged(counts, target.numpy(), biased)


def test_control_residual_from_target_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    target = torch.tensor([0.7, 0.1, 0.1, 0.1, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.0, 0.0], dtype=torch.float64)
    monkeypatch.setattr(accept, "_residual", lambda target_probs_row, draft_probs_row: target_probs_row)
    counts = _single_draft_first_tokens(q, q, target, seed=31)
    biased = _exact_first_token(target.numpy(), q.numpy(), q.numpy(), 1, residual=lambda p, q: p)
    np.testing.assert_allclose(biased, [0.52, 0.16, 0.16, 0.16, 0, 0], atol=1e-12)
    _assert_control_is_flagged(counts, target.numpy(), biased)


def test_control_temperature_on_one_side_is_flagged() -> None:
    temperature = 0.5
    target = logits_to_probs(torch.tensor([0.0, 1.0, 0.5, 0.0, -1.0, 0.2]), temperature)
    draft_logits = torch.tensor([2.0, 1.0, 0.0, 0.0, -1.0, 0.0])
    drawn = logits_to_probs(draft_logits, temperature)
    declared = logits_to_probs(draft_logits, 1.0)  # the bug: q computed without the temperature
    counts = _single_draft_first_tokens(drawn, declared, target, seed=32)
    biased = _exact_first_token(target.numpy(), drawn.numpy(), declared.numpy(), 1)
    _assert_control_is_flagged(counts, target.numpy(), biased)


def test_control_unnormalised_residual_between_siblings_is_flagged(monkeypatch: pytest.MonkeyPatch) -> None:
    # Why verify_rejection renormalises the residual before the next sibling's coin (SpecInfer):
    # comparing u with max(p - q, 0)(x) / q(x) unnormalised under-accepts later siblings.
    target = torch.tensor([0.6, 0.3, 0.1, 0.0, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.2, 0.0, 0.0, 0.4, 0.4, 0.0], dtype=torch.float64)
    monkeypatch.setattr(accept, "_renormalise", lambda residual, fallback: residual)
    tables = [row.expand(VOCAB, VOCAB).contiguous() for row in (target, q)]
    tokens, _ = _generate(_multi_candidate_round(3, 1, *tables), num_tokens=1, seed=33)
    biased = _exact_first_token(target.numpy(), q.numpy(), q.numpy(), 3, renormalise=False)
    _assert_control_is_flagged(_first_token_counts(tokens), target.numpy(), biased)


def test_each_sibling_needs_its_own_coin() -> None:
    # p and q chosen so that reusing the first sibling's coin is visibly biased: a rejected first
    # sibling means the coin was large, which then under-accepts the second.
    target = torch.tensor([0.13, 0.28, 0.22, 0.37, 0.0, 0.0], dtype=torch.float64)
    q = torch.tensor([0.19, 0.45, 0.0, 0.32, 0.04, 0.0], dtype=torch.float64)
    tables = [row.expand(VOCAB, VOCAB).contiguous() for row in (target, q)]
    own_coins, _ = _generate(_multi_candidate_round(2, 1, *tables), num_tokens=1, seed=34)
    assert _chisquare_pvalue(_first_token_counts(own_coins), target.numpy()) > ALPHA
    shared, _ = _generate(_multi_candidate_round(2, 1, *tables, shared_coin=True), num_tokens=1, seed=34)
    biased = _exact_first_token_shared_coin(target.numpy(), q.numpy(), 2)
    _assert_control_is_flagged(_first_token_counts(shared), target.numpy(), biased)
