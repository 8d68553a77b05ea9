"""spectandem.sampling against an independent float64 numpy reference."""

import math

import numpy as np
import pytest
import scipy.stats
import torch

from spectandem import rng
from spectandem.sampling import greedy, logits_to_probs, sample_from_probs

ALPHA = 1e-6
SMALLEST_U = 2.0**-53  # the extremes rng can return
LARGEST_U = 1.0 - 2.0**-53


def _reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """One row, written independently: sort-based top-k, softmax, sort + cumsum nucleus."""
    scaled = logits.astype(np.float64) / temperature
    vocab_size = scaled.shape[0]
    if 0 < top_k < vocab_size:
        kth_largest = np.sort(scaled)[::-1][top_k - 1]
        scaled = np.where(scaled >= kth_largest, scaled, -np.inf)
    weights = np.exp(scaled - scaled.max())
    probs = weights / weights.sum()
    if top_p < 1.0:
        descending = np.sort(probs)[::-1]
        reached = np.cumsum(descending) >= top_p
        num_kept = int(np.argmax(reached)) + 1 if reached.any() else vocab_size
        probs = np.where(probs >= descending[num_kept - 1], probs, 0.0)
        probs = probs / probs.sum()
    return probs


def _chisquare_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs / probs.sum()
    assert counts[expected == 0].sum() == 0, "a zero-probability id was drawn"
    keep = expected > 0
    return scipy.stats.chisquare(counts[keep], expected[keep]).pvalue


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, 0, 1.0), (0.3, 0, 1.0), (2.5, 0, 1.0), (1.0, 1, 1.0), (0.7, 5, 1.0), (1.0, 99, 1.0),
     (1.0, 0, 0.5), (0.8, 0, 0.9), (1.3, 0, 0.99), (0.7, 20, 0.8), (1.0, 500, 0.95)],
)
def test_matches_reference(temperature: float, top_k: int, top_p: float) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 100, generator=generator, dtype=torch.float64) * 3
    probs = logits_to_probs(logits, temperature, top_k, top_p)
    assert probs.dtype == torch.float64 and probs.shape == logits.shape
    for row in range(logits.shape[0]):
        expected = _reference_probs(logits[row].numpy(), temperature, top_k, top_p)
        got = probs[row].numpy()
        np.testing.assert_array_equal(got > 0, expected > 0)
        np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-300)
    if top_k:
        assert int((probs > 0).sum(dim=-1).max()) <= top_k


def test_top_k_keeps_every_tie_at_the_kth_value() -> None:
    logits = torch.tensor([1.0, 3.0, 3.0, 2.0])
    kept = {k: (logits_to_probs(logits, 1.0, top_k=k) > 0).tolist() for k in (1, 2, 3)}
    assert kept[1] == kept[2] == [False, True, True, False]
    assert kept[3] == [False, True, True, True]
    assert logits_to_probs(logits, 1.0, top_k=1).tolist() == [0.0, 0.5, 0.5, 0.0]


def test_top_p_always_keeps_the_top_token_and_ties() -> None:
    logits = torch.tensor([0.0, 2.0, 1.0, -1.0])
    assert logits_to_probs(logits, 1.0, top_p=1e-9).tolist() == [0.0, 1.0, 0.0, 0.0]
    tied = torch.tensor([0.4, 0.2, 0.2, 0.2]).log()
    assert (logits_to_probs(tied, 1.0, top_p=0.3) > 0).tolist() == [True, False, False, False]
    # 0.4 + 0.2 reaches 0.5 at a tie: the nucleus keeps every token tied with its smallest member.
    assert bool((logits_to_probs(tied, 1.0, top_p=0.5) > 0).all())


def test_top_p_stops_when_the_mass_exactly_reaches_it() -> None:
    halves = torch.tensor([0.0, -math.log(2), -math.log(2)], dtype=torch.float64)  # [0.5, 0.25, 0.25] exactly
    assert logits_to_probs(halves, 1.0).tolist() == [0.5, 0.25, 0.25]
    assert logits_to_probs(halves, 1.0, top_p=0.5).tolist() == [1.0, 0.0, 0.0]
    assert logits_to_probs(halves, 1.0, top_p=0.5 + 1e-9).tolist() == [0.5, 0.25, 0.25]


