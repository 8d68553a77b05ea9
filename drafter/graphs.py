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

The catch-up graphs (`CatchUpGraphs`, a catch-up on its own) are in drafter/catchup_graphs.py;
a chain's graph can run a catch-up first (`catch_up_in_pass`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import numpy as np
import torch

from drafter.tree import DraftNodes, chain_tree
from spectandem.cuda_graphs import (BATCH_BUCKETS, MIN_SPAN, batch_bucket, capture_graph, captured_while_serving,
                                     span_bucket)
from spectandem.devices import to_device
from spectandem.kv_cache import PagedCacheBatch, PagedKVCache

# Catch-ups of up to 16 new pairs per request replay a graph: every extend of a round (at most the
# tree's depth + 1 pairs) and short prefills; longer ones run eagerly.
PAIR_BUCKETS = (1, 2, 4, 8, 16)
# A prefill (a request's first catch-up: its whole prompt) replays a graph too, in the chain and
# catch-up graphs, up to 512 pairs per request and PREFILL_PAIR_ROWS padded pairs per graph (the
# layer's activations grow with both). An eager prefill of the 8B-shaped EAGLE-3 head took 3.4 ms
# of host time for 32 pairs on an H200 host, before the first draft could start.
PREFILL_PAIR_BUCKETS = (32, 64, 128, 256, 512)
PREFILL_PAIR_ROWS = 2048
# Start-up captures the graphs of passes over up to this many cache entries (a request's context);
# a longer context's graphs are captured when it first comes.
WARM_MAX_SPAN = 4096


def pair_bucket(rows: int, max_new: int, buckets: tuple[int, ...]) -> int | None:
    """The pairs a catch-up of at most `max_new` new pairs per request pads to in a graph of
    `rows` rows; None where no graph takes it (it runs eagerly)."""
    pairs = batch_bucket(max_new, buckets)
    if pairs is None or (pairs > PAIR_BUCKETS[-1] and rows * pairs > PREFILL_PAIR_ROWS):
        return None
    return pairs


class StaticInputs:
    """What the graph families' input dataclasses share: optional fields (None: not in this
    shape's graph), copied into a captured graph's buffers, and an all-padding copy for capture."""

    ROW_FIELDS: frozenset = frozenset()   # fields of physical cache rows (padding: the trash row)

    def copy_(self, other) -> None:
        for f in fields(self):
            mine = getattr(self, f.name)
            if mine is not None:
                mine.copy_(getattr(other, f.name))

    def like_padding(self, trash: int):
        """Same shapes, every row padding: warm-up and capture write and read only the trash row."""
        return type(self)(**{f.name: None if (t := getattr(self, f.name)) is None
                             else torch.full_like(t, trash) if f.name in self.ROW_FIELDS else torch.zeros_like(t)
                             for f in fields(self)})


@dataclass(kw_only=True)
class PassStart(StaticInputs):
    """Where a graph's pass (a chain, a chain draft ahead) starts: from a catch-up already run
    (first_logits, hidden) or from one run at its head (the cu_* fields: Tc pairs per row, ending
    at the pass's base); the other group is None."""

    first_logits: torch.Tensor | None = None   # [Bc, Vd] float32 catch-up logits (padding: 0)
    hidden: torch.Tensor | None = None         # [Bc, 1, H] catch-up output hidden (padding: 0)
    cu_new: torch.Tensor | None = None         # [Bc] int64 the catch-up's pairs per row (padding: 0)
    cu_tokens: torch.Tensor | None = None      # [Bc, Tc] int64 target ids of the pairs' tokens (padding: 0)
    cu_features: torch.Tensor | None = None    # [Bc, Tc, F] target features of the pairs (padding: 0)
    cu_write: torch.Tensor | None = None       # [Bc, Tc] int64 physical rows the pairs write


def catch_up_in_pass(head, cache: PagedKVCache, inp) -> torch.Tensor:
    """A catch-up at the head of a graph's pass (`inp`: a PassStart with base and read_rows): each row's cu_new pairs end at base, K/V
    for every pair, the rest of the layer for the last one (EagleProposer.catch_up's
    computation) -> the last pair's hidden [Bc, 1, H]."""
    span = inp.read_rows.shape[1]
    pairs = inp.cu_tokens.shape[1]
    dev = inp.base.device
    positions = (inp.base - inp.cu_new)[:, None] + torch.arange(pairs, device=dev)           # [Bc, Tc]
    mask = torch.arange(span, device=dev)[None, None, :] < inp.base.clamp(min=1)[:, None, None]
    last = (inp.cu_new - 1).clamp(min=0)[:, None]                                            # [Bc, 1]
    cache_batch = PagedCacheBatch(cache, inp.cu_write, inp.read_rows)
    return head.run(inp.cu_tokens, head.project(inp.cu_features), positions, cache_batch, mask, last)


