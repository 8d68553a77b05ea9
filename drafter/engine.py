"""The drafter engine: request bookkeeping around a proposer, and the one registry of methods.

Per request it keeps the committed tokens and the draft probabilities of the round in flight,
tagged with the committed length they were drafted at (`DraftProbStore`).
"""

from __future__ import annotations

from pathlib import Path

import torch

from drafter.proposers import DraftModelProposer, DraftRequest, EagleProposer, NgramProposer, Proposer
from drafter.tree import TreeDraft
from spectandem.config import SamplingParams, SpecConfig
from spectandem.messages import DraftTree, StaleMessage, VerifyOutput


class DraftProbStore:
    """Draft probabilities q of each request's pending draft, tagged (request, committed_len).

    Rows stay here from drafting until the round's verdict (and, later, across preemption);
    `take` hands them out only to a verification at the same committed length, so rows of
    another round can never be used."""

    def __init__(self):
        self._rows: dict[str, tuple[int, torch.Tensor]] = {}

    def put(self, request_id: str, committed_len: int, probs: torch.Tensor) -> None:
        """probs [N, V] float64, row i = the distribution node i's children were drawn from."""
        self._rows[request_id] = (committed_len, probs)

    def take(self, request_id: str, committed_len: int) -> torch.Tensor:
        tag, probs = self._rows[request_id]
        if tag != committed_len:
            # A stale caller must not consume the rows of the round still in flight.
            raise StaleMessage(f"draft probabilities of {request_id!r} were drafted at committed length "
                               f"{tag}, not {committed_len}")
        del self._rows[request_id]
        return probs

    def drop(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._rows)


