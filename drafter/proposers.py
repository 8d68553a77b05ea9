"""Proposers: the small interface every draft method implements, and the registry.

A proposer keeps per-request state (its own KV cache slot, the last catch-up output) and
offers three calls, in this order per request: `catch_up` (absorb newly committed tokens, with
target features where the method reads them), `propose` (a DraftTree for the next round),
`remove`. `DrafterEngine` (drafter/engine.py) does the bookkeeping around them.
EAGLE heads propose here; the draft-model and n-gram proposers are in drafter/lm_proposers.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from drafter.ahead_chains import AheadChainGraphs, outcome_trees, scratch_entries
from drafter.catchup_graphs import CatchUpGraphs, catch_up_forward, catch_up_inputs
from drafter.graphs import PAIR_BUCKETS, WARM_MAX_SPAN, ChainGraphs, warm_spans
from drafter.heads import DraftHead
from drafter.tree import DraftNodes, draft_tree
from spectandem.config import SamplingParams, SpecConfig
from spectandem.devices import to_device, to_device_all
from spectandem.block_manager import KVCacheFull
from spectandem.kv_cache import PagedCacheBatch, PagedKVCache
from spectandem.modeling.ops import FUSED_OPS, HOST_OPS


@dataclass
class DraftRequest:
    """The drafter's view of one request."""

    request_id: str
    token_ids: list[int]          # committed tokens (prompt + generated)
    params: SamplingParams
    seed: int
    sample_drafts: bool           # drafts are sampled from q (else deterministic top-k)

    @property
    def committed_len(self) -> int:
        return len(self.token_ids)


class Proposer:
    """What a draft method implements. `catch_up`, `propose` and `remove` every method has; the
    rest is declared here with the answer of a method that cannot, and a method that can
    overrides it (DrafterEngine asks these, never probes for attributes)."""

    # What the verifier must send back per position: None (nothing), "final" (last hidden
    # state after the final norm) or a tuple of HuggingFace hidden-state indices.
    feature_layers: None | str | tuple[int, ...] = None
    # Where it computes (a CUDA device: the in-process drafter link runs it on a stream of its
    # own there); None: the CPU.
    device: torch.device | None = None
    # The EAGLE head, for methods that draft with one (the fused round, verifier/fused.py).
    head: DraftHead | None = None
    # Draft ahead: `ahead_fork`, `ahead_absorb`, `ahead_logprobs` work on forks of a request's
    # state while the verifier is busy. A fork shares the request's cache prefix; the engine
    # frees it with `remove`.
    supports_ahead: bool = False
    # A deferred catch-up run inside the next pass, for argmax chains one graph on the GPU: the
    # next draft's (`catch_up_propose`) and draft ahead's (`catch_up_ahead_chains`).
    has_catch_up_propose: bool = False
    has_catch_up_ahead_chains: bool = False

    def catch_up(self, reqs: list[DraftRequest], num_new: list[int], features: list[torch.Tensor | None]) -> None:
        """Absorb each request's `num_new` newest committed tokens (features [num_new, F])."""
        raise NotImplementedError

    def propose(self, reqs: list[DraftRequest], num_steps: int | None = None) -> DraftNodes:
        """Draft nodes for each request (root excluded); `num_steps` caps the tree depth."""
        raise NotImplementedError

    def remove(self, request_id: str) -> None:
        raise NotImplementedError

    def kv_stats(self) -> dict:
        """Its KV pool's use (num_blocks, block_size, used_blocks), where it has one."""
        return {}

    def warm_up(self, max_batch: int, progress=None) -> int:
        """Captures the CUDA graphs it replays for batches of up to `max_batch` requests, before
        serving -> how many (none for a method without graphs)."""
        return 0

    def request_ended(self, req: DraftRequest) -> None:
        """Called by the engine just before `remove` of a request that ended, with its
        committed tokens (the controlled proposer records them, drafter/controlled.py)."""

    def learn_output(self, token_ids: list[int]) -> None:
        """A served request's prompt and committed tokens, sent with its release by a router in
        benchmark mode (`drafter_release`): the controlled proposer records them; others have
        nothing to learn."""

    def stage_features(self, features: torch.Tensor) -> torch.Tensor:
        """A deferred catch-up's features moved to where the proposer computes."""
        return features

    def fuses_catch_up(self, num_new: int) -> bool:
        """Whether a prompt's catch-up of `num_new` pairs waits for the request's first draft
        (`catch_up_propose` in one graph); only where `has_catch_up_propose`."""
        return False

    def catch_up_propose(self, reqs: list[DraftRequest], num_new: list[int], features: list, num_steps=None):
        """`catch_up` then `propose` in one pass (where `has_catch_up_propose`)."""
        raise NotImplementedError

    def catch_up_group(self, num_new: int) -> int:
        """Which one pass (`catch_up_propose`) a catch-up of `num_new` pairs takes: requests of one
        group draft together (a round's few pairs and a prompt's many pad to different graphs)."""
        return 0

    def ahead_fork(self, src_id: str, dst_id: str) -> None:
        """A new request state `dst_id`, a copy of `src_id`'s (its cache shared, not copied)."""
        raise NotImplementedError

    def ahead_absorb(self, reqs: list[DraftRequest], num_new: list[int]) -> None:
        """Like catch_up, without target features: the method's own predictions stand in."""
        raise NotImplementedError

    def ahead_logprobs(self, request_ids: list[str]) -> torch.Tensor:
        """[B, vocab_size] log-probabilities of each request's next token (target ids; -inf
        for tokens the draft cannot propose)."""
        raise NotImplementedError

    def supports_ahead_chains(self, batch: int) -> bool:
        """Whether `batch` chains draft ahead in one pass (`ahead_chains`)."""
        return False

    def ahead_chains(self, reqs: list[DraftRequest], chains: list[list[int]], width: int) -> list[dict]:
        """Per request (deterministic drafts; all chains of one length m), the outcome cache of
        the chain being verified: {accepted path + (bonus,): (DraftNodes, row)}, at most `width`
        outcomes (drafter/ahead_chains.py)."""
        raise NotImplementedError

    def catch_up_ahead_chains(self, reqs: list[DraftRequest], num_new: list[int], features: list,
                              chains: list[list[int]], width: int) -> list[dict]:
        """`catch_up` then `ahead_chains` in one pass (where `has_catch_up_ahead_chains`)."""
        raise NotImplementedError


