"""Draft ahead for argmax chains (topk 1, deterministic drafts) in one pass on the device.

The general draft ahead (drafter/ahead.py) forks the request's state once per tree node,
absorbs each node's path one eager head step at a time, ranks outcomes on the host and drafts a
tree per outcome: about 31 ms a round on the 8B-shaped head, five times a verify. For a chain
the same answer costs two short chains of head steps, here in one computation (one CUDA graph
per shape on the GPU):

1. Forced chain: the head absorbs the chain being verified, d_1..d_m, one step per token, each
   fed the previous step's output hidden (what the chain's own drafting fed). Step k's output
   h_k and logits are the draft's state after node k; depth 0's are the catch-up's.
2. Ranking: the outcome (k, b) is "accept d_1..d_k, then the bonus b", b != d_{k+1}; its score
   is sum_{i<=k} log q_{i-1}(d_i) + log q_k(b). The `width` best over every depth (top width + 1
   tokens per depth) are chosen on the device.
3. Outcome chains: each chosen outcome absorbs b (hidden h_k) and drafts its next chain of S
   argmax tokens: S head steps, every outcome of every request batched.

Cache layout of a request's slot (base = entries before the round, R = base + m):
  [0, base) committed pairs | [base, R) the forced chain, d_i at base + i - 1 |
  outcome o's step i at R + i * width + o, RoPE position base + k_o + i.
Outcome o at step i sees the committed entries, the forced chain's first k_o entries and its
own entries of steps 0..i, so it computes what a fork that absorbed its path would (the general
path's numbers, up to summation order). Everything past base is scratch: the request's next
catch-up trims it (EagleProposer.catch_up).

The forced chain's steps feed given tokens, so their logits are not needed inside the loop: the
lm_head runs once over the m + 1 hiddens after it (one read of its weights, not m).

With a catch-up (`run_caught_up`: a hit's deferred catch-up, drafter/ahead.py) the pass first
absorbs the verdict's pairs (feature, token) as `EagleProposer.catch_up` does: K/V for every pair,
the rest of the layer for the last one. Its output hidden starts the forced chain and its logits
are row 0 of that one lm_head. One graph, one host preparation and one copy in, not two of each
(a catch-up graph, then an ahead graph): the drafter's host time is what a round waits for when
the drafter is on its own GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from drafter.graphs import (PAIR_BUCKETS, HeadGraphs, PassStart, _rows_into, catch_up_columns, catch_up_in_pass,
                            index_views, pack_parts, padded_features, padding_index_fields)
from drafter.tree import DraftNodes, chain_tree
from spectandem.cuda_graphs import BATCH_BUCKETS, batch_bucket, capture_graph, span_bucket
from spectandem.devices import to_device, to_host
from spectandem.kv_cache import PagedCacheBatch, PagedKVCache


def scratch_entries(chain_len: int, num_steps: int, width: int) -> int:
    """Entries past a request's committed pairs that one chain draft ahead writes."""
    return chain_len + width * num_steps


@dataclass
class AheadInputs(PassStart):
    """One draft ahead at static shape: Bc rows (the last Bc - B padding); its start (PassStart)
    is the forced chain's."""

    base: torch.Tensor           # [Bc] int64 head-cache entries per request after the catch-up (padding: 0)
    chain: torch.Tensor          # [Bc, m] int64 target ids of the chain being verified (padding: 0)
    forced_write: torch.Tensor   # [m, Bc, 1] int64 physical rows forced step i writes
    outcome_write: torch.Tensor  # [S, Bc, W] int64 physical rows outcome step i writes
    read_rows: torch.Tensor      # [Bc, span] int64 physical rows of logical entries 0..span-1

    ROW_FIELDS = frozenset({"forced_write", "outcome_write", "read_rows", "cu_write"})


