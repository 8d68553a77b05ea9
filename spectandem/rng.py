"""Counter-based random numbers: a uniform is a pure function of (seed, position, stream, index).

Speculative decoding consumes randomness in an order that depends on how requests are batched,
how many drafts were accepted last round and whether a request was preempted. A stateful
generator would make a seeded request's output depend on all of that. Here every draw is named
instead of consumed: the uniform for "acceptance coin j of the token at position 17 of the
request with seed 42" is the same number in the drafter, in the verifier, in a batch of one or a
batch of 256, before and after a preemption. A round that stops early simply never looks at the
uniforms of later positions, and the next round reads exactly those.

Keys:
    seed      the request's seed, 0 <= seed < 2**64.
    position  the absolute position of the token the draw decides (0-based, prompt included).
    stream    what the draw is for: STREAM_TARGET, STREAM_ACCEPT or STREAM_DRAFT.
    index     which draw within (position, stream), e.g. the sibling number of an acceptance coin.

The mixing is the splitmix64 finaliser (a bijection on 64-bit words) applied to each key word
and chained, so for fixed other keys two different values of one key never give the same 64-bit
state. The top 52 bits of the state k select the float (k + 1/2) / 2**52: the midpoints of 2**52
equal cells of [0, 1).

Why float64: a float32 uniform has 24 bits, so tokens with probability below ~6e-8 are drawn
with the wrong frequency by inverse-CDF sampling and `u * q(x) <= p(x)` is decided with a
2**-24 relative error; float32 generators can also return exactly 0.0 (PyTorch issue 16706).

Why the open interval (0, 1): u == 0 would accept a draft with target probability 0 (0 <= 0 in
the acceptance test) and would select vocabulary id 0 by inverse CDF even when its probability
is 0; u == 1 would point past the end of a cumulative sum that rounding left slightly below its
total. The smallest value is 2**-53 and the largest 1 - 2**-53, both exact in float64.

Nothing here touches torch's or numpy's global RNG.
"""

from collections.abc import Sequence

import numpy as np
import torch

STREAM_TARGET = 0  # a token drawn from a target-side distribution: plain decoding, bonus, recovered
STREAM_ACCEPT = 1  # acceptance coins of rejection sampling
STREAM_DRAFT = 2  # drawing draft tokens from the draft distribution

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # golden-ratio increment of splitmix64; k * _GAMMA separates the key slots
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB
_CELL = 2.0**-52


def _mix64(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _check_word(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"{name} must be an int, got {value!r}")
    value = int(value)
    if not 0 <= value <= _MASK64:
        raise ValueError(f"{name} must be in [0, 2**64), got {value}")
    return value


def uniform(seed: int, position: int, stream: int, index: int = 0) -> float:
    """The uniform named by the four keys, a float64 in the open interval (0, 1)."""
    words = (
        _check_word("seed", seed),
        _check_word("position", position),
        _check_word("stream", stream),
        _check_word("index", index),
    )
    state = 0
    for slot, word in enumerate(words, start=1):
        state = _mix64(state ^ _mix64((word + slot * _GAMMA) & _MASK64))
    return ((state >> 12) + 0.5) * _CELL


# The numpy twin of _mix64. uint64 array arithmetic wraps modulo 2**64, which is what we want;
# every operand is a uint64 array or np.uint64 so nothing is promoted to float or int64.
_NP_MUL1 = np.uint64(_MUL1)
_NP_MUL2 = np.uint64(_MUL2)
_NP_SHIFTS = (np.uint64(30), np.uint64(27), np.uint64(31), np.uint64(12))


def _mix64_array(z: np.ndarray) -> np.ndarray:
    s30, s27, s31, _ = _NP_SHIFTS
    z = (z ^ (z >> s30)) * _NP_MUL1
    z = (z ^ (z >> s27)) * _NP_MUL2
    return z ^ (z >> s31)


def _words_array(name: str, values: Sequence[int] | torch.Tensor) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"{name} must hold integers, got dtype {values.dtype}")
        signed = values.detach().to("cpu", torch.int64).numpy()
        if (signed < 0).any():
            raise ValueError(f"{name} must be >= 0, got {int(signed[signed < 0].flat[0])}")
        return signed.astype(np.uint64)
    boxed = np.asarray(values, dtype=object)
    return np.array(
        [_check_word(name, v) for v in boxed.flat], dtype=np.uint64
    ).reshape(boxed.shape)


def uniforms(
    seed: int | Sequence[int] | torch.Tensor,
    positions: Sequence[int] | torch.Tensor,
    stream: int,
    index: int = 0,
) -> torch.Tensor:
    """Vectorised `uniform`: element i is exactly `uniform(seed[i], positions[i], stream, index)`.

    Args:
        seed: one int for all elements, or one per element (same shape as positions), so a
            batch of requests with different seeds is one call. An int64 tensor can only hold
            seeds below 2**63; pass a sequence of ints for larger ones.
        positions: [...] integer positions; a sequence is treated as 1-D.

    Returns:
        [...] float64 (the shape of positions), every value in (0, 1).
    """
    position_words = _words_array("positions", positions)
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        seed_words = np.full(position_words.shape, _check_word("seed", seed), dtype=np.uint64)
    else:
        seed_words = _words_array("seed", seed)
        if seed_words.shape != position_words.shape:
            raise ValueError(
                f"seed has shape {tuple(seed_words.shape)} but positions has shape "
                f"{tuple(position_words.shape)}; pass one int or one seed per position"
            )
    words = (
        seed_words,
        position_words,
        np.full(position_words.shape, _check_word("stream", stream), dtype=np.uint64),
        np.full(position_words.shape, _check_word("index", index), dtype=np.uint64),
    )
    # Work on 1-D arrays: numpy 0-d arithmetic yields scalars, which warn on the intended wrap.
    state = np.zeros(position_words.size, dtype=np.uint64)
    for slot, word in enumerate(words, start=1):
        slot_offset = np.uint64((slot * _GAMMA) & _MASK64)
        state = _mix64_array(state ^ _mix64_array(word.reshape(-1) + slot_offset))
    cells = (state >> _NP_SHIFTS[3]).astype(np.float64)  # < 2**52, exact in float64
    return torch.from_numpy(((cells + 0.5) * _CELL).reshape(position_words.shape))