def ahead_slots(cfg: SpecConfig, max_slots: int) -> int:
    """Extra cache slots for draft-ahead forks: per request, one per tree node and one per outcome."""
    from spectandem.memory import ahead_slots as slots

    return slots(cfg, max_slots)


def paged_cache(num_layers, max_slots, num_kv_heads, max_len, head_dim, dtype, device, kv_blocks, block_size, cfg):
    """The proposer's cache: `kv_blocks`, or by default every request at full length plus room
    for draft-ahead forks (spectandem/memory.py draft_pool_blocks); slots for the forks on top."""
    from spectandem.memory import draft_pool_blocks

    num_blocks = kv_blocks or draft_pool_blocks(cfg, max_slots, max_len, block_size)
    return PagedKVCache(num_layers, max_slots + ahead_slots(cfg, max_slots), num_kv_heads, max_len, head_dim,
                        dtype, device, num_blocks=num_blocks, block_size=block_size)


class RequestSlots:
    """Slot allocation for a proposer's KV cache."""

    def __init__(self, num_slots: int):
        self.free = list(range(num_slots - 1, -1, -1))
        self.of: dict[str, int] = {}

    def get(self, request_id: str) -> int:
        if request_id not in self.of:
            if not self.free:
                raise RuntimeError(f"drafter KV cache is full ({len(self.of)} requests)")
            self.of[request_id] = self.free.pop()
        return self.of[request_id]

    def release(self, request_id: str) -> int | None:
        slot = self.of.pop(request_id, None)
        if slot is not None:
            self.free.append(slot)
        return slot


def pad_rows(rows: list[torch.Tensor], fill) -> torch.Tensor:
    """Right-pads 1-D or 2-D tensors along dim 0 into [B, max_len, ...]."""
    n = max(r.shape[0] for r in rows)
    out = rows[0].new_full((len(rows), n, *rows[0].shape[1:]), fill)
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


