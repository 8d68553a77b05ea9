"""The machinery of the acceptance-law tests (test_accept_distribution.py, test_accept_controls.py):
a Markov-chain "model", exact laws of the first generated tokens, chi-square statistics, rounds of
each acceptance rule and a generation loop; see test_accept_distribution.py for the protocol."""

from collections.abc import Callable

import numpy as np
import scipy.stats
import torch

from spectandem import rng
from spectandem.sampling import logits_to_probs, sample_from_probs
from spectandem.accept import VerifyResult, verify_rejection, verify_tree_sampling

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
