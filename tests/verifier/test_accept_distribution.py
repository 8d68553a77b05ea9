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

from collections.abc import Callable

import numpy as np
import pytest
import scipy.stats
import torch

from spectandem import rng
from spectandem.sampling import logits_to_probs, sample_from_probs
from verifier import accept
from verifier.accept import VerifyResult, verify_rejection, verify_tree_sampling

ALPHA = 1e-6
TRIALS = 20_000
VOCAB = 6
PROMPT_TOKEN = 0
PROMPT_LEN = 11  # committed_len of the first round
# Smallest chi-square non-centrality a control's bias may have at TRIALS: with <= 5 degrees of
# freedom, a bias that large passes the 1e-6 test with probability below 1e-10 (scipy ncx2).
MIN_NONCENTRALITY = 150.0


def _markov_table(seed: int, scale: float, top_k: int) -> torch.Tensor:
    """[VOCAB, VOCAB] float64: row prev is a next-token distribution over its top_k tokens only."""
    logits = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return logits_to_probs(logits * scale, temperature=1.0, top_k=top_k)


TARGET_TABLE = _markov_table(1, scale=1.5, top_k=4)  # two impossible tokens per row
DRAFT_TABLE = _markov_table(2, scale=1.5, top_k=5)  # q(x) = 0 where p(x) may be > 0, and vice versa


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    # The tensors here are small but above torch's parallel grain size; with a busy neighbour
    # process on a 2-core machine, OpenMP workers waiting for a core made this file 8x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- statistics


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of counts to probs; bins with expected count < 5 are pooled."""
    probs = probs / probs.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0  # an impossible outcome was observed
    counts, expected = counts[probs > 0].astype(np.float64), counts.sum() * probs[probs > 0]
    order = np.argsort(expected)
    counts, expected = counts[order], expected[order]
    # Pool the smallest bins into the first bin until it reaches an expected count of 5.
    while expected.shape[0] > 2 and expected[0] < 5:
        counts = np.concatenate([[counts[0] + counts[1]], counts[2:]])
        expected = np.concatenate([[expected[0] + expected[1]], expected[2:]])
        order = np.argsort(expected)
        counts, expected = counts[order], expected[order]
    assert expected.shape[0] >= 2 and expected.min() >= 5, "too few trials for a chi-square test"
    return float(scipy.stats.chisquare(counts, expected).pvalue)


def _noncentrality(biased: np.ndarray, probs: np.ndarray, trials: int = TRIALS) -> float:
    support = probs > 0
    if (biased[~support] > 0).any():
        return np.inf
    return float(trials * ((biased[support] - probs[support]) ** 2 / probs[support]).sum())


def _exact_first_token(
    target_row: np.ndarray,  # [V] p
    drawn_row: np.ndarray,  # [V] the q the drafts really came from
    declared_row: np.ndarray,  # [V] the q handed to the verifier
    num_candidates: int,
    residual: Callable[[np.ndarray, np.ndarray], np.ndarray] = lambda p, q: np.maximum(p - q, 0.0),
    renormalise: bool = True,
) -> np.ndarray:
    """Closed-form law of the first output token of one node with i.i.d. candidates.

    The residual after a rejection does not depend on which token was rejected, so
    law = sum_j P(reach j) * q(x) a_j(x) + P(all rejected) * norm(final residual).
    """
    law = np.zeros_like(target_row)
    reach, current = 1.0, target_row.copy()
    for _ in range(num_candidates):
        ratio = np.divide(current, declared_row, out=np.zeros_like(current), where=declared_row > 0)
        accepted = drawn_row * np.minimum(ratio, 1.0)
        law += reach * accepted
        reach *= 1.0 - accepted.sum()
        current = residual(current, declared_row)
        if renormalise and current.sum() > 0:
            current = current / current.sum()
    if reach > 0:  # reach == 0 with an all-zero residual when every candidate is surely accepted
        law += reach * current / current.sum()
    return law


def _exact_first_token_shared_coin(
    target_row: np.ndarray,  # [V] p
    draft_row: np.ndarray,  # [V] q
    num_candidates: int,
) -> np.ndarray:
    """Closed-form first-token law when one coin u decides every sibling (the correct rule otherwise).

    Given u the stages are independent, and the law is piecewise constant in u between the
    acceptance ratios, so integrating over u is a finite sum.
    """
    ratios, current = [], target_row.copy()
    for _ in range(num_candidates):
        ratios.append(np.divide(current, draft_row, out=np.zeros_like(current), where=draft_row > 0))
        current = np.maximum(current - draft_row, 0.0)
        current = current / current.sum()
    breaks = np.unique(np.clip(np.concatenate([[0.0, 1.0], *ratios]), 0.0, 1.0))
    law = np.zeros_like(target_row)
    for low, high in zip(breaks[:-1], breaks[1:]):
        u, reach = (low + high) / 2, 1.0
        for ratio in ratios:
            accepted = draft_row * (u <= ratio)
            law += (high - low) * reach * accepted
            reach *= 1.0 - accepted.sum()
        law += (high - low) * reach * current
    return law


def _first_token_counts(tokens: torch.Tensor) -> np.ndarray:
    return np.bincount(tokens[:, 0].numpy(), minlength=VOCAB)


def _pair_counts(tokens: torch.Tensor) -> np.ndarray:
    return np.bincount((tokens[:, 0] * VOCAB + tokens[:, 1]).numpy(), minlength=VOCAB * VOCAB)


def _exact_pair(table: torch.Tensor = TARGET_TABLE) -> np.ndarray:
    first = table[PROMPT_TOKEN]
    return (first.unsqueeze(1) * table).reshape(-1).numpy()


# --------------------------------------------------------------------------- rounds


def _column_uniforms(seeds: torch.Tensor, committed_len: torch.Tensor, width: int, stream: int,
                     index: int = 0) -> torch.Tensor:
    """[R, width] float64: column d is the draw for position committed_len + d."""
    positions = committed_len.unsqueeze(1) + torch.arange(width)
    return rng.uniforms(seeds.unsqueeze(1).expand_as(positions), positions, stream, index)


Round = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], tuple[VerifyResult, torch.Tensor]]


def _chain_rejection_round(k: int, target_table: torch.Tensor = TARGET_TABLE,
                           drawn_table: torch.Tensor = DRAFT_TABLE,
                           declared_table: torch.Tensor | None = None) -> Round:
    """k drafts in a chain, draft d drawn from drawn_table[previous token]; declared q = declared_table."""
    declared_table = drawn_table if declared_table is None else declared_table

    def run(seeds: torch.Tensor, committed_len: torch.Tensor, roots: torch.Tensor):
        tokens = [roots]
        for depth in range(k):
            u = _column_uniforms(seeds, committed_len + depth, 1, rng.STREAM_DRAFT)[:, 0]
            tokens.append(sample_from_probs(drawn_table[tokens[-1]], u))
        tree_tokens = torch.stack(tokens, dim=1)  # [R, k+1]
        parents = (torch.arange(k + 1) - 1).expand_as(tree_tokens)
        result = verify_rejection(
            tree_tokens, parents, torch.ones_like(tree_tokens, dtype=torch.bool),
            target_table[tree_tokens], declared_table[tree_tokens],
            _column_uniforms(seeds, committed_len, k + 1, rng.STREAM_ACCEPT).unsqueeze(2),
            _column_uniforms(seeds, committed_len, k + 1, rng.STREAM_TARGET),
        )
        return result, tree_tokens

    return run


def _two_level_tree(roots: torch.Tensor, first: torch.Tensor, second: torch.Tensor):
    """Root -> K children (first [R, K]) -> M children each (second [R, K, M]).

    Node layout for K=2, M=2: [root, c0, c1, c0.0, c0.1, c1.0, c1.1], parents [-1, 0, 0, 1, 1, 2, 2].
    """
    num_first, num_second = second.shape[1], second.shape[2]
    tokens = torch.cat([roots.unsqueeze(1), first, second.flatten(1)], dim=1)  # [R, 1 + K + K*M]
    parents = torch.cat([torch.tensor([-1]), torch.zeros(num_first, dtype=torch.int64),
                         1 + torch.arange(num_first).repeat_interleave(num_second)])
    return tokens, parents.expand_as(tokens), torch.ones_like(tokens, dtype=torch.bool)


def _multi_candidate_round(num_first: int, num_second: int, target_table: torch.Tensor = TARGET_TABLE,
                           draft_table: torch.Tensor = DRAFT_TABLE, shared_coin: bool = False) -> Round:
    """i.i.d. sampled candidates: num_first at the root, num_second under each of them.

    shared_coin is a caller bug for the negative control: one acceptance coin for all siblings.
    """

    def run(seeds: torch.Tensor, committed_len: torch.Tensor, roots: torch.Tensor):
        def draw(draft_rows: torch.Tensor, position: torch.Tensor, index: int) -> torch.Tensor:
            u = _column_uniforms(seeds, position, 1, rng.STREAM_DRAFT, index)[:, 0]
            return sample_from_probs(draft_rows, u)

        first = torch.stack([draw(draft_table[roots], committed_len, j) for j in range(num_first)], dim=1)
        second = torch.stack([
            torch.stack([draw(draft_table[first[:, j]], committed_len + 1, j * num_second + m)
                         for m in range(num_second)], dim=1)
            for j in range(num_first)], dim=1)  # [R, K, M]
        tokens, parents, valid = _two_level_tree(roots, first, second)
        coin_index = [0 if shared_coin else j for j in range(num_first)]
        accept_uniforms = torch.stack([_column_uniforms(seeds, committed_len, 3, rng.STREAM_ACCEPT, index)
                                       for index in coin_index], dim=2)  # [R, 3, K]
        sample_uniforms = _column_uniforms(seeds, committed_len, 3, rng.STREAM_TARGET)
        result = verify_rejection(tokens, parents, valid, target_table[tokens], draft_table[tokens],
                                  accept_uniforms, sample_uniforms)
        return result, tokens

    return run


def _top_k_tree_round(num_first: int, num_second: int) -> Round:
    """A deterministic tree: the drafter's top num_first tokens, then top num_second under each."""

    def run(seeds: torch.Tensor, committed_len: torch.Tensor, roots: torch.Tensor):
        first = DRAFT_TABLE[roots].topk(num_first, dim=-1).indices  # [R, K]
        second = DRAFT_TABLE[first].topk(num_second, dim=-1).indices  # [R, K, M]
        tokens, parents, valid = _two_level_tree(roots, first, second)
        result = verify_tree_sampling(tokens, parents, valid, TARGET_TABLE[tokens],
                                      _column_uniforms(seeds, committed_len, 3, rng.STREAM_TARGET))
        return result, tokens

    return run


def _generate(run_round: Round, num_tokens: int, seed: int, trials: int = TRIALS):
    """Rounds until every trial has num_tokens tokens: ([trials, num_tokens] tokens, first-round result)."""
    seeds = seed * 1_000_003 + torch.arange(trials)
    generated = torch.full((trials, num_tokens), -1, dtype=torch.int64)
    count = torch.zeros(trials, dtype=torch.int64)
    last = torch.full((trials,), PROMPT_TOKEN, dtype=torch.int64)
    first_result = None
    while bool((count < num_tokens).any()):
        rows = (count < num_tokens).nonzero().squeeze(1)
        result, _ = run_round(seeds[rows], PROMPT_LEN + count[rows], last[rows])
        first_result = result if first_result is None else first_result
        emitted = result.num_accepted + 1  # [R]
        for column in range(result.output_token_ids.shape[1]):
            writes = (column < emitted) & (count[rows] + column < num_tokens)
            generated[rows[writes], count[rows[writes]] + column] = result.output_token_ids[writes, column]
        last[rows] = result.output_token_ids[torch.arange(rows.numel()), emitted - 1]
        count[rows] += emitted
    assert bool((generated >= 0).all())
    return generated, first_result


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