def test_masked_logits_stay_masked() -> None:
    logits = torch.tensor([[0.0, -math.inf, 1.0, -math.inf]])
    probs = logits_to_probs(logits, 0.5, top_k=3, top_p=0.99)
    assert probs[0, 1] == 0 and probs[0, 3] == 0
    assert torch.allclose(probs.sum(-1), torch.ones(1, dtype=torch.float64))


def test_rows_do_not_depend_on_the_batch() -> None:
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 1000, generator=generator)
    batched = logits_to_probs(logits, 0.7, 50, 0.9)
    shuffled_order = torch.randperm(64, generator=generator)
    shuffled = logits_to_probs(logits[shuffled_order], 0.7, 50, 0.9)
    for row in range(64):
        alone = logits_to_probs(logits[row], 0.7, 50, 0.9)
        assert torch.equal(alone, batched[row])
    assert torch.equal(shuffled, batched[shuffled_order])
    assert logits_to_probs(logits.view(8, 8, 1000), 0.7, 50, 0.9).view(64, 1000).equal(batched)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_any_float_dtype_is_computed_in_float64(dtype: torch.dtype) -> None:
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(2)).to(dtype)
    probs = logits_to_probs(logits, 0.9, 10, 0.9)
    assert probs.dtype == torch.float64
    assert torch.equal(probs, logits_to_probs(logits.to(torch.float64), 0.9, 10, 0.9))


