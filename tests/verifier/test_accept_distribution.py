"""Losslessness of verify_rejection and verify_tree_sampling, by chi-square against the exact target.

Protocol (reliability.md section 3.3): every trial is one row of a batch, a request with its own
seed, so TRIALS trials are one vectorised call per round. The "model" is a first-order Markov
chain over a small vocabulary: TARGET_TABLE[prev] is the target's next-token distribution p after
token prev, DRAFT_TABLE[prev] the drafter's q. The exact law of the first two generated tokens is
then TARGET_TABLE[PROMPT_TOKEN, a] * TARGET_TABLE[a, b]. A round that emits a single token is
followed by another round, as a server would do, so the pair is always observed.

Each assertion has a false-failure probability of 1e-6 (chi-square with bins of expected count < 5
merged; binomial and normal bounds for acceptance counts). All uniforms come from spectandem.rng
with fixed seeds, so the suite is deterministic. The negative controls run the same machinery on a
known bug and must fail it; their bias is computed in closed form first, so an edit that weakens
a control is caught by its non-centrality check.
"""

import numpy as np
import pytest
import scipy.stats
import torch

from spectandem import rng
from spectandem.sampling import sample_from_probs
from tests.verifier.accept_law import (ALPHA, DRAFT_TABLE, PROMPT_LEN, PROMPT_TOKEN, TARGET_TABLE, TRIALS, VOCAB,
                                       _chain_rejection_round, _chisquare_pvalue, _column_uniforms,
                                       _exact_first_token, _exact_pair, _first_token_counts, _generate,
                                       _multi_candidate_round, _pair_counts, _top_k_tree_round)

pytestmark = pytest.mark.usefixtures("single_thread")


# --------------------------------------------------------------------------- losslessness


def test_machinery_rejects_a_wrong_law() -> None:
    # Plain target sampling passes; the same counts against another row fail.
    start = torch.zeros(TRIALS, dtype=torch.int64)
    u = _column_uniforms(torch.arange(TRIALS), start, 1, rng.STREAM_TARGET)[:, 0]
    tokens = sample_from_probs(TARGET_TABLE[start + PROMPT_TOKEN], u)
    counts = np.bincount(tokens.numpy(), minlength=VOCAB)
    assert _chisquare_pvalue(counts, TARGET_TABLE[PROMPT_TOKEN].numpy()) > ALPHA
    assert _chisquare_pvalue(counts, TARGET_TABLE[PROMPT_TOKEN + 1].numpy()) < ALPHA


def test_exact_law_of_the_correct_rule_is_the_target() -> None:
    p, q = TARGET_TABLE[PROMPT_TOKEN].numpy(), DRAFT_TABLE[PROMPT_TOKEN].numpy()
    for num_candidates in (1, 2, 3, 5):
        np.testing.assert_allclose(_exact_first_token(p, q, q, num_candidates), p, atol=1e-12)


@pytest.mark.parametrize("k", [1, 2, 3])
def test_rejection_chain_is_lossless(k: int) -> None:
    tokens, _ = _generate(_chain_rejection_round(k), num_tokens=2, seed=k)
    assert _chisquare_pvalue(_first_token_counts(tokens), TARGET_TABLE[PROMPT_TOKEN].numpy()) > ALPHA
    assert _chisquare_pvalue(_pair_counts(tokens), _exact_pair()) > ALPHA


def test_rejection_multi_candidate_is_lossless() -> None:
    tokens, first = _generate(_multi_candidate_round(3, 2), num_tokens=2, seed=10)
    assert _chisquare_pvalue(_first_token_counts(tokens), TARGET_TABLE[PROMPT_TOKEN].numpy()) > ALPHA
    assert _chisquare_pvalue(_pair_counts(tokens), _exact_pair()) > ALPHA
    # Later siblings do get accepted, so the multi-candidate path is exercised.
    assert bool((first.accepted_nodes[:, 1] == 3).any())


