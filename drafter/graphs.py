"""CUDA graph for EAGLE draft chains (topk == 1, deterministic drafts): the whole chain of
`EagleProposer.propose` (S = num_steps tokens: the argmax of the catch-up logits, then S - 1 head
steps, each fed the previous argmax and the previous step's output hidden) as one graph per
(batch bucket Bc, span bucket, S), the argmaxes inside.

Step i (1..S-1) writes its K/V at head-cache index cache_len + i - 1 (RoPE position the same)
and attends to every index below cache_len + i: the eager chain's `_ScratchTree` with k = 1,
where each branch sees all of its scratch. Per-step write rows are inputs ([S - 1, Bc, 1]); the
masks are computed inside the graph from `base`. Padding rows and columns, warm-up, the shared
memory pool and the output buffers follow verifier/graphs.py (its docstring has the hazards):
padding rows write and read only the trash row, padding columns add exact zeros, so the graphed
chain equals the eager one up to summation order.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from drafter.tree import TreeDraft
from spectandem.devices import to_device
from spectandem.kv_cache import PagedCacheBatch, PagedKVCache
from verifier.graphs import BATCH_BUCKETS, batch_bucket, capture_graph, span_bucket


@dataclass
class ChainInputs:
    """One chain at static shape: Bc rows (the last Bc - B padding), S columns."""

    first_logits: torch.Tensor   # [Bc, Vd] float32 catch-up logits (padding: 0)
    hidden: torch.Tensor         # [Bc, 1, H] catch-up output hidden (padding: 0)
    base: torch.Tensor           # [Bc] int64 head-cache entries per request (padding: 0)
    write_rows: torch.Tensor     # [S_steps - 1, Bc, 1] int64 physical rows step i writes
    read_rows: torch.Tensor      # [Bc, S] int64 physical rows of logical entries 0..S-1

    def copy_(self, other: "ChainInputs") -> None:
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))


def chain_inputs(cache: PagedKVCache, slots: torch.Tensor, base: list[int], first_logits: torch.Tensor,
                 hidden: torch.Tensor, num_steps: int, rows: int, span: int) -> ChainInputs:
    """slots [B]; base: head-cache entries per request; first_logits [B, Vd]; hidden [B, 1, H].
    The slots must already hold base + num_steps - 1 entries."""
    b = len(base)
    assert rows >= b and max(base) + num_steps - 1 <= span <= cache.max_len, (rows, b, base, num_steps, span)
    dev = cache.k[0].device
    pad = rows - b
    real = torch.arange(rows, device=dev) < b
    base_t = to_device(list(base) + [0] * pad, dev)                                        # [Bc]
    slot_t = torch.cat([slots.to(dev), slots[:1].to(dev).expand(pad)])
    steps = torch.arange(num_steps - 1, device=dev)
    write = torch.where(real[:, None], base_t[:, None] + steps, cache.trash_index)         # [Bc, S_steps - 1]
    read = torch.where(real[:, None], torch.arange(span, device=dev), cache.trash_index)   # [Bc, S]
    first = first_logits.new_zeros(rows, first_logits.shape[-1])
    first[:b] = first_logits
    h = hidden.new_zeros(rows, 1, hidden.shape[-1])
    h[:b] = hidden
    return ChainInputs(first, h, base_t, cache.rows(slot_t, write).t().contiguous()[..., None],
                       cache.rows(slot_t, read))


def chain_forward(head, cache: PagedKVCache, inp: ChainInputs) -> torch.Tensor:
    """-> [Bc, num_steps] target token ids of the chain (num_steps = len(write_rows) + 1)."""
    rows, span = inp.read_rows.shape
    dev = inp.base.device
    cols = torch.arange(span, device=dev)
    query = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    tok = inp.first_logits.argmax(-1, keepdim=True)                                     # [Bc, 1] draft ids
    toks, hidden = [tok], inp.hidden
    for i in range(1, inp.write_rows.shape[0] + 1):
        positions = (inp.base + i - 1)[:, None]                                          # [Bc, 1]
        mask = cols[None, None, :] < (inp.base + i)[:, None, None]                       # [Bc, 1, S]
        cache_batch = PagedCacheBatch(cache, inp.write_rows[i - 1], inp.read_rows)
        hidden = head.run(head.draft_to_target(tok), hidden, positions, cache_batch, mask, query)
        tok = head.logits(hidden).argmax(-1)                                             # [Bc, 1]
        toks.append(tok)
    return head.draft_to_target(torch.cat(toks, 1))


def chain_tree(token_ids: torch.Tensor, num_draft_tokens: int) -> TreeDraft:
    """token_ids [B, S] of a chain -> its first min(S, num_draft_tokens - 1) nodes, as
    `expand_topk` selects them (all scores 0, node j + 1's parent is node j)."""
    b, s = token_ids.shape
    m = min(s, num_draft_tokens - 1)
    dev = token_ids.device
    return TreeDraft(token_ids=token_ids[:, :m], parents=torch.arange(m, device=dev).expand(b, m).clone(),
                     scores=torch.zeros(b, m, device=dev))


class ChainGraphs:
    """Draft chains at bucketed static shapes, one CUDA graph per (Bc, S, num_steps), captured
    lazily. With `graph=False` the same padded computation runs eagerly (testable on CPU)."""

    def __init__(self, head, cache: PagedKVCache, graph: bool = True,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS):
        self.head, self.cache, self.graph = head, cache, graph
        self.device = cache.k[0].device
        if graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the draft cache is on {self.device}")
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.pool = None
        self._captured: dict[tuple, tuple[ChainInputs, "torch.cuda.CUDAGraph"]] = {}
        self._outputs: dict[tuple, torch.Tensor] = {}     # (Bc, num_steps) -> [Bc, num_steps] tokens

    def supports(self, batch: int, topk: int, sampled: bool, num_steps: int) -> bool:
        """Argmax chains of at least one head step, batch up to the largest bucket."""
        return topk == 1 and not sampled and num_steps >= 2 and batch_bucket(batch, self.batch_buckets) is not None

    def propose(self, slots: torch.Tensor, base: list[int], first_logits: torch.Tensor, hidden: torch.Tensor,
                num_steps: int, num_draft_tokens: int) -> TreeDraft:
        """Arguments as `chain_inputs` -> the chain's TreeDraft (what `expand_topk` returns)."""
        b = len(base)
        rows = batch_bucket(b, self.batch_buckets)
        span = span_bucket(max(base) + num_steps - 1, self.cache.max_len)
        inp = chain_inputs(self.cache, slots, base, first_logits, hidden, num_steps, rows, span)
        if not self.graph:
            return chain_tree(chain_forward(self.head, self.cache, inp)[:b], num_draft_tokens)
        key = (rows, span, num_steps)
        if key not in self._captured:
            self._capture(key, inp)
        static, graph = self._captured[key]
        static.copy_(inp)
        graph.replay()
        return chain_tree(self._outputs[(rows, num_steps)][:b].clone(), num_draft_tokens)

    def _capture(self, key: tuple, like: ChainInputs) -> None:
        rows, span, num_steps = key
        # Every row padding: warm-up and capture write only the trash row.
        static = ChainInputs(torch.zeros_like(like.first_logits), torch.zeros_like(like.hidden),
                             torch.zeros_like(like.base),
                             self._trash_rows(num_steps - 1, rows)[..., None], self._trash_rows(rows, span))
        out = self._outputs.setdefault((rows, num_steps),
                                       torch.empty(rows, num_steps, dtype=torch.long, device=self.device))

        def body():
            out.copy_(chain_forward(self.head, self.cache, static))

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._captured[key] = (static, capture_graph(body, self.pool, self.device))

    def _trash_rows(self, a: int, b: int) -> torch.Tensor:
        """[a, b] int64, every entry the cache's physical trash row."""
        index = torch.full((a, b), self.cache.trash_index, dtype=torch.long, device=self.device)
        return self.cache.rows(torch.zeros(a, dtype=torch.long, device=self.device), index)