@pytest.mark.parametrize(
    "kwargs",
    [dict(temperature=0.0), dict(temperature=-1.0), dict(temperature=math.nan), dict(temperature=math.inf),
     dict(temperature=1.0, top_k=-1), dict(temperature=1.0, top_k=2.0), dict(temperature=1.0, top_p=0.0),
     dict(temperature=1.0, top_p=1.5)],
)
def test_bad_parameters_raise(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        logits_to_probs(torch.zeros(2, 5), **kwargs)


@pytest.mark.parametrize(
    "logits",
    [torch.tensor([[0.0, math.nan]]), torch.tensor([[0.0, math.inf]]), torch.full((1, 3), -math.inf),
     torch.zeros(2, 0), torch.zeros(3, dtype=torch.int64)],
)
def test_bad_logits_raise(logits: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        logits_to_probs(logits, 1.0)


def test_inverse_cdf_in_vocabulary_order() -> None:
    probs = torch.tensor([[0.25, 0.25, 0.5]] * 4, dtype=torch.float64)
    u = torch.tensor([0.25, 0.2500001, 0.5, 0.75], dtype=torch.float64)
    assert sample_from_probs(probs, u).tolist() == [0, 1, 1, 2]
    # Scale does not matter: the point is u * total.
    assert sample_from_probs(probs * 1e-30, u).tolist() == [0, 1, 1, 2]


@pytest.mark.parametrize("vocab_size", [1, 100, 8193, 10000])
def test_never_returns_a_zero_probability_id(vocab_size: int) -> None:
    u = torch.cat([torch.tensor([SMALLEST_U, 0.5, LARGEST_U], dtype=torch.float64),
                   rng.uniforms(0, torch.arange(61), rng.STREAM_TARGET)])
    batch = u.shape[0]
    last_only = torch.zeros(batch, vocab_size, dtype=torch.float64)
    last_only[:, -1] = 1.0
    assert bool((sample_from_probs(last_only, u) == vocab_size - 1).all())
    first_only = torch.zeros(batch, vocab_size, dtype=torch.float32)
    first_only[:, 0] = 3.0
    assert bool((sample_from_probs(first_only, u) == 0).all())
    if vocab_size < 3:
        return
    # Mostly zeros, including both ends, so both edges of the cumsum are flat.
    generator = torch.Generator().manual_seed(vocab_size)
    sparse = torch.rand(batch, vocab_size, generator=generator, dtype=torch.float64)
    sparse[torch.rand(batch, vocab_size, generator=generator) < 0.9] = 0.0
    sparse[:, vocab_size // 2] += 1e-3
    sparse[:, 0] = 0.0
    sparse[:, -1] = 0.0
    ids = sample_from_probs(sparse, u)
    assert bool(((ids >= 0) & (ids < vocab_size)).all())
    assert bool((sparse[torch.arange(batch), ids] > 0).all())


def test_trailing_zeros_are_not_reached_at_the_largest_u() -> None:
    # The cumsum's last entries equal its total; the largest u must stop at the last positive id.
    probs = torch.tensor([[0.1] * 10 + [0.0, 0.0]], dtype=torch.float64)
    assert sample_from_probs(probs, torch.tensor([LARGEST_U], dtype=torch.float64)).tolist() == [9]
    probs = torch.tensor([[0.0, 0.0, 0.7, 0.0, 0.3, 0.0]], dtype=torch.float64)
    u = torch.tensor([SMALLEST_U, LARGEST_U], dtype=torch.float64)
    assert sample_from_probs(probs.expand(2, -1), u).tolist() == [2, 4]


def test_draws_follow_the_distribution() -> None:
    probs = torch.tensor([0.3, 0.0, 0.05, 0.15, 0.2, 0.001, 0.099, 0.2], dtype=torch.float64)
    trials = 50_000
    u = rng.uniforms(17, torch.arange(trials), rng.STREAM_TARGET)
    ids = sample_from_probs(probs.expand(trials, -1), u)
    counts = np.bincount(ids.numpy(), minlength=probs.shape[0])
    assert counts[1] == 0
    assert _chisquare_pvalue(counts, probs.numpy()) > ALPHA
    # The same machinery flags a wrong distribution.
    assert _chisquare_pvalue(counts, probs.flip(0).numpy() + 1e-3) < ALPHA


@pytest.mark.parametrize(
    "probs,u",
    [(torch.ones(2, 3), torch.full((2,), 0.5, dtype=torch.float32)),
     (torch.ones(2, 3), torch.tensor([0.5, 0.0], dtype=torch.float64)),
     (torch.ones(2, 3), torch.tensor([1.0, 0.5], dtype=torch.float64)),
     (torch.ones(2, 3), torch.full((3,), 0.5, dtype=torch.float64)),
     (torch.tensor([[1.0, -0.1, 0.1]]), torch.full((1,), 0.5, dtype=torch.float64)),
     (torch.zeros(1, 3), torch.full((1,), 0.5, dtype=torch.float64)),
     (torch.tensor([[1.0, math.nan]]), torch.full((1,), 0.5, dtype=torch.float64)),
     (torch.ones(3), torch.full((1,), 0.5, dtype=torch.float64))],
)
def test_sample_bad_input_raises(probs: torch.Tensor, u: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        sample_from_probs(probs, u)


def test_greedy_takes_the_lowest_id_on_ties() -> None:
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0], [-1.0, -3.0, -2.0, -1.0]])
    assert greedy(logits).tolist() == [1, 0, 0]
    assert greedy(logits.view(3, 1, 4)).shape == (3, 1)


def test_drafts_sampled_rule():
    """One rule, read by the drafter (how it drafts) and the router (whether a plain round is
    invisible): sampled requests at or above the minimum temperature."""
    from spectandem.config import SamplingParams

    assert not SamplingParams(temperature=0.0).drafts_sampled(0.0)
    assert not SamplingParams(temperature=0.4).drafts_sampled(0.5)
    assert SamplingParams(temperature=0.5).drafts_sampled(0.5)
    assert SamplingParams(temperature=1e-3).drafts_sampled(0.0)


def test_eos_token_ids_from_config():
    from spectandem.checkpoint import eos_token_ids

    assert eos_token_ids({}) == ()
    assert eos_token_ids({"eos_token_id": None}) == ()
    assert eos_token_ids({"eos_token_id": 7}) == (7,)
    assert eos_token_ids({"eos_token_id": [1, 2]}) == (1, 2)