def test_tree_sampling_is_lossless() -> None:
    tokens, first = _generate(_top_k_tree_round(3, 2), num_tokens=2, seed=20)
    assert _chisquare_pvalue(_first_token_counts(tokens), TARGET_TABLE[PROMPT_TOKEN].numpy()) > ALPHA
    assert _chisquare_pvalue(_pair_counts(tokens), _exact_pair()) > ALPHA
    assert bool((first.num_accepted == 2).any()) and bool((first.num_accepted == 0).any())


def test_tree_sampling_equals_seeded_plain_decoding() -> None:
    # Stronger than a distribution test: with the same uniforms the tokens are identical.
    trials = 4000
    tokens, _ = _generate(_top_k_tree_round(3, 2), num_tokens=4, seed=21, trials=trials)
    seeds = 21 * 1_000_003 + torch.arange(trials)
    plain_uniforms = _column_uniforms(seeds, torch.full((trials,), PROMPT_LEN), 4, rng.STREAM_TARGET)
    previous = torch.full((trials,), PROMPT_TOKEN)
    for position in range(4):
        previous = sample_from_probs(TARGET_TABLE[previous], plain_uniforms[:, position])
        assert torch.equal(tokens[:, position], previous)


# --------------------------------------------------------------------------- acceptance rates


def test_single_draft_acceptance_rate() -> None:
    p, q = TARGET_TABLE[PROMPT_TOKEN], DRAFT_TABLE[PROMPT_TOKEN]
    rate = float(torch.minimum(p, q).sum())
    _, first = _generate(_chain_rejection_round(1), num_tokens=1, seed=40)
    accepted = int(first.num_accepted.sum())
    low, high = scipy.stats.binom.interval(1 - ALPHA, TRIALS, rate)
    assert low <= accepted <= high, (accepted, low, high, rate * TRIALS)


def test_chain_mean_tokens_per_round() -> None:
    k = 3
    p = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.1, 0.0], dtype=torch.float64)
    q = torch.tensor([0.3, 0.4, 0.0, 0.1, 0.1, 0.1], dtype=torch.float64)
    rate = float(torch.minimum(p, q).sum())  # 0.7 at every position
    target, draft = p.expand(VOCAB, VOCAB).contiguous(), q.expand(VOCAB, VOCAB).contiguous()
    _, first = _generate(_chain_rejection_round(k, target, draft), num_tokens=1, seed=41)
    tokens_per_round = (first.num_accepted + 1).to(torch.float64)
    # Tokens per round: t in 1..k with probability rate^(t-1) (1 - rate), k + 1 with rate^k.
    support = np.arange(1, k + 2)
    pmf = np.array([rate ** (t - 1) * (1 - rate) for t in support[:-1]] + [rate**k])
    mean = float((support * pmf).sum())
    assert mean == pytest.approx((1 - rate ** (k + 1)) / (1 - rate))
    std_error = float(np.sqrt(((support - mean) ** 2 * pmf).sum() / TRIALS))
    z = scipy.stats.norm.isf(ALPHA / 2)
    assert abs(float(tokens_per_round.mean()) - mean) <= z * std_error


# --------------------------------------------------------------------------- seeding


@pytest.mark.parametrize("make_round", [lambda: _multi_candidate_round(3, 2), lambda: _top_k_tree_round(3, 2),
                                        lambda: _chain_rejection_round(3)])
def test_rows_do_not_depend_on_the_batch(make_round) -> None:
    torch_state = torch.random.get_rng_state()
    run_round = make_round()
    seeds = torch.arange(64) * 7 + 5
    committed_len = torch.arange(64) % 9 + 3
    roots = torch.arange(64) % VOCAB
    batched, _ = run_round(seeds, committed_len, roots)
    order = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:40]
    subset, _ = run_round(seeds[order], committed_len[order], roots[order])
    width = subset.output_token_ids.shape[1]
    assert torch.equal(subset.output_token_ids, batched.output_token_ids[order, :width])
    assert torch.equal(subset.accepted_nodes, batched.accepted_nodes[order, :width])
    for row in (0, 17, 63):
        alone, _ = run_round(seeds[row : row + 1], committed_len[row : row + 1], roots[row : row + 1])
        assert alone.tokens(0) == batched.tokens(row)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