class DrafterEngine:
    def __init__(self, proposer: Proposer, cfg: SpecConfig):
        self.proposer, self.cfg = proposer, cfg
        self.requests: dict[str, DraftRequest] = {}
        self.epochs: dict[str, int] = {}
        self.store = DraftProbStore()

    @property
    def feature_layers(self):
        return self.proposer.feature_layers

    def add(self, request_id: str, prompt_ids: list[int], first_token_id: int, params: SamplingParams,
            seed: int, features: torch.Tensor | None, epoch: int = 0) -> None:
        """Prefill: the prompt, the first sampled token and the target features of every prompt
        position ([len(prompt_ids), F])."""
        self.add_many([(request_id, prompt_ids, first_token_id, params, seed, features, epoch)])

    def add_many(self, items: list[tuple]) -> None:
        """Several prefills in one catch-up pass; items are the arguments of `add`."""
        reqs = []
        for request_id, prompt_ids, first_token_id, params, seed, features, epoch in items:
            if request_id in self.requests:
                self.remove(request_id)  # a re-prefill (resync after a restart or preemption)
            sample = params.temperature >= max(self.cfg.draft_sampling_min_temperature, 1e-12) and not params.greedy
            req = DraftRequest(request_id, list(prompt_ids) + [first_token_id], params, seed, sample)
            self.requests[request_id] = req
            self.epochs[request_id] = epoch
            reqs.append(req)
        if reqs:
            self.proposer.catch_up(reqs, [r.committed_len - 1 for r in reqs], [it[5] for it in items])

    def check_tag(self, request_id: str, epoch: int, committed_len: int) -> None:
        """Raises StaleMessage unless the request is at this epoch and committed length."""
        req = self.requests.get(request_id)
        if req is None:
            raise StaleMessage(f"request {request_id!r} is not active on the drafter")
        if (self.epochs[request_id], req.committed_len) != (epoch, committed_len):
            raise StaleMessage(f"request {request_id!r} is at epoch {self.epochs[request_id]}, committed "
                               f"length {req.committed_len}; the message is for {epoch}, {committed_len}")

    def extend(self, outputs: list[VerifyOutput]) -> None:
        """Catch-up after verification: absorb each request's accepted tokens and bonus token."""
        reqs = [self.requests[out.request_id] for out in outputs]
        # Check every verdict before changing anything: a stale one leaves the whole batch as it was.
        for out, req in zip(outputs, reqs):
            if req.committed_len + len(out.token_ids) != out.committed_len:
                raise StaleMessage(f"{out.request_id!r}: verdict for committed length {out.committed_len} "
                                   f"does not follow the drafter's {req.committed_len}")
        for out, req in zip(outputs, reqs):
            self.store.drop(out.request_id)  # the round's verdict is in: its q rows are spent
            req.token_ids.extend(out.token_ids)
        if reqs:
            self.proposer.catch_up(reqs, [len(o.token_ids) for o in outputs], [o.features for o in outputs])

    def draft(self, request_ids: list[str]) -> DraftTree:
        """One round's trees for these requests (sampled and deterministic drafted separately)."""
        reqs = [self.requests[i] for i in request_ids]
        parts: dict[bool, list[int]] = {}
        for i, r in enumerate(reqs):
            parts.setdefault(r.sample_drafts, []).append(i)
        drafts: dict[int, tuple[TreeDraft, int]] = {}
        for idx in parts.values():
            tree = self.proposer.propose([reqs[i] for i in idx])
            for row, i in enumerate(idx):
                drafts[i] = (tree, row)
        m = max(d.token_ids.shape[1] for d, _ in drafts.values())
        b = len(reqs)
        n = m + 1
        token_ids = torch.full((b, n), -1, dtype=torch.long)
        parents = torch.full((b, n), -1, dtype=torch.long)
        scores = torch.full((b, n), float("-inf"))
        valid = torch.zeros(b, n, dtype=torch.bool)
        any_sampled = any(r.sample_drafts for r in reqs)
        probs_rows: list[torch.Tensor | None] = []
        for i, r in enumerate(reqs):
            d, row = drafts[i]
            mi = d.token_ids.shape[1]
            token_ids[i, 0], parents[i, 0], scores[i, 0], valid[i, 0] = r.token_ids[-1], -1, 0.0, True
            token_ids[i, 1: 1 + mi] = d.token_ids[row].cpu()
            parents[i, 1: 1 + mi] = d.parents[row].cpu()
            scores[i, 1: 1 + mi] = d.scores[row].float().cpu()
            valid[i, 1: 1 + mi] = d.token_ids[row].cpu() >= 0
            if r.sample_drafts:
                rows = d.node_probs[row].cpu()                                   # [mi + 1, V]
                self.store.put(r.request_id, r.committed_len, rows)
                probs_rows.append(rows)
            else:
                probs_rows.append(None)
        draft_probs = None
        if any_sampled:
            vocab = next(p.shape[-1] for p in probs_rows if p is not None)
            draft_probs = torch.zeros(b, n, vocab, dtype=torch.float64)
            for i, rows in enumerate(probs_rows):
                if rows is not None:
                    draft_probs[i, : rows.shape[0]] = rows
        return DraftTree(request_ids=list(request_ids), committed_lens=[r.committed_len for r in reqs],
                         token_ids=token_ids, parents=parents, node_valid=valid, scores=scores,
                         draft_probs=draft_probs, sampled=[r.sample_drafts for r in reqs])

    def remove(self, request_id: str) -> None:
        self.requests.pop(request_id, None)
        self.epochs.pop(request_id, None)
        self.store.drop(request_id)
        self.proposer.remove(request_id)


def build_proposer(cfg: SpecConfig, target, draft_dir: str | Path | None, max_slots: int, max_len: int,
                   dtype: torch.dtype = torch.float32, device: str = "cpu", kv_blocks: int | None = None,
                   block_size: int = 16) -> Proposer | None:
    """The one place a method name becomes a proposer. `target` is the target model, native or
    transformers (EAGLE heads take embeddings and lm_head from it)."""
    if cfg.method == "none":
        return None
    if cfg.method == "ngram":
        return NgramProposer(cfg)
    if draft_dir is None:
        raise ValueError(f"method {cfg.method!r} needs a draft directory (--draft)")
    if cfg.method == "draft-model":
        from spectandem.modeling.llama import load_llama

        from drafter.loader import TargetTensors

        model = load_llama(draft_dir, dtype, device)
        vocab = TargetTensors.of(target).vocab_size
        if model.spec.vocab_size != vocab:
            raise ValueError(f"{draft_dir}: draft model vocab_size {model.spec.vocab_size} does not match "
                             f"the target's {vocab}")
        return DraftModelProposer(model, cfg, max_slots, max_len, kv_blocks, block_size)
    from drafter.loader import load_head

    head = load_head(draft_dir, target, kind=cfg.method, dtype=dtype, device=device)
    return EagleProposer(head, cfg, max_slots, max_len, kv_blocks, block_size)