def catch_up_columns(token_ids: list[list[int]], rows: int, pairs: int, base: np.ndarray,
                     trash: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A catch-up's columns of a pass's packed host inputs (`chain_inputs`, `ahead_inputs`): per
    request its n_b pairs' tokens, ending at base [Bc] (the entries once caught up); rows >= B
    (padding rows: no pairs) -> (pair counts [Bc], tokens [Bc, Tc] zero-padded, the logical
    entries the pairs write [Bc, Tc], `trash` past each row's pairs). Example: base [7], tokens
    [[a, b]], Tc 4 -> counts [2], tokens [[a, b, 0, 0]], entries [[5, 6, trash, trash]]."""
    b = len(token_ids)
    new = np.array([len(t) for t in token_ids] + [0] * (rows - b), dtype=np.int64)
    assert new[:b].min() >= 1 and new.max() <= pairs, (new, pairs)
    tokens = np.zeros((rows, pairs), dtype=np.int64)
    for i, t in enumerate(token_ids):
        tokens[i, : len(t)] = t
    j = np.arange(pairs)[None, :]
    return new, tokens, np.where(j < new[:, None], (base - new)[:, None] + j, trash)


def padded_features(features: list[torch.Tensor], rows: int, pairs: int) -> torch.Tensor:
    """Per request its pairs' features [n_b, F] -> [rows, pairs, F], zeros elsewhere."""
    out = features[0].new_zeros(rows, pairs, features[0].shape[-1])
    for i, f in enumerate(features):
        out[i, : f.shape[0]] = f
    return out


@dataclass
class ChainInputs(PassStart):
    """One chain at static shape: Bc rows (the last Bc - B padding), S columns."""

    base: torch.Tensor           # [Bc] int64 head-cache entries per request (padding: 0)
    write_rows: torch.Tensor     # [S_steps - 1, Bc, 1] int64 physical rows step i writes
    read_rows: torch.Tensor      # [Bc, S] int64 physical rows of logical entries 0..S-1

    ROW_FIELDS = frozenset({"write_rows", "read_rows", "cu_write"})


def chain_index_fields(rows: int, span: int, num_steps: int, pairs: int) -> list[tuple[str, tuple[int, ...]]]:
    """A chain's int64 input fields in their order in one packed buffer (`chain_index_np`),
    with their shapes; the catch-up's three last where it runs one (pairs > 0)."""
    out = [("base", (rows,)), ("write_rows", (num_steps - 1, rows, 1)), ("read_rows", (rows, span))]
    if pairs:
        out += [("cu_new", (rows,)), ("cu_tokens", (rows, pairs)), ("cu_write", (rows, pairs))]
    return out


def index_views(flat: torch.Tensor, layout: list[tuple[str, tuple[int, ...]]]) -> dict[str, torch.Tensor]:
    """The fields of a packed buffer (`chain_index_fields`'s layout), as contiguous views."""
    out, offset = {}, 0
    for name, shape in layout:
        count = int(np.prod(shape))
        out[name] = flat[offset: offset + count].view(shape)
        offset += count
    return out


def chain_index_np(cache: PagedKVCache, slots: list[int], base: list[int], num_steps: int, rows: int, span: int,
                   token_ids: list[list[int]] | None = None, pairs: int = 0, out: np.ndarray | None = None) -> np.ndarray:
    """A chain's index inputs (`chain_inputs`) packed on the host, worked out in numpy over the
    cache's host tables: int64 [n] in `chain_index_fields` order, written into `out` if given.
    token_ids: per request its catch-up pairs' tokens (pairs > 0), ending at base."""
    b = len(base)
    assert rows >= b and max(base) + num_steps - 1 <= span <= cache.max_len, (rows, b, base, num_steps, span)
    real = (np.arange(rows) < b)[:, None]
    base_np = np.array(list(base) + [0] * (rows - b), dtype=np.int64)
    trash = cache.trash_index
    logical = [np.where(real, base_np[:, None] + np.arange(num_steps - 1), trash)]   # step i + 1 writes column i
    if pairs:
        new_np, tok_np, pair_entries = catch_up_columns(token_ids, rows, pairs, base_np, trash)
        logical.append(pair_entries)
    phys = cache.host_rows_np(list(slots) + [slots[0]] * (rows - b), np.concatenate(logical, 1))
    read = cache.host_span_rows_np(list(slots), span, rows)                          # every column, padding trash
    parts = [base_np, phys[:, : num_steps - 1].T, read] + ([new_np, tok_np, phys[:, num_steps - 1:]] if pairs else [])
    return pack_parts(parts, out)


def pack_parts(parts: list[np.ndarray], out: np.ndarray | None = None) -> np.ndarray:
    """int64 arrays flattened one after another (C order) into `out` (made when None), which
    they fill exactly: a pass's packed index inputs (`chain_index_np`, `ahead_index_np`)."""
    if out is None:
        out = np.empty(sum(p.size for p in parts), dtype=np.int64)
    offset = 0
    for part in parts:
        out[offset: offset + part.size] = part.reshape(-1)
        offset += part.size
    assert offset == out.size, (offset, out.size)
    return out


def chain_inputs(cache: PagedKVCache, slots: list[int], base: list[int], num_steps: int, rows: int, span: int,
                 start: tuple | None = None, catch_up: tuple | None = None) -> ChainInputs:
    """slots: per request its head-cache slot; base: head-cache entries per request (once caught
    up). Then either start = (first_logits [B, Vd], hidden [B, 1, H]) of a catch-up already run,
    or catch_up = (token_ids: per request its n_b >= 1 pairs' tokens, features: per request
    [n_b, F] on the cache's device in the head's dtype, pairs: Tc >= max n_b), the pairs ending at
    base. The slots must already hold base + num_steps - 1 entries. The index inputs are worked
    out on the host (`chain_index_np`) and cross in one copy: a miss's draft waits for this
    (drafter/ahead_chains.py `ahead_inputs` does the same). The graphs copy the same packed
    buffer into their own (ChainGraphs._run)."""
    assert (start is None) != (catch_up is None)
    token_ids, pairs = (None, 0) if catch_up is None else (catch_up[0], catch_up[2])
    packed = chain_index_np(cache, slots, base, num_steps, rows, span, token_ids, pairs)
    views = index_views(to_device(torch.from_numpy(packed), cache.k[0].device),
                        chain_index_fields(rows, span, num_steps, pairs))
    inp = ChainInputs(**views)
    if catch_up is not None:
        inp.cu_features = padded_features(catch_up[1], rows, pairs)
        return inp
    b = len(base)
    first_logits, hidden = start
    inp.first_logits = first_logits.new_zeros(rows, first_logits.shape[-1])
    inp.first_logits[:b] = first_logits
    inp.hidden = hidden.new_zeros(rows, 1, hidden.shape[-1])
    inp.hidden[:b] = hidden
    return inp


def chain_forward(head, cache: PagedKVCache, inp: ChainInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> ([Bc, num_steps] target token ids of the chain (num_steps = len(write_rows) + 1), the
    catch-up's hidden [Bc, 1, H] and logits [Bc, Vd] float32)."""
    rows, span = inp.read_rows.shape
    dev = inp.base.device
    cols = torch.arange(span, device=dev)
    query = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    if inp.cu_tokens is not None:   # the catch-up first
        hidden = catch_up_in_pass(head, cache, inp)
        first = head.logits(hidden)[:, 0]                                                    # [Bc, Vd]
    else:
        hidden, first = inp.hidden, inp.first_logits
    h0 = hidden
    tok = first.argmax(-1, keepdim=True)                                                 # [Bc, 1] draft ids
    toks = [tok]
    for i in range(1, inp.write_rows.shape[0] + 1):
        positions = (inp.base + i - 1)[:, None]                                          # [Bc, 1]
        mask = cols[None, None, :] < (inp.base + i)[:, None, None]                       # [Bc, 1, S]
        cache_batch = PagedCacheBatch(cache, inp.write_rows[i - 1], inp.read_rows)
        hidden = head.run(head.draft_to_target(tok), hidden, positions, cache_batch, mask, query)
        tok = head.logits(hidden).argmax(-1)                                             # [Bc, 1]
        toks.append(tok)
    return head.draft_to_target(torch.cat(toks, 1)), h0, first.float()


class HeadGraphs:
    """What the head's graph families share: the head and its cache, graphs or the same padded
    computation eagerly (`graph=False`, the CPU path), batch buckets and one memory pool. Their
    graphs are many (one per batch, span and catch-up bucket; start-up captures them all), so a
    capture runs its pass once before capturing it, for the lazy initialisation, not twice."""

    def __init__(self, head, cache: PagedKVCache, graph: bool = True,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS):
        self.head, self.cache, self.graph = head, cache, graph
        self.device = cache.k[0].device
        if graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the draft cache is on {self.device}")
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.pool = None
        self.warmed = False       # warm_up ran: a capture after it is logged (captured_while_serving)
        self._captured: dict[tuple, tuple] = {}
        self._shared: dict[tuple, torch.Tensor] = {}

    def warm_up(self, keys: list[tuple], progress=None, what: str = "") -> int:
        """Captures the graph of every key in `keys` not captured yet, from inputs that are all
        padding (`padding_inputs`), reporting "capturing <what> graphs: i/total" to `progress`
        -> the number captured. The largest shapes first: the memory a capture frees in the
        shared pool is then reused by the smaller ones after it."""
        todo = [key for key in dict.fromkeys(keys) if key not in self._captured]
        todo.sort(key=math.prod, reverse=True)
        for i, key in enumerate(todo, 1):
            self._capture(key, self.padding_inputs(key))
            if progress is not None and (i == len(todo) or i % 100 == 0):
                progress(f"capturing {what} graphs: {i}/{len(todo)}")
        self.warmed = True
        return len(todo)

    def _capture_on_first_use(self, key: tuple, like) -> None:
        """Captures `key`'s graph for a step that needs it now (logged once warm_up has run)."""
        if self.warmed:
            captured_while_serving(type(self).__name__, key)
        self._capture(key, like)

    def padding_inputs(self, key: tuple):
        """Inputs of `key`'s shapes, every row padding (what `_capture` starts from)."""
        raise NotImplementedError

    def _warm_rows(self, max_batch: int) -> list[int]:
        """The batch buckets of a drafter of at most `max_batch` requests."""
        top = batch_bucket(max_batch, self.batch_buckets) or self.batch_buckets[-1]
        return [rows for rows in self.batch_buckets if rows <= top]

    def _warm_pairs(self, rows: int, span: int) -> list[int]:
        """The catch-up pair buckets a graph of `rows` rows over `span` entries takes: a round's
        (`PAIR_BUCKETS`), and a prefill's within PREFILL_PAIR_ROWS where the span holds it."""
        return [pairs for pairs in self.pair_buckets if pair_bucket(rows, pairs, self.pair_buckets) == pairs
                and (pairs <= PAIR_BUCKETS[-1] or 2 * span > pairs)]

    def _output(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An output buffer that every graph of this family writing `name` at `shape` shares: a run
        reads (or copies) its outputs before the next replay, so one per shape is enough, and
        the buffers live outside the graphs' pool (a later capture may reuse the pool's memory).
        Zeros when made: the features input is one such buffer, and the all-padding passes that
        warm-up and capture run read it before any run has written it."""
        key = (name, shape, dtype)
        if key not in self._shared:
            self._shared[key] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self._shared[key]

    def _features(self, rows: int, pairs: int, like: torch.Tensor) -> torch.Tensor:
        """The [rows, pairs, F] features input of a graph, a view of one buffer every graph of this
        family reads its catch-up's features from (each run writes them before its replay): one
        buffer of the largest shape instead of one per (rows, pairs, span)."""
        width = like.shape[-1]
        flat = self._output("features", (max(PREFILL_PAIR_ROWS, self.batch_buckets[-1] * PAIR_BUCKETS[-1]) * width,),
                            like.dtype)
        assert rows * pairs * width <= flat.numel(), (rows, pairs, width)
        return flat[: rows * pairs * width].view(rows, pairs, width)

    def _pass_start(self, rows: int, pairs: int) -> dict:
        """The PassStart fields of a padding pass: a catch-up of `pairs` pairs, or a start."""
        s, dtype = self.head.spec, next(self.head.parameters()).dtype
        dev = self.device
        if pairs:
            return dict(cu_features=torch.zeros(rows, pairs, s.feature_size, dtype=dtype, device=dev))
        return dict(first_logits=torch.zeros(rows, s.draft_vocab_size, device=dev),
                    hidden=torch.zeros(rows, 1, s.hidden_size, dtype=dtype, device=dev))


def padding_index_fields(cls, layout: list[tuple[str, tuple[int, ...]]], trash: int, device) -> dict:
    """A pass's index fields of `layout`, every row padding: the trash row where `cls` keeps
    physical cache rows, zeros elsewhere (what `StaticInputs.like_padding` makes)."""
    return {name: torch.full(shape, trash, dtype=torch.long, device=device) if name in cls.ROW_FIELDS
            else torch.zeros(shape, dtype=torch.long, device=device) for name, shape in layout}


def warm_spans(max_len: int, limit: int) -> list[int]:
    """The span buckets (`span_bucket`) of passes over up to min(max_len, limit) entries."""
    out, span = [], MIN_SPAN
    while True:
        out.append(span_bucket(min(span, max_len), max_len))
        if span >= min(max_len, limit):
            return sorted(set(out))
        span *= 2


class ChainGraphs(HeadGraphs):
    """Draft chains at bucketed static shapes, one CUDA graph per (Bc, S, num_steps, Tc), captured
    lazily (Tc = 0: no catch-up inside; else the catch-up's pairs padded up to `pair_bucket`: a
    round's, or a prefill's whose first draft runs it). With `graph=False` the same padded
    computation runs eagerly (testable on CPU)."""

    def __init__(self, head, cache: PagedKVCache, graph: bool = True, batch_buckets: tuple[int, ...] = BATCH_BUCKETS,
                 pair_buckets: tuple[int, ...] = PAIR_BUCKETS + PREFILL_PAIR_BUCKETS):
        super().__init__(head, cache, graph, batch_buckets)
        self.pair_buckets = tuple(sorted(pair_buckets))

    def supports(self, batch: int, topk: int, sampled: bool, num_steps: int, max_new: int = 0) -> bool:
        """Argmax chains of at least one head step, batch up to the largest bucket; with a
        catch-up inside (max_new pairs at most per request), at most the largest pair bucket."""
        rows = batch_bucket(batch, self.batch_buckets)
        return (topk == 1 and not sampled and num_steps >= 2 and rows is not None
                and (max_new == 0 or pair_bucket(rows, max_new, self.pair_buckets) is not None))

    def propose(self, slots: list[int], base: list[int], first_logits: torch.Tensor, hidden: torch.Tensor,
                num_steps: int, num_draft_tokens: int) -> DraftNodes:
        """From a catch-up already run (`chain_inputs`'s start) -> the chain's DraftNodes (what
        `expand_topk` returns)."""
        toks, _, _ = self._run(slots, base, num_steps, 0, start=(first_logits, hidden))
        return chain_tree(toks, num_draft_tokens)

    def propose_caught_up(self, slots: list[int], base: list[int], token_ids: list[list[int]],
                          features: list[torch.Tensor], num_steps: int,
                          num_draft_tokens: int) -> tuple[DraftNodes, torch.Tensor, torch.Tensor]:
        """The catch-up of each request's pairs (`chain_inputs`'s catch_up; base counts the entries
        once caught up), then the chain -> (DraftNodes, the catch-up's hidden [B, 1, H] and logits
        [B, Vd]), none aliased by a static buffer."""
        pairs = pair_bucket(batch_bucket(len(base), self.batch_buckets), max(len(t) for t in token_ids),
                            self.pair_buckets)
        toks, hidden, logits = self._run(slots, base, num_steps, pairs, catch_up=(token_ids, features, pairs))
        return chain_tree(toks, num_draft_tokens), hidden.clone(), logits.clone()

    def _run(self, slots, base, num_steps, pairs, start=None, catch_up=None):
        b = len(base)
        rows = batch_bucket(b, self.batch_buckets)
        span = span_bucket(max(base) + num_steps - 1, self.cache.max_len)
        key = (rows, span, num_steps, pairs)
        if not self.graph or key not in self._captured:
            inp = chain_inputs(self.cache, slots, base, num_steps, rows, span, start, catch_up)
        if not self.graph:
            toks, hidden, logits = chain_forward(self.head, self.cache, inp)
        else:
            if key not in self._captured:
                self._capture_on_first_use(key, inp)
            static, flat, graph, (toks, hidden, logits) = self._captured[key]
            # The index inputs packed on the host straight into pinned memory, in one copy into
            # the graph's buffer (its fields are views of it); then the features or the start.
            host = torch.empty(flat.numel(), dtype=torch.int64, pin_memory=True)
            chain_index_np(self.cache, slots, base, num_steps, rows, span,
                           None if catch_up is None else catch_up[0], pairs, out=host.numpy())
            flat.copy_(host, non_blocking=True)
            if catch_up is not None:
                _rows_into(static.cu_features, catch_up[1])
            else:
                static.first_logits.zero_()
                static.first_logits[:b].copy_(start[0])
                static.hidden.zero_()
                static.hidden[:b].copy_(start[1])
            graph.replay()
            toks = toks.clone()
        return toks[:b], hidden[:b], logits[:b]

    def warm_keys(self, max_batch: int, steps: list[int], spans: list[int]) -> list[tuple]:
        """The keys of the chains a drafter of at most `max_batch` requests runs over `spans`: each
        of `steps` from a catch-up already run or after a round's catch-up (`PAIR_BUCKETS`), and
        the first chain after a prefill (the larger pair buckets, within PREFILL_PAIR_ROWS, at
        spans holding such a prompt), of each of `steps` too: a request admitted while the
        pipeline drafts short chains starts with one."""
        keys = []
        for rows in self._warm_rows(max_batch):
            for span in spans:
                pairs = self._warm_pairs(rows, span)
                keys += [(rows, span, n, p) for n in steps for p in [0] + pairs if p <= PAIR_BUCKETS[-1]]
                keys += [(rows, span, n, p) for n in steps for p in pairs if p > PAIR_BUCKETS[-1]]
        return keys

    def padding_inputs(self, key: tuple) -> ChainInputs:
        rows, span, num_steps, pairs = key
        fields_ = padding_index_fields(ChainInputs, chain_index_fields(rows, span, num_steps, pairs),
                                       self.cache.trash_row, self.device)
        return ChainInputs(**fields_, **self._pass_start(rows, pairs))

    def _capture(self, key: tuple, like: ChainInputs) -> None:
        rows, span, num_steps, pairs = key
        static = like.like_padding(self.cache.trash_row)
        # The index fields as views of one buffer, padding as like_padding has it.
        layout = chain_index_fields(rows, span, num_steps, pairs)
        flat = torch.empty(sum(int(np.prod(shape)) for _, shape in layout), dtype=torch.int64, device=self.device)
        for name, view in index_views(flat, layout).items():
            view.copy_(getattr(static, name))
            setattr(static, name, view)
        if pairs:
            static.cu_features = self._features(rows, pairs, static.cu_features)
        s = self.head.spec
        outs = (self._output("tokens", (rows, num_steps), torch.long),
                self._output("hidden", (rows, 1, s.hidden_size), next(self.head.parameters()).dtype),
                self._output("logits", (rows, s.draft_vocab_size), torch.float32))

        def body():
            for buf, t in zip(outs, chain_forward(self.head, self.cache, static)):
                buf.copy_(t)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        self._captured[key] = (static, flat, capture_graph(body, self.pool, self.device, warmup=1), outs)


def _rows_into(static: torch.Tensor, parts: list[torch.Tensor]) -> None:
    """A graph's static input as `chain_inputs` pads it: zeros, then part i at the head of row i
    (a request's [n_i, ...] rows; one [1, ...] row each for the start). A few device calls for the
    whole batch: parts of one length in one stacked copy, else concatenated and scattered by row."""
    static.zero_()
    if not parts:
        return
    lens = [p.shape[0] for p in parts]
    if min(lens) == max(lens):
        static[: len(parts), : lens[0]].copy_(torch.stack(parts))
        return
    lens_np = np.asarray(lens, dtype=np.int64)
    starts = np.cumsum(lens_np) - lens_np
    row_starts = np.arange(len(lens)) * static.shape[1]
    index = np.arange(int(lens_np.sum())) + np.repeat(row_starts - starts, lens_np)   # part i's row j: i * Tc + j
    flat = static.view(-1, *static.shape[2:])
    flat.index_copy_(0, to_device(torch.from_numpy(index), static.device), torch.cat(parts).to(static.dtype))
