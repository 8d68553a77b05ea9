"""Helpers of the lockstep tests (two demo speculators driven through the same rounds, one on a
one-pass path, one on the passes it replaces)."""

from __future__ import annotations

import torch

from spectandem.config import SamplingParams


def assert_same_head_state(fused, split, rids, tol: float = 1e-4) -> None:
    """The two drafters' proposers hold the same head-cache length per request and, up to
    summation order, the same last hidden and logits."""
    pf, ps = fused.drafter.proposer, split.drafter.proposer
    for rid in rids:
        assert pf.cache_len[rid] == ps.cache_len[rid]
        torch.testing.assert_close(pf.last_hidden[rid], ps.last_hidden[rid], atol=tol, rtol=tol)
        torch.testing.assert_close(pf.last_logits[rid], ps.last_logits[rid], atol=tol, rtol=tol)


def verify_and_extend(fused, split, trees) -> None:
    """Each speculator verifies its tree (the verdicts must agree) and its drafter takes it in."""
    verdicts = fused.verifier.verify(trees[0]), split.verifier.verify(trees[1])
    assert [o.token_ids for o in verdicts[0]] == [o.token_ids for o in verdicts[1]]
    fused.drafter.extend(verdicts[0])
    split.drafter.extend(verdicts[1])


def prefilled(specs, prompts) -> list[str]:
    """Prefills the same prompts (greedy, 400 tokens at most) on each speculator's verifier and
    drafter -> the request ids."""
    rids = [f"r{i}" for i in range(len(prompts))]
    sp = SamplingParams(max_tokens=400)
    for spec in specs:
        ids = [spec.tokenizer.encode(t).ids for t in prompts]
        firsts = spec.verifier.prefill(rids, ids, [sp] * len(ids), [1] * len(ids))
        for rid, p, f in zip(rids, ids, firsts):
            spec.drafter.add(rid, p, f.first_token_id, sp, 1, f.features)
    return rids
