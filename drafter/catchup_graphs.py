"""CUDA graphs for the EAGLE head's catch-up on its own (drafter/graphs.py has the chain's).

The catch-up (`EagleProposer.catch_up`: the head over each request's new (feature, token) pairs,
K/V written for every pair, the rest of the layer for the last one) runs as one graph per
(Bc, Tc, span bucket), Tc = the new pairs padded up to `PAIR_BUCKETS` (prefills: up to
`PREFILL_PAIR_BUCKETS`); longer catch-ups run eagerly. The graph reads the cache's block tables
in place (`PagedKVCache.rows` runs inside it, from each row's slot, base and pair count), so its
inputs are a few small tensors. Padding pairs of a real row write the trash row and are never read; padding rows (0 pairs) write and
read only the trash row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from drafter.graphs import PAIR_BUCKETS, PREFILL_PAIR_BUCKETS, HeadGraphs, StaticInputs, pair_bucket
from spectandem.cuda_graphs import BATCH_BUCKETS, batch_bucket, capture_graph, span_bucket
from spectandem.devices import to_device
from spectandem.kv_cache import PagedCacheBatch, PagedKVCache


@dataclass
class CatchUpInputs(StaticInputs):
    """One catch-up at static shape: Bc rows (the last Bc - B padding), Tc pairs per row."""

    token_ids: torch.Tensor  # [Bc, Tc] int64 target ids of each pair's token (padding: 0)
    features: torch.Tensor   # [Bc, Tc, F] target features of each pair (padding: 0)
    base: torch.Tensor       # [Bc] int64 head-cache entries before the catch-up (padding rows: 0)
    num_new: torch.Tensor    # [Bc] int64 real pairs of the row (padding rows: 0)
    slots: torch.Tensor      # [Bc] int64 head-cache slots (padding rows: 0, never touched)


def catch_up_inputs(cache: PagedKVCache, slots: list[int], base: list[int], token_ids: list[list[int]],
                    features: list[torch.Tensor], rows: int, pairs: int) -> CatchUpInputs:
    """Per request b: slot, base (entries already absorbed), its n_b new pairs' tokens and features
    [n_b, F] (on the cache's device, in the head's dtype) -> inputs padded to `rows` requests of
    `pairs` pairs. The slots must already hold base + n_b entries. No device -> host copy."""
    b, num_new = len(base), [len(t) for t in token_ids]
    assert rows >= b and max(num_new) <= pairs, (rows, b, num_new, pairs)
    dev = cache.k[0].device
    pad = rows - b
    toks = to_device([list(t) + [0] * (pairs - len(t)) for t in token_ids] + [[0] * pairs] * pad, dev)  # [Bc, Tc]
    meta = to_device([list(base) + [0] * pad, num_new + [0] * pad, list(slots) + [0] * pad], dev)        # [3, Bc]
    feats = features[0].new_zeros(rows, pairs, features[0].shape[-1])
    for i, f in enumerate(features):
        feats[i, : f.shape[0]] = f
    return CatchUpInputs(toks, feats, meta[0], meta[1], meta[2])


def catch_up_forward(head, cache: PagedKVCache, inp: CatchUpInputs, span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The eager catch-up over static inputs, attending over `span` head-cache columns ->
    (hidden [Bc, 1, H] of each row's last real pair, its draft logits [Bc, 1, Vd] float32).

    Example: base [5, 0], num_new [2, 0], Tc 4 -> row 0 writes entries 5, 6 (pairs 2, 3 the trash
    row) and its last pair sees columns 0..6; row 1 (padding) writes the trash row four times and
    sees column 0, which reads the trash row."""
    rows, pairs = inp.token_ids.shape
    dev = inp.base.device
    ar = torch.arange(pairs, device=dev)
    cols = torch.arange(span, device=dev)
    positions = inp.base[:, None] + ar                                                     # [Bc, Tc]
    write = torch.where(ar < inp.num_new[:, None], positions, cache.trash_index)           # [Bc, Tc]
    read = torch.where((inp.num_new > 0)[:, None], cols, cache.trash_index)                # [Bc, S]
    end = (inp.base + inp.num_new).clamp(min=1)                                            # [Bc]
    mask = cols[None, None, :] < end[:, None, None]                                        # [Bc, 1, S]
    last = (inp.num_new - 1).clamp(min=0)[:, None]                                         # [Bc, 1]
    cache_batch = PagedCacheBatch(cache, cache.rows(inp.slots, write), cache.rows(inp.slots, read))
    out = head.run(inp.token_ids, head.project(inp.features), positions, cache_batch, mask, last)
    return out, head.logits(out)