class ScratchTree:
    """Index arithmetic of tree steps over a KV cache whose first `base[b]` entries are real.

    Step i (1-based) writes branch j at cache index base + (i-1)*k + j, RoPE position
    base + i - 1 + pos_offset; branch j may attend to every real entry and to the scratch
    entries `visible[b, j]` marks.
    """

    # Steps whose physical rows a CPU tree works out at once (`_cache_batch`).
    HOST_ROWS_AHEAD = 8

    def __init__(self, cache: PagedKVCache, slots: torch.Tensor, base: torch.Tensor, k: int, pos_offset: int):
        self.cache, self.slots, self.base, self.k, self.pos_offset = cache, slots, base, k, pos_offset
        self._rows: torch.Tensor | None = None   # on the CPU: the physical rows of entries 0..n-1 of each slot

    def batch(self, step: int, visible: torch.Tensor):
        b, k = self.base.shape[0], self.k
        dev = self.base.device
        write = self.base[:, None] + (step - 1) * k + torch.arange(k, device=dev)        # [B, k]
        positions = (self.base[:, None] + step - 1 + self.pos_offset).expand(b, k)       # [B, k]
        span = int(self.base.max()) + step * k
        cols = torch.arange(span, device=dev)
        if k == 1 and bool(visible.all()):   # a chain sees every entry before its own: the same mask
            mask = cols[None, None, :] < (self.base + step)[:, None, None]
            return self._cache_batch(write, span), positions, mask
        mask = (cols[None, None, :] < self.base[:, None, None]).expand(b, k, span).clone()
        rel = cols[None, :] - self.base[:, None]                                           # [B, span]
        in_scratch = (rel >= 0) & (rel < step * k)
        vis = visible.gather(2, rel.clamp(0, step * k - 1)[:, None, :].expand(b, k, span))
        mask |= vis & in_scratch[:, None, :]
        return self._cache_batch(write, span), positions, mask

    def _cache_batch(self, write: torch.Tensor, span: int) -> PagedCacheBatch:
        """`cache.batch(slots, write, span)`. On the CPU the rows of HOST_ROWS_AHEAD steps past
        this one are worked out once (`host_span_rows_np`: a table read per block), and each
        step takes its read rows, and its write rows among them, from those: the steps' entries
        were reserved before the first, so the tables do not change under them."""
        cache = self.cache
        if not cache.host_indexed:
            return cache.batch(self.slots, write, span)
        if self._rows is None or self._rows.shape[1] < span:
            ahead = min(cache.max_len, span + self.HOST_ROWS_AHEAD * self.k)
            self._rows = torch.from_numpy(cache.host_span_rows_np(self.slots.tolist(), ahead))
        read = self._rows[:, :span]
        return PagedCacheBatch(cache, read.gather(1, write), read)