def ahead_index_fields(rows: int, span: int, m: int, num_steps: int, width: int,
                       pairs: int) -> list[tuple[str, tuple[int, ...]]]:
    """A draft ahead's int64 input fields in their order in one packed buffer (`ahead_index_np`),
    with their shapes; the catch-up's three last where it runs one (pairs > 0)."""
    out = [("base", (rows,)), ("chain", (rows, m)), ("forced_write", (m, rows, 1)),
           ("outcome_write", (num_steps, rows, width)), ("read_rows", (rows, span))]
    if pairs:
        out += [("cu_new", (rows,)), ("cu_tokens", (rows, pairs)), ("cu_write", (rows, pairs))]
    return out


def ahead_index_np(cache: PagedKVCache, slots: list[int], base: list[int], chains: list[list[int]], num_steps: int,
                   width: int, rows: int, span: int, token_ids: list[list[int]] | None = None, pairs: int = 0,
                   out: np.ndarray | None = None) -> np.ndarray:
    """A draft ahead's index inputs (`ahead_inputs`) packed on the host, worked out in numpy over
    the cache's host tables: int64 [n] in `ahead_index_fields` order, written into `out` if
    given. token_ids: per request its catch-up pairs' tokens (pairs > 0), ending at base."""
    b, m = len(chains), len(chains[0])
    assert rows >= b and max(base) + scratch_entries(m, num_steps, width) <= span <= cache.max_len
    real = (np.arange(rows) < b)[:, None]
    base_np = np.array(list(base) + [0] * (rows - b), dtype=np.int64)
    trash = cache.trash_index
    logical = [
        np.where(real, base_np[:, None] + np.arange(m), trash),                        # forced steps
        np.where(real, base_np[:, None] + m + np.arange(num_steps * width), trash)]    # outcome steps
    chain_np = np.zeros((rows, m), dtype=np.int64)
    chain_np[:b] = chains
    if pairs:
        new_np, tok_np, pair_entries = catch_up_columns(token_ids, rows, pairs, base_np, trash)
        logical.append(pair_entries)
    phys = cache.host_rows_np(list(slots) + [slots[0]] * (rows - b), np.concatenate(logical, 1))
    forced, outcome, pair_rows = np.split(phys, np.cumsum([m, num_steps * width]), axis=1)
    read = cache.host_span_rows_np(list(slots), span, rows)                          # every column, padding trash
    parts = [base_np, chain_np, forced.T, outcome.reshape(rows, num_steps, width).transpose(1, 0, 2), read]
    if pairs:
        parts += [new_np, tok_np, pair_rows]
    return pack_parts(parts, out)


def ahead_inputs(cache: PagedKVCache, slots: list[int], base: list[int], chains: list[list[int]], num_steps: int,
                 width: int, rows: int, span: int, start: tuple | None = None,
                 catch_up: tuple | None = None) -> AheadInputs:
    """Per request: slot, base (head-cache entries once caught up) and its chain (target ids, m
    each). The slots must already hold base + scratch_entries(m, S, W). Then either
    start = (first_logits [B, Vd], hidden [B, 1, H]) of a catch-up already run, or
    catch_up = (token_ids: per request its n_b >= 1 pairs' tokens, features: per request [n_b, F]
    on the cache's device in the head's dtype, pairs: Tc >= max n_b), the pairs ending at base.
    The index inputs are worked out on the host (`ahead_index_np`) and cross in one copy; the
    graphs copy the same packed buffer into their own (AheadChainGraphs._run)."""
    assert (start is None) != (catch_up is None)
    token_ids, pairs = (None, 0) if catch_up is None else (catch_up[0], catch_up[2])
    packed = ahead_index_np(cache, slots, base, chains, num_steps, width, rows, span, token_ids, pairs)
    views = index_views(to_device(torch.from_numpy(packed), cache.k[0].device),
                        ahead_index_fields(rows, span, len(chains[0]), num_steps, width, pairs))
    inp = AheadInputs(**views)
    if catch_up is not None:
        inp.cu_features = padded_features(catch_up[1], rows, pairs)
        return inp
    first_logits, hidden = start
    inp.first_logits = first_logits.new_zeros(rows, first_logits.shape[-1])
    inp.hidden = hidden.new_zeros(rows, *hidden.shape[1:])
    _rows_into(inp.first_logits, list(first_logits))
    _rows_into(inp.hidden, list(hidden))
    return inp