class CatchUpGraphs(HeadGraphs):
    """Catch-ups at bucketed static shapes, one CUDA graph per (Bc, Tc, S), captured lazily. With
    `graph=False` the same padded computation runs eagerly (testable on CPU)."""

    def __init__(self, head, cache: PagedKVCache, graph: bool = True, batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 pair_buckets: tuple[int, ...] = PAIR_BUCKETS + PREFILL_PAIR_BUCKETS):
        super().__init__(head, cache, graph, batch_buckets)
        self.pair_buckets = tuple(sorted(pair_buckets))
        self._outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}   # Bc -> ([Bc, 1, H], [Bc, 1, Vd])

    def supports(self, batch: int, max_new: int) -> bool:
        """Batches up to the largest batch bucket, at most the largest pair bucket per request."""
        rows = batch_bucket(batch, self.batch_buckets)
        return rows is not None and pair_bucket(rows, max_new, self.pair_buckets) is not None

    def run(self, slots: list[int], base: list[int], token_ids: list[list[int]],
            features: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Arguments as `catch_up_inputs` -> (hidden [B, 1, H], logits [B, 1, Vd]), not aliased by
        any static buffer."""
        b = len(base)
        rows = batch_bucket(b, self.batch_buckets)
        pairs = pair_bucket(rows, max(len(t) for t in token_ids), self.pair_buckets)
        span = span_bucket(max(b0 + len(t) for b0, t in zip(base, token_ids)), self.cache.max_len)
        inp = catch_up_inputs(self.cache, slots, base, token_ids, features, rows, pairs)
        if not self.graph:
            hidden, logits = catch_up_forward(self.head, self.cache, inp, span)
            return hidden[:b], logits[:b]
        key = (rows, pairs, span)
        if key not in self._captured:
            self._capture_on_first_use(key, inp)
        static, graph = self._captured[key]
        static.copy_(inp)
        self.cache.sync_device_tables()   # the graph maps its rows through the device block tables
        graph.replay()
        hidden, logits = self._outputs[rows]
        # One copy each: every graph of this Bc replays into these buffers.
        return hidden[:b].clone(), logits[:b].clone()

    def warm_keys(self, max_batch: int, spans: list[int]) -> list[tuple]:
        """The keys of the catch-ups a drafter of at most `max_batch` requests runs over `spans`:
        a round's (`PAIR_BUCKETS`) and prefills' (the larger pair buckets, within
        PREFILL_PAIR_ROWS, at spans holding such a prompt)."""
        return [(rows, pairs, span) for rows in self._warm_rows(max_batch) for span in spans
                for pairs in self._warm_pairs(rows, span)]

    def padding_inputs(self, key: tuple) -> CatchUpInputs:
        rows, pairs, span = key
        dev, s = self.device, self.head.spec
        zeros = lambda *shape: torch.zeros(shape, dtype=torch.long, device=dev)
        return CatchUpInputs(token_ids=zeros(rows, pairs), base=zeros(rows), num_new=zeros(rows), slots=zeros(rows),
                             features=torch.zeros(rows, pairs, s.feature_size, dtype=next(self.head.parameters()).dtype,
                                                  device=dev))

    def _capture(self, key: tuple, like: CatchUpInputs) -> None:
        rows, pairs, span = key
        # All zeros: every row padding (0 pairs), so warm-up and capture touch only the trash row.
        static = CatchUpInputs(*(torch.zeros_like(getattr(like, f.name)) for f in fields(like)))
        static.features = self._features(rows, pairs, static.features)
        if rows not in self._outputs:
            s = self.head.spec
            dtype = next(self.head.parameters()).dtype
            self._outputs[rows] = (torch.empty(rows, 1, s.hidden_size, dtype=dtype, device=self.device),
                                   torch.empty(rows, 1, s.draft_vocab_size, device=self.device))
        out_hidden, out_logits = self._outputs[rows]

        def body():
            hidden, logits = catch_up_forward(self.head, self.cache, static, span)
            out_hidden.copy_(hidden)
            out_logits.copy_(logits)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._captured[key] = (static, capture_graph(body, self.pool, self.device, warmup=1))
