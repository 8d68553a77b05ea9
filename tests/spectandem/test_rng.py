"""spectandem.rng: a uniform is a pure function of (seed, position, stream, index)."""

import numpy as np
import pytest
import scipy.stats
import torch

from spectandem import rng

ALPHA = 1e-6
N = 100_000


def _grid_independence_pvalue(a: torch.Tensor, b: torch.Tensor, cells: int = 10) -> float:
    """Chi-square p-value of the pairs (a[i], b[i]) against the uniform distribution on the square."""
    ia = (a * cells).long().clamp(max=cells - 1)
    ib = (b * cells).long().clamp(max=cells - 1)
    counts = torch.bincount(ia * cells + ib, minlength=cells * cells).numpy()
    return scipy.stats.chisquare(counts).pvalue


def test_pinned_values() -> None:
    # The drafter and the verifier run in different processes and releases: a seeded request is
    # reproducible only if these numbers never change.
    assert rng.uniform(0, 0, 0, 0) == 0.06445194804538368
    assert rng.uniform(42, 17, rng.STREAM_ACCEPT, 2) == 0.9066478745432612
    assert rng.uniform(2**64 - 1, 2**40, rng.STREAM_DRAFT, 7) == 0.9590753496118593


def test_stream_constants() -> None:
    assert (rng.STREAM_TARGET, rng.STREAM_ACCEPT, rng.STREAM_DRAFT) == (0, 1, 2)


def test_deterministic_and_pure() -> None:
    torch.manual_seed(1)
    np.random.seed(1)
    first = rng.uniforms(7, torch.arange(1000), rng.STREAM_TARGET)
    torch.manual_seed(2)
    np.random.seed(2)
    second = rng.uniforms(7, torch.arange(1000), rng.STREAM_TARGET)
    assert torch.equal(first, second)
    assert rng.uniform(7, 5, 0) == rng.uniform(7, 5, 0)


def test_vectorised_equals_scalar() -> None:
    generator = np.random.default_rng(3)
    seeds = [int(s) for s in generator.integers(0, 2**63, 200)] + [0, 2**64 - 1]
    positions = [int(p) for p in generator.integers(0, 2**40, len(seeds))]
    for stream, index in [(0, 0), (1, 3), (2, 0), (1, 2**64 - 1)]:
        vector = rng.uniforms(seeds, positions, stream, index)
        scalar = torch.tensor(
            [rng.uniform(s, p, stream, index) for s, p in zip(seeds, positions)], dtype=torch.float64
        )
        assert vector.dtype == torch.float64
        assert torch.equal(vector, scalar)
    one_seed = rng.uniforms(11, torch.tensor([[3, 4], [5, 6]]), rng.STREAM_ACCEPT, 1)
    assert one_seed.shape == (2, 2)
    assert one_seed[1, 0].item() == rng.uniform(11, 5, rng.STREAM_ACCEPT, 1)


def test_open_interval_and_grid() -> None:
    values = rng.uniforms(0, torch.arange(N), rng.STREAM_TARGET)
    assert values.shape == (N,)
    assert bool(((values > 0) & (values < 1)).all())
    # Every value is a midpoint (k + 1/2) / 2**52, so the extremes 2**-53 and 1 - 2**-53 are exact.
    cells = values * 2.0**52 - 0.5
    assert torch.equal(cells, cells.floor())


@pytest.mark.parametrize("stream", [rng.STREAM_TARGET, rng.STREAM_ACCEPT, rng.STREAM_DRAFT])
def test_uniform_over_positions(stream: int) -> None:
    values = rng.uniforms(123, torch.arange(N), stream).numpy()
    assert scipy.stats.kstest(values, "uniform").pvalue > ALPHA


def test_uniform_over_seeds_and_indices() -> None:
    over_seeds = rng.uniforms(list(range(N)), [5] * N, rng.STREAM_ACCEPT).numpy()
    assert scipy.stats.kstest(over_seeds, "uniform").pvalue > ALPHA
    over_indices = np.array([rng.uniform(9, 4, rng.STREAM_ACCEPT, j) for j in range(20_000)])
    assert scipy.stats.kstest(over_indices, "uniform").pvalue > ALPHA


def test_independence_between_neighbours() -> None:
    positions = torch.arange(N)
    base = rng.uniforms(5, positions, rng.STREAM_TARGET)
    neighbours = {
        "next position": rng.uniforms(5, positions + 1, rng.STREAM_TARGET),
        "other stream": rng.uniforms(5, positions, rng.STREAM_ACCEPT),
        "draft stream": rng.uniforms(5, positions, rng.STREAM_DRAFT),
        "next seed": rng.uniforms(6, positions, rng.STREAM_TARGET),
        "next index": rng.uniforms(5, positions, rng.STREAM_TARGET, 1),
    }
    for name, other in neighbours.items():
        assert _grid_independence_pvalue(base, other) > ALPHA, name
        assert abs(float(np.corrcoef(base.numpy(), other.numpy())[0, 1])) < 0.02, name


def test_independence_check_can_fail() -> None:
    # The grid test must flag an obviously dependent pair, or the test above proves nothing.
    base = rng.uniforms(5, torch.arange(N), rng.STREAM_TARGET)
    assert _grid_independence_pvalue(base, (base + 0.05) % 1.0) < ALPHA


def test_global_rng_untouched() -> None:
    torch.manual_seed(0)
    np.random.seed(0)
    torch_state = torch.random.get_rng_state()
    numpy_state = np.random.get_state()
    rng.uniforms(1, torch.arange(1000), rng.STREAM_DRAFT)
    rng.uniform(1, 2, rng.STREAM_ACCEPT, 3)
    assert torch.equal(torch.random.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert after[0] == numpy_state[0] and np.array_equal(after[1], numpy_state[1])


@pytest.mark.parametrize(
    "call",
    [
        lambda: rng.uniform(-1, 0, 0),
        lambda: rng.uniform(0, -1, 0),
        lambda: rng.uniform(0, 0, 0, 2**64),
        lambda: rng.uniform(0, 1.5, 0),
        lambda: rng.uniforms(0, torch.tensor([1, -2]), 0),
        lambda: rng.uniforms(0, torch.tensor([1.0]), 0),
        lambda: rng.uniforms([1, 2, 3], [1, 2], 0),
        lambda: rng.uniforms(0, [1, True], 0),
    ],
)
def test_bad_keys_raise(call) -> None:
    with pytest.raises(ValueError):
        call()
