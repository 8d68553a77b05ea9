"""From logits to a sampling distribution, and from a distribution plus a uniform to a token.

`logits_to_probs` is the only place where temperature, top-k and top-p are applied. The drafter
calls it to get the distribution it samples drafts from (`draft_probs`), the verifier calls it to
get `target_probs`, and plain decoding calls it too. Applying the sampling parameters to one side
only, or differently to both, makes rejection sampling silently lossy (HF transformers issue
47932); one function for every side rules that out.

Every operation acts on the last dimension only, so a row's result never depends on which other
rows share its batch.
"""

import math

import torch

from spectandem.checks import describe


def logits_to_probs(
    logits: torch.Tensor,  # [..., V] any float dtype
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """The sampling distribution, float64 [..., V]: temperature, then top-k, then top-p, renormalised.

    Args:
        logits: [..., V]; -inf marks a token that must never be drawn.
        temperature: > 0. Greedy decoding (temperature 0) is the caller's business: use `greedy`.
        top_k: keep the top_k largest logits (0 = off). Ties at the k-th largest value are all
            kept, so more than top_k tokens can survive; the result is independent of the order
            of the vocabulary.
        top_p: nucleus, in (0, 1]: keep the smallest set of most probable tokens whose mass
            reaches top_p (the most probable token always survives). Ties at the smallest kept
            probability are all kept, for the same reason as with top_k. 1.0 = off.

    Returns:
        [..., V] float64, non-negative, each row summing to 1 (up to rounding).
    """
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        raise ValueError(f"logits must be a floating-point tensor, got {type(logits).__name__} "
                         f"{getattr(logits, 'dtype', '')}")
    if logits.dim() < 1 or logits.shape[-1] < 1:
        raise ValueError(f"logits must have shape [..., V] with V >= 1, got {tuple(logits.shape)}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an int >= 0 (0 = off), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0.0 < top_p <= 1.0):
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    scaled = logits.to(torch.float64) / temperature
    if torch.isnan(scaled).any() or (scaled == math.inf).any():
        raise ValueError("logits contain NaN or +inf")
    if (scaled.amax(dim=-1) == -math.inf).any():
        raise ValueError("a row of logits is entirely -inf; nothing can be sampled from it")

    vocab_size = scaled.shape[-1]
    if 0 < top_k < vocab_size:
        kth_largest = scaled.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        scaled = scaled.masked_fill(scaled < kth_largest, -math.inf)
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        probs = _nucleus(probs, top_p)
    return probs


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:  # probs [..., V] float64
    """Zero every token outside the top_p nucleus of each row and renormalise.

    Worked example, top_p = 0.7: sorted probs [0.5, 0.3, 0.15, 0.05] have exclusive cumulative
    mass [0, 0.5, 0.8, 0.95]; a token is in the nucleus iff the mass strictly before it is
    < top_p, so [0.5, 0.3] survive (0.8 >= 0.7 reached) and the threshold is 0.3.
    """
    sorted_probs = probs.sort(dim=-1, descending=True).values
    mass_before = torch.cumsum(sorted_probs, dim=-1)
    # Shift rather than subtract, so mass_before[i] is exactly the cumulative sum up to i - 1.
    mass_before = torch.cat([torch.zeros_like(mass_before[..., :1]), mass_before[..., :-1]], dim=-1)
    num_kept = (mass_before < top_p).sum(dim=-1, keepdim=True)  # [..., 1], >= 1 since top_p > 0
    threshold = sorted_probs.gather(-1, num_kept - 1)
    kept = torch.where(probs >= threshold, probs, torch.zeros_like(probs))
    return kept / kept.sum(dim=-1, keepdim=True)


def sample_from_probs(
    probs: torch.Tensor,  # [B, V] non-negative, need not be normalised
    u: torch.Tensor,  # [B] float64 in (0, 1)
) -> torch.Tensor:
    """Inverse-CDF sampling in vocabulary order: the smallest id i with cumsum(probs)[i] >= u * total.

    The same (probs row, u) always gives the same token, which is what makes seeded speculative
    decoding reproduce seeded plain decoding. A token with probability 0 is never returned:
    cumsum is flat across a zero, so the first index reaching u * total > 0 has positive
    probability; the end of the cumsum is additionally clamped to the last positive id.

    Returns:
        [B] int64 token ids in [0, V).
    """
    if not isinstance(probs, torch.Tensor) or probs.dim() != 2 or probs.shape[1] < 1:
        raise ValueError(f"probs must be a [B, V] tensor with V >= 1, got {describe(probs)}")
    if not isinstance(u, torch.Tensor) or u.dim() != 1 or u.shape[0] != probs.shape[0]:
        raise ValueError(f"u must be a [B] tensor with B = {probs.shape[0]}, got {describe(u)}")
    if u.dtype != torch.float64:
        raise ValueError(f"u must be float64 (float32 uniforms bias rare tokens), got {u.dtype}")
    if not ((u > 0) & (u < 1)).all():
        bad = u[~((u > 0) & (u < 1))][0].item()
        raise ValueError(f"u must lie in the open interval (0, 1), got {bad!r}")
    probs = probs.to(torch.float64)
    u = u.to(probs.device)  # uniforms are made on the host; the draw happens where probs live
    if not torch.isfinite(probs).all() or (probs < 0).any():
        raise ValueError("probs must be finite and non-negative")
    cdf = torch.cumsum(probs, dim=-1)  # [B, V]
    total = cdf[:, -1]  # [B]
    if (total <= 0).any():
        row = int((total <= 0).nonzero()[0, 0])
        raise ValueError(f"probs row {row} has total mass {total[row].item()!r}; need > 0")
    point = (u * total).unsqueeze(-1)  # [B, 1]; <= total because u < 1
    ids = torch.searchsorted(cdf, point, side="left").squeeze(-1)  # [B]
    positive = probs > 0  # [B, V]
    # Last positive id via the first positive of the flipped row (argmax returns the first max):
    # [0, .3, 0, .7, 0, 0] -> flipped first positive at 2 -> last positive id 6 - 1 - 2 = 3.
    last_positive = probs.shape[1] - 1 - positive.flip(-1).to(torch.int8).argmax(dim=-1)  # [B]
    ids = torch.minimum(ids, last_positive)
    assert bool(positive.gather(-1, ids.unsqueeze(-1)).all()), "sampled a zero-probability token"
    return ids


def greedy(logits: torch.Tensor) -> torch.Tensor:  # logits [..., V]
    """Argmax over the last dimension, [...] int64; the lowest id wins a tie."""
    return torch.argmax(logits, dim=-1)