def ahead_forward(head, cache: PagedKVCache, inp: AheadInputs,
                  target_to_draft: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The module docstring's three steps -> (packed [Bc, W, 3 + S] int64: per outcome its depth
    k, its bonus b (target id), 1 if it is an outcome (a finite score) else 0, then its chain's S
    target ids; the catch-up's hidden [Bc, 1, H] and logits [Bc, Vd] float32). `target_to_draft`
    [V] int64: each target id's draft index, -1 where the draft has none."""
    rows, span = inp.read_rows.shape
    m = inp.chain.shape[1]
    num_steps, _, width = inp.outcome_write.shape
    dev = inp.base.device
    cols = torch.arange(span, device=dev)
    query = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    # 0. The catch-up, when it runs here: the pairs end at base (EagleProposer.catch_up's layout).
    h = catch_up_in_pass(head, cache, inp) if inp.cu_tokens is not None else inp.hidden
    # 1. The forced chain: its steps feed given tokens, so the logits wait for one lm_head after it.
    hiddens = [h]
    for i in range(1, m + 1):
        mask = cols[None, None, :] < (inp.base + i)[:, None, None]                        # [Bc, 1, span]
        batch = PagedCacheBatch(cache, inp.forced_write[i - 1], inp.read_rows)
        h = head.run(inp.chain[:, i - 1: i], h, (inp.base + i - 1)[:, None], batch, mask, query)
        hiddens.append(h)
    hid = torch.cat(hiddens, 1)                                                            # [Bc, m + 1, H]
    if inp.cu_tokens is not None:
        logits = head.logits(hid)                                                          # [Bc, m + 1, Vd]
    else:
        logits = torch.cat([inp.first_logits[:, None], head.logits(hid[:, 1:])], 1)
    logq = torch.log_softmax(logits.float(), -1)                                           # [Bc, m + 1, Vd]
    # 2. Ranking.
    neg = float("-inf")   # a Python scalar: no host -> device copy inside a capture
    d = target_to_draft[inp.chain]                                                         # [Bc, m]
    step_lp = torch.where(d >= 0, logq[:, :m].gather(2, d.clamp(min=0)[..., None])[..., 0], neg)
    reach = torch.cat([logq.new_zeros(rows, 1), step_lp.cumsum(1)], 1)                    # [Bc, m + 1]
    top_lp, top_id = logq.topk(min(width + 1, logq.shape[-1]), -1)                         # [Bc, m + 1, W + 1]
    top_tok = head.draft_to_target(top_id)
    child = torch.cat([inp.chain, inp.chain.new_full((rows, 1), -1)], 1)                   # [Bc, m + 1]
    cand = torch.where(top_tok == child[..., None], neg, reach[..., None] + top_lp)
    score, pick = cand.flatten(1).topk(width, -1)                                          # [Bc, W]
    depth = pick // top_id.shape[-1]
    bonus = top_tok.flatten(1).gather(1, pick)
    # 3. Outcome chains.
    h = hid.gather(1, depth[..., None].expand(-1, -1, hid.shape[-1]))                     # [Bc, W, H]
    prefix = cols[None, None, :] < (inp.base[:, None] + depth)[..., None]                  # [Bc, W, span]
    rel = cols[None, :] - (inp.base + m)[:, None]                                          # [Bc, span]
    own = (rel >= 0)[:, None, :] & ((rel % width)[:, None, :] == torch.arange(width, device=dev)[None, :, None])
    own_step = (rel // width)[:, None, :]
    qrows = torch.arange(width, device=dev).expand(rows, width)
    tok, chain_out = bonus, []
    for i in range(num_steps):
        mask = prefix | (own & (own_step <= i))
        batch = PagedCacheBatch(cache, inp.outcome_write[i], inp.read_rows)
        h = head.run(tok, h, inp.base[:, None] + depth + i, batch, mask, qrows)
        tok = head.draft_to_target(head.logits(h).argmax(-1))                              # [Bc, W]
        chain_out.append(tok)
    packed = torch.stack([depth, bonus, (score > neg).long()] + chain_out, -1)
    return packed, hid[:, :1], logits[:, 0].float()


class AheadChainGraphs(HeadGraphs):
    """Chain draft ahead at bucketed static shapes, one CUDA graph per (Bc, span, m, S, W, Tc)
    (Tc = 0: no catch-up inside; else the catch-up's pairs padded up to `PAIR_BUCKETS`), captured
    lazily. With `graph=False` the same padded computation runs eagerly (the CPU path)."""

    def __init__(self, head, cache: PagedKVCache, graph: bool = True,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, pair_buckets: tuple[int, ...] = PAIR_BUCKETS):
        super().__init__(head, cache, graph, batch_buckets)
        spec = head.spec
        t2d = torch.full((spec.vocab_size,), -1, dtype=torch.long, device=self.device)
        draft_ids = torch.arange(spec.draft_vocab_size, device=self.device)
        t2d[head.draft_to_target(draft_ids)] = draft_ids
        self.target_to_draft = t2d
        self.pair_buckets = tuple(sorted(pair_buckets))

    def supports(self, batch: int, max_new: int = 0) -> bool:
        """Batches up to the largest batch bucket; with a catch-up inside (max_new pairs at most
        per request), at most the largest pair bucket."""
        return (batch_bucket(batch, self.batch_buckets) is not None
                and (max_new == 0 or batch_bucket(max_new, self.pair_buckets) is not None))

    def run(self, slots: list[int], base: list[int], first_logits: torch.Tensor, hidden: torch.Tensor,
            chains: list[list[int]], num_steps: int, width: int) -> torch.Tensor:
        """From a catch-up already run (`ahead_inputs`'s start) -> `ahead_forward`'s packed
        [B, W, 3 + S] on the host."""
        return self._run(slots, base, chains, num_steps, width, 0, start=(first_logits, hidden))[0]

    def run_caught_up(self, slots: list[int], base: list[int], token_ids: list[list[int]],
                      features: list[torch.Tensor], chains: list[list[int]], num_steps: int,
                      width: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The catch-up of each request's pairs (token_ids, features: `ahead_inputs`'s catch_up),
        then the draft ahead; base counts the entries once caught up -> (packed [B, W, 3 + S] on
        the host, the catch-up's hidden [B, 1, H] and logits [B, Vd] on the device, not aliased
        by any static buffer)."""
        pairs = batch_bucket(max(len(t) for t in token_ids), self.pair_buckets)
        packed, hidden, logits = self._run(slots, base, chains, num_steps, width, pairs,
                                           catch_up=(token_ids, features, pairs))
        return packed, hidden.clone(), logits.clone()

    def _run(self, slots, base, chains, num_steps, width, pairs, start=None, catch_up=None):
        b, m = len(chains), len(chains[0])
        rows = batch_bucket(b, self.batch_buckets)
        span = span_bucket(max(base) + scratch_entries(m, num_steps, width), self.cache.max_len)
        key = (rows, span, m, num_steps, width, pairs)
        if not self.graph or key not in self._captured:
            inp = ahead_inputs(self.cache, slots, base, chains, num_steps, width, rows, span, start, catch_up)
        if not self.graph:
            packed, hidden, logits = ahead_forward(self.head, self.cache, inp, self.target_to_draft)
        else:
            if key not in self._captured:
                self._capture_on_first_use(key, inp)
            static, flat, graph, (packed, hidden, logits) = self._captured[key]
            # The index inputs packed on the host straight into pinned memory, in one copy into
            # the graph's buffer (its fields are views of it); then the features or the start.
            host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=True)
            ahead_index_np(self.cache, slots, base, chains, num_steps, width, rows, span,
                           None if catch_up is None else catch_up[0], pairs, out=host.numpy())
            flat.copy_(host, non_blocking=True)
            if catch_up is not None:
                _rows_into(static.cu_features, catch_up[1])
            else:
                _rows_into(static.first_logits, list(start[0]))
                _rows_into(static.hidden, list(start[1]))
            graph.replay()
        return to_host(packed[:b])[0], hidden[:b], logits[:b]

    def warm_keys(self, max_batch: int, spans: list[int], num_steps: int, width: int) -> list[tuple]:
        """The keys of the draft aheads a drafter of at most `max_batch` requests runs over `spans`
        for full chains of `num_steps` drafts and `width` outcomes: from a catch-up already run or
        after a hit's catch-up (`PAIR_BUCKETS`)."""
        return [(rows, span, num_steps, num_steps, width, pairs) for rows in self._warm_rows(max_batch)
                for span in spans for pairs in (0, *self.pair_buckets)]

    def padding_inputs(self, key: tuple) -> AheadInputs:
        rows, span, m, num_steps, width, pairs = key
        fields_ = padding_index_fields(AheadInputs, ahead_index_fields(rows, span, m, num_steps, width, pairs),
                                       self.cache.trash_row, self.device)
        return AheadInputs(**fields_, **self._pass_start(rows, pairs))

    def _capture(self, key: tuple, like: AheadInputs) -> None:
        rows, span, m, num_steps, width, pairs = key
        static = like.like_padding(self.cache.trash_row)
        # The index fields as views of one buffer, padding as like_padding has it.
        layout = ahead_index_fields(rows, span, m, num_steps, width, pairs)
        flat = torch.empty(sum(int(np.prod(shape)) for _, shape in layout), dtype=torch.int64, device=self.device)
        for name, view in index_views(flat, layout).items():
            view.copy_(getattr(static, name))
            setattr(static, name, view)
        if pairs:
            static.cu_features = self._features(rows, pairs, static.cu_features)
        s = self.head.spec
        outs = [self._output("packed", (rows, width, 3 + num_steps), torch.long),
                self._output("hidden", (rows, 1, s.hidden_size), next(self.head.parameters()).dtype),
                self._output("logits", (rows, s.draft_vocab_size), torch.float32)]

        def body():
            for buf, t in zip(outs, ahead_forward(self.head, self.cache, static, self.target_to_draft)):
                buf.copy_(t)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._captured[key] = (static, flat, capture_graph(body, self.pool, self.device, warmup=1), tuple(outs))


def outcome_trees(packed: torch.Tensor, chains: list[list[int]], num_draft_tokens: int) -> list[dict]:
    """`ahead_forward`'s host output [B, W, 3 + S] and each request's chain being verified ->
    per request {accepted path + (bonus,): (DraftNodes, row)} over one DraftNodes of every outcome."""
    b, width, _ = packed.shape
    tree = chain_tree(packed[..., 3:].reshape(b * width, -1), num_draft_tokens)
    out = []
    for i, chain in enumerate(chains):
        cache: dict[tuple[int, ...], tuple[DraftNodes, int]] = {}
        for o, (k, bonus, ok) in enumerate(packed[i, :, :3].tolist()):
            if ok:
                cache.setdefault(tuple(chain[:k]) + (bonus,), (tree, i * width + o))
        out.append(cache)
    return out


def rank_chain_outcomes(chain: list[int], ranked: list[dict[int, float]], width: int) -> list[tuple[int, int]]:
    """The ranking of step 2 on the host, for proposers that know their log-probabilities as a
    few tokens per depth: ranked[k] = {token: log q_k(token)} (tokens left out: -inf) for depths
    0..m. -> the `width` best outcomes (k, bonus), best first, ties by depth then token."""
    m = len(chain)
    assert len(ranked) == m + 1, (m, len(ranked))
    cands, reach = [], 0.0
    for k, row in enumerate(ranked):
        for tok, lp in row.items():
            if (k == m or tok != chain[k]) and reach + lp > float("-inf"):
                cands.append((-(reach + lp), k, tok))
        if k < m:
            reach += row.get(chain[k], float("-inf"))
    cands.sort()
    return [(k, tok) for _, k, tok in cands[:width]]