class EagleProposer(Proposer):
    """EAGLE-1/2 and EAGLE-3 heads. Per request: a head KV slot holding one entry per pair
    (feature p, token p + 1) absorbed so far, i.e. committed_len - 1 entries, and the last
    catch-up row's output hidden and logits. With `cuda_graphs`, short catch-ups and argmax
    chains (topk 1) replay one CUDA graph per shape (drafter/graphs.py)."""

    def __init__(self, head: DraftHead, cfg: SpecConfig, max_slots: int, max_len: int,
                 kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = False):
        self.head, self.cfg = head, cfg
        self.feature_layers = head.spec.aux_layers if head.spec.kind == "eagle3" else "final"
        s = head.spec
        self.dtype = next(head.parameters()).dtype
        self.device = next(head.parameters()).device
        self.cache = paged_cache(1, max_slots, s.num_kv_heads, max_len, s.head_dim, self.dtype, self.device,
                            kv_blocks, block_size, cfg)
        self.slots = RequestSlots(self.cache.num_slots)
        self.cache_len: dict[str, int] = {}
        self.last_hidden: dict[str, torch.Tensor] = {}   # [H]
        self.last_logits: dict[str, torch.Tensor] = {}   # [Vd]
        if cuda_graphs:   # the GPU fast path: fused kernels in the head's steps too
            self.head = head = head.with_ops(FUSED_OPS)
        elif self.device.type == "cpu":   # fewer, larger ops: on the CPU each op's dispatch counts
            self.head = head = head.with_ops(HOST_OPS)
        self.chain = ChainGraphs(head, self.cache) if cuda_graphs else None
        self.catch_up_graphs = CatchUpGraphs(head, self.cache) if cuda_graphs else None
        self.ahead_graphs = AheadChainGraphs(head, self.cache, graph=cuda_graphs) if cfg.topk == 1 else None

    @torch.no_grad()
    def warm_up(self, max_batch, progress=None):
        """Every graph of a chain, a draft ahead and a catch-up at every batch bucket up to
        `max_batch`'s and every span bucket up to WARM_MAX_SPAN entries (longer contexts capture
        theirs when they first come): the chains of `num_steps` and of short:2, each from a
        catch-up run before it or with a round's catch-up inside, the first chain after a
        prefill, and the draft aheads of full chains. A graph captured while serving stalls
        every request in the batch for its capture."""
        if self.chain is None:
            return 0
        spans = warm_spans(self.cache.max_len, WARM_MAX_SPAN)
        captured = 0
        if self.cfg.topk == 1:
            steps = [n for n in dict.fromkeys((self.cfg.num_steps, 2)) if 2 <= n <= self.cfg.num_steps]
            if steps:
                captured += self.chain.warm_up(self.chain.warm_keys(max_batch, steps, spans), progress, "draft chain")
            if self.ahead_graphs is not None and self.cfg.ahead_width:
                keys = self.ahead_graphs.warm_keys(max_batch, spans, self.cfg.max_draft_nodes, self.cfg.ahead_width)
                captured += self.ahead_graphs.warm_up(keys, progress, "draft-ahead")
        keys = self.catch_up_graphs.warm_keys(max_batch, spans)
        return captured + self.catch_up_graphs.warm_up(keys, progress, "catch-up")

    @torch.no_grad()
    def catch_up(self, reqs, num_new, features):
        """Writes K/V for every new pair but computes the layer's attention output, o-proj,
        MLP and norms only for each request's last new pair (the only row whose logits are
        sampled). Exact because the head has one layer: K/V depend only on each row's input.
        With `cuda_graphs`, catch-ups of at most max(PAIR_BUCKETS) pairs per request replay a
        CUDA graph (drafter/graphs.py); longer ones (prefills) run eagerly."""
        slots, base, token_ids, feats = self._prepare_catch_up(reqs, num_new, features)
        graphs = self.catch_up_graphs
        if graphs is not None and graphs.supports(len(reqs), max(num_new)):
            out, logits = graphs.run(slots, base, token_ids, feats)
        else:   # the same computation unpadded, eagerly
            inp = catch_up_inputs(self.cache, slots, base, token_ids, feats, len(reqs), max(num_new))
            out, logits = catch_up_forward(self.head, self.cache, inp, max(b + n for b, n in zip(base, num_new)))
        self._record(reqs, [b0 + n for b0, n in zip(base, num_new)], out[:, 0], logits[:, 0])

    def _prepare_catch_up(self, reqs, num_new, features, room: int = 0):
        """Checks a catch-up's arguments and makes the room: each slot trimmed to its absorbed
        entries (last round's draft scratch goes) and reserved for n more, plus `room` (scratch a
        pass after it writes) -> (slots, base, each request's new tokens, features on the
        proposer's device in its dtype)."""
        slots = [self.slots.get(r.request_id) for r in reqs]
        base = [self.cache_len.get(r.request_id, 0) for r in reqs]
        token_ids = []
        for r, n, b0, f in zip(reqs, num_new, base, features):
            toks = r.token_ids
            assert n >= 1 and b0 + n == len(toks) - 1, (r.request_id, b0, n, len(toks))
            assert f.shape[0] == n, "one feature row per new pair"
            token_ids.append(toks[-n:])
        self.cache.trim_many(slots, base)
        self.cache.reserve_many(slots, [b0 + n + room for b0, n in zip(base, num_new)])
        return slots, base, token_ids, to_device_all(features, self.device, self.dtype)

    def _record(self, reqs, cache_lens: list[int], hidden: torch.Tensor, logits: torch.Tensor) -> None:
        """A catch-up is in: each request's head-cache length, and the head's hidden [B, H] and
        logits [B, Vd] for its last pair."""
        for r, n, h, lg in zip(reqs, cache_lens, hidden.unbind(0), logits.unbind(0)):   # one call for the views
            self.cache_len[r.request_id] = n
            self.last_hidden[r.request_id] = h
            self.last_logits[r.request_id] = lg

    def record_catch_up(self, request_id: str, num_new: int, last_hidden: torch.Tensor,
                        last_logits: torch.Tensor) -> None:
        """Records a catch-up that ran outside `catch_up` on this proposer's cache (the fused graph
        round, verifier/fused.py): `num_new` more pairs are in the request's slot, and
        last_hidden [H], last_logits [Vd] are the head's outputs for the last of them."""
        self.cache_len[request_id] += num_new
        self.last_hidden[request_id] = last_hidden
        self.last_logits[request_id] = last_logits

    supports_ahead = True
    has_catch_up_propose = has_catch_up_ahead_chains = True

    def stage_features(self, features: torch.Tensor) -> torch.Tensor:
        """Target features on this proposer's device and dtype (what `catch_up` reads)."""
        return to_device(features, self.device, self.dtype)   # as they come where already there

    def ahead_fork(self, src_id, dst_id):
        self.cache.fork(self.slots.of[src_id], self.slots.get(dst_id), self.cache_len[src_id])
        self.cache_len[dst_id] = self.cache_len[src_id]
        self.last_hidden[dst_id] = self.last_hidden[src_id]
        self.last_logits[dst_id] = self.last_logits[src_id]

    @torch.no_grad()
    def ahead_absorb(self, reqs, num_new):
        """One pair per step, (head output of the previous pair, next token): the pairs a tree
        step feeds, so a fork that absorbs a draft path sees what the tree's drafting saw."""
        todo = [(r, n) for r, n in zip(reqs, num_new) if n > 0]
        for step in range(max((n for _, n in todo), default=0)):
            live = [(r, n) for r, n in todo if step < n]
            ids = [r.request_id for r, _ in live]
            slots = torch.tensor([self.slots.of[i] for i in ids], device=self.device)
            base = torch.tensor([self.cache_len[i] for i in ids], device=self.device)
            for i, b0 in zip(ids, base.tolist()):
                self.cache.reserve(self.slots.of[i], b0 + 1)
            toks = torch.tensor([[r.token_ids[r.committed_len - n + step]] for r, n in live], device=self.device)
            hidden = torch.stack([self.last_hidden[i] for i in ids])[:, None]
            span = int(base.max()) + 1
            mask = torch.arange(span, device=self.device)[None, None, :] <= base[:, None, None]
            rows = torch.zeros(len(ids), 1, dtype=torch.long, device=self.device)
            out = self.head.run(toks, hidden, base[:, None], self.cache.batch(slots, base[:, None], span), mask, rows)
            logits = self.head.logits(out)
            for j, i in enumerate(ids):
                self.cache_len[i] += 1
                self.last_hidden[i], self.last_logits[i] = out[j, 0], logits[j, 0]

    def supports_ahead_chains(self, batch: int) -> bool:
        return self.ahead_graphs is not None and self.ahead_graphs.supports(batch)

    @torch.no_grad()
    def ahead_chains(self, reqs, chains, width):
        """Requests whose scratch would pass the cache's max_len get no outcomes."""
        m = len(chains[0])
        assert all(len(c) == m for c in chains) and not any(r.sample_drafts for r in reqs)
        steps = self.cfg.max_draft_nodes   # a chain's length
        need = scratch_entries(m, steps, width)
        fit = [i for i, r in enumerate(reqs) if self.cache_len[r.request_id] + need <= self.cache.max_len]
        out: list[dict] = [{} for _ in reqs]
        if not fit or width == 0:
            return out
        ids = [reqs[i].request_id for i in fit]
        base = [self.cache_len[i] for i in ids]
        for i, b0 in zip(ids, base):
            self.cache.reserve(self.slots.of[i], b0 + need)
        first = torch.stack([self.last_logits[i] for i in ids])
        hidden0 = torch.stack([self.last_hidden[i] for i in ids])[:, None]
        packed = self.ahead_graphs.run([self.slots.of[i] for i in ids], base, first, hidden0,
                                       [chains[i] for i in fit], steps, width)
        for i, cache in zip(fit, outcome_trees(packed, [chains[i] for i in fit], self.cfg.num_draft_tokens)):
            out[i] = cache
        return out

    @torch.no_grad()
    def catch_up_ahead_chains(self, reqs, num_new, features, chains, width):
        """`catch_up(reqs, num_new, features)` then `ahead_chains(reqs, chains, width)`, in one
        pass on the device (`AheadChainGraphs.run_caught_up`) when it fits: a catch-up within the
        pair buckets and room for every request's scratch. Otherwise the two calls, in turn; if
        the cache has no room for the scratch, the catch-up still runs before KVCacheFull."""
        m, steps = len(chains[0]), self.cfg.max_draft_nodes
        need = scratch_entries(m, steps, width)
        base = [self.cache_len.get(r.request_id, 0) for r in reqs]
        graphs = self.ahead_graphs
        if (graphs is None or width == 0 or not graphs.supports(len(reqs), max(num_new))
                or any(b0 + n + need > self.cache.max_len for b0, n in zip(base, num_new))):
            self.catch_up(reqs, num_new, features)
            return self.ahead_chains(reqs, chains, width)
        assert all(len(c) == m for c in chains) and not any(r.sample_drafts for r in reqs)
        try:
            slots, base, token_ids, feats = self._prepare_catch_up(reqs, num_new, features, room=need)
        except KVCacheFull:
            self.catch_up(reqs, num_new, features)
            raise
        caught = [b0 + n for b0, n in zip(base, num_new)]
        packed, hidden, logits = graphs.run_caught_up(slots, caught, token_ids, feats, chains, steps, width)
        self._record(reqs, caught, hidden[:, 0], logits)
        return outcome_trees(packed, chains, self.cfg.num_draft_tokens)

    @torch.no_grad()
    def ahead_logprobs(self, request_ids):
        lp = torch.log_softmax(torch.stack([self.last_logits[i] for i in request_ids]).float(), -1)
        full = lp.new_full((len(request_ids), self.head.spec.vocab_size), float("-inf"))
        full[:, self.head.draft_to_target(torch.arange(lp.shape[-1], device=lp.device))] = lp
        return full

    @torch.no_grad()
    def fuses_catch_up(self, num_new: int) -> bool:
        """Whether one request's catch-up of `num_new` pairs runs inside its next chain's graph
        (`catch_up_propose`)."""
        return self.chain is not None and self.chain.supports(1, self.cfg.topk, False, self.cfg.num_steps, num_new)

    def catch_up_group(self, num_new):
        return 0 if num_new <= PAIR_BUCKETS[-1] else 1

    def catch_up_propose(self, reqs, num_new, features, num_steps=None):
        """`catch_up(reqs, num_new, features)` then `propose(reqs, num_steps)`, in one pass on the
        device (`ChainGraphs.propose_caught_up`) for argmax chains within the graphs' buckets;
        otherwise the two calls, in turn."""
        steps = min(num_steps or self.cfg.num_steps, self.cfg.num_steps)
        chain = self.chain
        if chain is None or not chain.supports(len(reqs), self.cfg.topk, reqs[0].sample_drafts, steps, max(num_new)):
            self.catch_up(reqs, num_new, features)
            return self.propose(reqs, num_steps)
        # The room propose reserves for a chain's scratch.
        slots, base, token_ids, feats = self._prepare_catch_up(reqs, num_new, features,
                                                               room=max(0, self.cfg.num_steps - 1))
        caught = [b0 + n for b0, n in zip(base, num_new)]
        tree, hidden, logits = chain.propose_caught_up(slots, caught, token_ids, feats, steps,
                                                       self.cfg.num_draft_tokens)
        self._record(reqs, caught, hidden[:, 0], logits)
        return tree

    @torch.no_grad()
    def propose(self, reqs, num_steps=None):
        ids = [r.request_id for r in reqs]
        slots = to_device([self.slots.of[i] for i in ids], self.device)
        base_list = [self.cache_len[i] for i in ids]
        base = to_device(base_list, self.device)
        first = torch.stack([self.last_logits[i] for i in ids])                           # [B, Vd]
        hidden0 = torch.stack([self.last_hidden[i] for i in ids])[:, None]                # [B, 1, H]
        k = self.cfg.topk
        for i, b0 in zip(ids, base_list):
            self.cache.reserve(self.slots.of[i], b0 + max(0, self.cfg.num_steps - 1) * k)
        steps = min(num_steps or self.cfg.num_steps, self.cfg.num_steps)
        if self.chain is not None and self.chain.supports(len(ids), k, reqs[0].sample_drafts, steps):
            return self.chain.propose([self.slots.of[i] for i in ids], [self.cache_len[i] for i in ids], first,
                                      hidden0, steps,
                                      self.cfg.num_draft_tokens)
        scratch = ScratchTree(self.cache, slots, base, k, pos_offset=0)
        prev = {"out": hidden0}

        def step(i, token_ids, parent_rows, visible):
            cache, positions, mask = scratch.batch(i, visible)
            parent_h = prev["out"].gather(1, parent_rows[..., None].expand(-1, -1, hidden0.shape[-1]))
            rows = torch.arange(k, device=self.device).expand(len(ids), k)
            out = self.head.run(token_ids, parent_h, positions, cache, mask, rows)        # [B, k, H]
            prev["out"] = out
            return self.head.logits(out)

        return draft_tree(reqs, first, step, self.head.draft_to_target, self.cfg, self.head.spec.vocab_size, num_steps)

    def kv_stats(self) -> dict:
        return self.cache.stats()

    def remove(self, request_id):
        slot = self.slots.release(request_id)
        if slot is not None:
            self.cache.free(slot)
        for d in (self.cache_len, self.last_hidden, self.last_logits):
            d.pop(request_id, None)

