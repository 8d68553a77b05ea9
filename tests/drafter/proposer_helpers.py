"""Shared inputs of the drafter proposer and engine tests on the real demo target and heads (fp32,
CPU): random tokens and features, draft requests and configs, and a proposer's committed K/V."""

import torch

from drafter.proposers import DraftRequest
from spectandem.config import SamplingParams, SpecConfig

MODELS = "models/demo"
MAX_LEN = 96
ATOL = 1e-5
# Against a computation of another shape (the full causal pass of `_manual_catch_up` in
# test_catch_up.py), fp32 reductions run in another order: allow a few more ulps.
LOOSE = dict(atol=5e-5, rtol=1e-5)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _tokens(n: int, seed: int, vocab: int = 4096) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=_gen(seed)).tolist()


def _features(head, n: int, seed: int) -> torch.Tensor:
    return torch.randn(n, head.spec.feature_size, generator=_gen(seed))


def _request(rid: str, tokens: list[int], temperature: float = 0.0, seed: int = 0) -> DraftRequest:
    return DraftRequest(rid, list(tokens), SamplingParams(temperature=temperature), seed, temperature >= 0.5)


def _cfg(head, **kw) -> SpecConfig:
    return SpecConfig(method=head.spec.kind, **kw)


def _entries(proposer, rid: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The committed K/V entries of a request in a proposer's (one-layer) cache."""
    slot, n = proposer.slots.of[rid], proposer.cache_len[rid]
    rows = proposer.cache.rows(torch.tensor([slot]), torch.arange(n)[None])[0]     # paged: logical -> row
    return proposer.cache.k[0][rows].transpose(0, 1), proposer.cache.v[0][rows].transpose(0, 1)
