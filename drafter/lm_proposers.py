"""Proposers without target features: a separate small causal LM ("draft-model") and n-gram
lookup in the request's own tokens. The interface and the shared pieces are in
drafter/proposers.py."""

from __future__ import annotations

import torch

from drafter.proposers import Proposer, RequestSlots, ScratchTree, pad_rows, paged_cache
from drafter.tree import draft_tree
from drafter.tree import DraftNodes
from spectandem.config import SpecConfig
from spectandem.devices import to_device
from spectandem.modeling.llama import LlamaModel


class DraftModelProposer(Proposer):
    """A separate small causal LM ("draft-model"). Its cache holds every committed token
    (committed_len entries); tree steps feed draft tokens at their own positions."""

    feature_layers = None

    def __init__(self, model: LlamaModel, cfg: SpecConfig, max_slots: int, max_len: int,
                 kv_blocks: int | None = None, block_size: int = 16):
        self.model, self.cfg = model, cfg
        s = model.spec
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.cache = paged_cache(s.num_layers, max_slots, s.num_kv_heads, max_len, s.head_dim, dtype, self.device,
                            kv_blocks, block_size, cfg)
        self.slots = RequestSlots(self.cache.num_slots)
        self.cache_len: dict[str, int] = {}
        self.last_logits: dict[str, torch.Tensor] = {}

    supports_ahead = True

    def ahead_fork(self, src_id, dst_id):
        self.cache.fork(self.slots.of[src_id], self.slots.get(dst_id), self.cache_len[src_id])
        self.cache_len[dst_id] = self.cache_len[src_id]
        self.last_logits[dst_id] = self.last_logits[src_id]

    def ahead_absorb(self, reqs, num_new):
        # The LM reads tokens only: absorbing predicted tokens is an ordinary catch-up.
        live = [r for r, n in zip(reqs, num_new) if n > 0]
        if live:
            self.catch_up(live, [n for n in num_new if n > 0], [None] * len(live))

    def ahead_logprobs(self, request_ids):
        return torch.log_softmax(torch.stack([self.last_logits[i] for i in request_ids]).float(), -1)

    @torch.no_grad()
    def catch_up(self, reqs, num_new, features):
        slots = to_device([self.slots.get(r.request_id) for r in reqs], self.device)
        base = [self.cache_len.get(r.request_id, 0) for r in reqs]
        # The LM reads tokens, not pairs: it absorbs everything committed after its cache.
        new = [r.committed_len - b0 for r, b0 in zip(reqs, base)]
        for r, b0 in zip(reqs, base):
            slot = self.slots.of[r.request_id]
            self.cache.trim(slot, b0)
            self.cache.reserve(slot, r.committed_len)
        toks = pad_rows([torch.tensor(r.token_ids[b0:], device=self.device) for r, b0 in zip(reqs, base)], 0)
        t = toks.shape[1]
        ar = torch.arange(t, device=self.device)
        base_t = torch.tensor(base, device=self.device)
        n_t = torch.tensor(new, device=self.device)
        positions = base_t[:, None] + ar
        write = torch.where(ar < n_t[:, None], positions, self.cache.trash_index)
        span = int((base_t + n_t).max())
        cols = torch.arange(span, device=self.device)
        mask = (cols[None, None, :] <= positions[:, :, None]) & (ar < n_t[:, None])[:, :, None]
        mask[:, :, 0] |= True  # padding rows attend somewhere; their outputs are never read
        hidden, _ = self.model(toks, positions, self.cache.batch(slots, write, span), mask)
        last = hidden.gather(1, (n_t - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))
        logits = self.model.logits(last)[:, 0]
        for i, r in enumerate(reqs):
            self.cache_len[r.request_id] = r.committed_len
            self.last_logits[r.request_id] = logits[i]

    @torch.no_grad()
    def propose(self, reqs, num_steps=None):
        ids = [r.request_id for r in reqs]
        slots = torch.tensor([self.slots.of[i] for i in ids], device=self.device)
        base = torch.tensor([self.cache_len[i] for i in ids], device=self.device)
        first = torch.stack([self.last_logits[i] for i in ids])
        # Step i feeds depth-i tokens, at position committed_len - 1 + i = base + i - 1.
        for i, b0 in zip(ids, base.tolist()):
            self.cache.reserve(self.slots.of[i], b0 + max(0, self.cfg.num_steps - 1) * self.cfg.topk)
        scratch = ScratchTree(self.cache, slots, base, self.cfg.topk, pos_offset=0)

        def step(i, token_ids, parent_rows, visible):
            cache, positions, mask = scratch.batch(i, visible)
            hidden, _ = self.model(token_ids, positions, cache, mask)
            return self.model.logits(hidden)

        return draft_tree(reqs, first, step, lambda t: t, self.cfg, self.model.spec.vocab_size, num_steps)

    def kv_stats(self) -> dict:
        return self.cache.stats()

    def remove(self, request_id):
        slot = self.slots.release(request_id)
        if slot is not None:
            self.cache.free(slot)
        self.cache_len.pop(request_id, None)
        self.last_logits.pop(request_id, None)


class NgramProposer(Proposer):
    """Prompt lookup: the longest suffix n-gram (ngram_max down to ngram_min) that occurred
    earlier in the request's tokens proposes the tokens that followed its latest earlier
    occurrence, as a chain of up to min(num_steps, num_draft_tokens - 1) deterministic drafts."""

    feature_layers = None
    supports_ahead = False   # a lookup costs next to nothing: no need to do it ahead

    def __init__(self, cfg: SpecConfig):
        self.cfg = cfg

    def catch_up(self, reqs, num_new, features):
        return None

    def _lookup(self, tokens: list[int], num_steps: int) -> list[int]:
        want = min(num_steps, self.cfg.num_draft_tokens - 1)
        for n in range(min(self.cfg.ngram_max, len(tokens) - 1), self.cfg.ngram_min - 1, -1):
            suffix = tokens[-n:]
            for start in range(len(tokens) - n - 1, -1, -1):
                if tokens[start:start + n] == suffix:
                    return tokens[start + n: start + n + want]
        return []

    def propose(self, reqs, num_steps=None):
        chains = [self._lookup(r.token_ids, num_steps or self.cfg.num_steps) for r in reqs]
        m = max(1, max(len(c) for c in chains))
        tok = torch.full((len(reqs), m), -1, dtype=torch.long)
        parents = torch.arange(m).expand(len(reqs), m).clone()          # node j+1's parent is node j
        scores = torch.full((len(reqs), m), float("-inf"))
        for i, c in enumerate(chains):
            tok[i, : len(c)] = torch.tensor(c, dtype=torch.long)
            scores[i, : len(c)] = 0.0
        return DraftNodes(token_ids=tok, parents=parents, scores=scores)

    def remove(self, request_id):
        return None
