"""CUDA graphs for the target's verify step: the same forward as `NativeRunner.verify`, at static
shapes, captured once per shape and replayed with each step's inputs copied into its buffers.

Static-shape formulation. A verify over B requests and N tree nodes, whose longest request needs
`span = max(cache_len) + N` cache entries, runs as Bc >= B rows (`BATCH_BUCKETS`) over S >= span
cache columns (`span_bucket`: a power of two, at most the cache's max_len). All per-step values
travel in `VerifyInputs` tensors of shape [Bc, N], [Bc, S], [Bc, N, S]; the forward reads no
Python value that changes between steps, and makes no host sync.

Padding:
- rows B..Bc-1: token 0 at position 0, written to the trash row, reading only the trash row
  (column 0 unmasked, so softmax stays finite); their outputs are dropped;
- columns span..S of a real row: masked out. Their scores are finfo.min, whose exp underflows
  to exactly 0, and they read finite K/V (the trash row or a stale block), so they add exact
  zeros. Only the summation order can change (wider reductions, another matmul kernel for
  another M or S): the padded step equals the unpadded one to a few ulps, not bit for bit.

Graph hazards:
- A replay reads weights, the KV pools (allocated once by PagedKVCache) and the static buffers
  at the addresses of capture time: moving the model (`.to`) or rebuilding the cache after a
  capture makes its graphs stale.
- All graphs share one memory pool. Nothing allocated in it outlives its capture (results are
  copied, inside the graph, into output buffers allocated outside the pool), so graphs may
  replay in any order. Output buffers are shared by every row and span bucket of one N (views of
  the largest bucket's) and overwritten by the next replay: `run` returns copies.
- Warm-up (on a side stream, as capture requires) and capture run with every row padding: they
  write only the trash row.

With the Triton tree attention (`tree_attention=True`, NativeRunner's `triton_attention`) the
step carries no columns: `TreeVerifyInputs` holds each row's block table [Bc, max_blocks], prefix
length [Bc] and tree mask [Bc, N, N], and the kernel reads the lengths on the device, so one graph
per (Bc, N) serves every span. Padding rows: prefix 0, a table of -1, an identity tree mask; the
kernel loads no K/V for them (the packing: verifier/tree_inputs.py). The kernel's result for a row depends only on that row's query and
the entries it sees (spectandem/kernels/attention.py), so padding changes only the other matmuls'
shapes: a step whose B fills its bucket is the eager step bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from spectandem.cuda_graphs import BATCH_BUCKETS, batch_bucket, capture_graph, captured_while_serving, span_bucket
from spectandem.devices import to_device
from spectandem.kv_cache import PagedCacheBatch, PagedKVCache
from spectandem.tree import tree_shape
from verifier.tree_inputs import (TreeVerifyInputs, copy_tree_inputs, host_tree_inputs, padding_tree_flat,
                                  tree_inputs_on)

FeatureSpec = None | str | tuple[int, ...]


@dataclass
class VerifyInputs:
    """One verify step at static shape: Bc rows (the last Bc - B padding), N nodes, S columns."""

    token_ids: torch.Tensor    # [Bc, N] int64 (padding nodes and rows: 0)
    positions: torch.Tensor    # [Bc, N] int64 RoPE positions: cache_len + depth
    write_rows: torch.Tensor   # [Bc, N] int64 physical cache rows the nodes are written to
    read_rows: torch.Tensor    # [Bc, S] int64 physical rows of logical entries 0..S-1
    mask: torch.Tensor         # [Bc, N, S] bool: node i may attend to column j

    def copy_(self, other: "VerifyInputs") -> None:
        """`other`'s fields into these (the same shapes: a graph's static inputs)."""
        for f in fields(self):
            getattr(self, f.name).copy_(getattr(other, f.name))

    def forward_args(self, cache: PagedKVCache) -> tuple[PagedCacheBatch, torch.Tensor]:
        """(cache view, mask) for LlamaModel.forward."""
        return PagedCacheBatch(cache, self.write_rows, self.read_rows), self.mask


def verify_inputs(cache: PagedKVCache, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor,
                  parents: torch.Tensor, node_valid: torch.Tensor, rows: int, span: int) -> VerifyInputs:
    """Static-shape inputs of a verify (see `NativeRunner.verify` for the tree arguments, all
    [B, N]) padded to `rows` >= B rows and `span` >= max(cache_lens) + N columns. The slots
    must already hold cache_len + N entries (`cache.reserve`)."""
    b, n = token_ids.shape
    assert rows >= b and max(cache_lens) + n <= span <= cache.max_len, (rows, b, cache_lens, n, span)
    dev = cache.k[0].device
    pad = rows - b
    real = torch.arange(rows, device=dev) < b                                         # [Bc]
    base = to_device(list(cache_lens) + [0] * pad, dev)                               # [Bc]
    node = torch.arange(n, device=dev)
    cols = torch.arange(span, device=dev)
    # Node j of request b is written at logical cache_len + j; padding rows read and write the
    # logical trash index, which `cache.rows` maps to the trash row.
    write = torch.where(real[:, None], base[:, None] + node, cache.trash_index)        # [Bc, N]
    read = torch.where(real[:, None], cols, cache.trash_index)                          # [Bc, S]
    slot_t = to_device(list(slots) + [slots[0]] * pad, dev)
    depth, tree = tree_shape(parents.cpu(), node_valid.cpu())                          # [B, N], [B, N, N]
    positions = torch.zeros(rows, n, dtype=torch.long, device=dev)
    positions[:b] = base[:b, None] + to_device(depth, dev)
    # Column j < cache_len: committed, visible to every node; column cache_len + j: node j,
    # visible to its descendants and itself.
    mask = (cols[None, None, :] < base[:, None, None]).expand(rows, n, span).clone()   # [Bc, N, S]
    tree = to_device(tree, dev)
    mask[torch.arange(b, device=dev)[:, None, None], node[None, :, None], write[:b, None, :]] = tree
    mask[b:, :, 0] = True
    toks = torch.zeros(rows, n, dtype=torch.long, device=dev)
    toks[:b] = to_device(token_ids.clamp(min=0), dev)
    return VerifyInputs(toks, positions, cache.rows(slot_t, write), cache.rows(slot_t, read), mask)


def padding_inputs(cache: PagedKVCache, rows: int, n: int, span: int) -> VerifyInputs:
    """Inputs with every row padding (what warm-up and capture run on): only the trash row."""
    dev = cache.k[0].device
    slot0 = torch.zeros(rows, dtype=torch.long, device=dev)
    trash = torch.full((rows, max(n, span)), cache.trash_index, dtype=torch.long, device=dev)
    mask = torch.zeros(rows, n, span, dtype=torch.bool, device=dev)
    mask[:, :, 0] = True
    zeros = torch.zeros(rows, n, dtype=torch.long, device=dev)
    return VerifyInputs(zeros, zeros.clone(), cache.rows(slot0, trash[:, :n]), cache.rows(slot0, trash[:, :span]),
                        mask)


@dataclass
class VerifyStep:
    logits: torch.Tensor                 # [B, N, V] float32
    features: torch.Tensor | None        # [B, N, F] (None when the runner returns none)
    argmax: torch.Tensor                 # [B, N] int64, logits.argmax(-1)

    def rows(self, b: int) -> "VerifyStep":
        """Copies of the first b rows."""
        return VerifyStep(self.logits[:b].clone(), None if self.features is None else self.features[:b].clone(),
                          self.argmax[:b].clone())


def _hidden(model, cache: PagedKVCache, feature_layers: FeatureSpec,
            inp: VerifyInputs | TreeVerifyInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The target's forward over static inputs -> (hidden after the final norm [Bc, N, H],
    features or None). Features: None, "final" (that hidden) or HF hidden-state indices (aux)."""
    capture = feature_layers if isinstance(feature_layers, tuple) else ()
    cache_batch, mask = inp.forward_args(cache)
    hidden, aux = model(inp.token_ids, inp.positions, cache_batch, mask, capture)
    return hidden, None if feature_layers is None else (hidden if feature_layers == "final" else aux)


def verify_forward(model, cache: PagedKVCache, feature_layers: FeatureSpec,
                   inp: VerifyInputs | TreeVerifyInputs) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The verify forward over static inputs -> (logits [Bc, N, V] float32, features or None)."""
    hidden, feats = _hidden(model, cache, feature_layers, inp)
    return model.logits(hidden), feats


def prefill_forward(model, cache: PagedKVCache, feature_layers: FeatureSpec, inp: VerifyInputs | TreeVerifyInputs,
                    last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A prefill's forward over static inputs (one chain per prompt at cache length 0) ->
    (logits after each prompt [Bc, V] float32: node `last[r]` of row r, features [Bc, N, F] or
    None). Only the last node of each row goes through the LM head."""
    hidden, feats = _hidden(model, cache, feature_layers, inp)
    h = hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
    return model.logits(h[:, None])[:, 0], feats


@dataclass
class _Captured:
    inputs: VerifyInputs | TreeVerifyInputs  # the buffers the graph reads
    graph: "torch.cuda.CUDAGraph | None"
    flat: torch.Tensor | None = None         # TreeVerifyInputs: the one buffer its fields view
    last: torch.Tensor | None = None         # a prefill's: each row's last node [Bc]


class VerifyGraphs:
    """Verify steps at bucketed static shapes, one CUDA graph per (Bc, N, S, feature spec),
    captured lazily on first use. With `graph=False` the same padded computation runs eagerly
    (the CPU-testable "static eager" path). `tree_attention`: the steps attend through the Triton
    tree attention (TreeVerifyInputs, PagedTreeBatch); one graph per (Bc, N, feature spec).

    Prefills (`prefill`) run the same forward over one chain per prompt at cache length 0, with
    graphs of their own: only each row's last node goes through the LM head, so a long chain
    costs no [Bc, N, V] logits. Their outputs are shared by every prefill graph of one Bc (the
    logits) and of one Bc x N (the features)."""

    def __init__(self, model, cache: PagedKVCache, graph: bool = True,
                 batch_buckets: tuple[int, ...] = BATCH_BUCKETS, tree_attention: bool = False,
                 mixed_buckets: tuple[int, ...] = ()):
        """`mixed_buckets`: row buckets past `batch_buckets` that only steps carrying prompts
        (`run(mixed=True)`, NativeRunner.verify_and_prefill) take."""
        self.model, self.cache, self.graph, self.tree_attention = model, cache, graph, tree_attention
        self.device = cache.k[0].device
        if graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {self.device}")
        self.batch_buckets = tuple(sorted(batch_buckets))
        self.mixed_buckets = tuple(sorted(set(mixed_buckets) | set(batch_buckets)))
        self.pool = None                                   # one memory pool, made at the first capture
        self.warmed = False                                # warm_up ran: later captures are logged
        self._captured: dict[tuple, _Captured] = {}
        self._outputs: dict[tuple, VerifyStep] = {}        # (Bc, N, feature spec) -> static outputs
        self._shared_outputs: dict[tuple, VerifyStep] = {}  # (N, feature spec) -> the buffers they view
        self._output_rows: dict[tuple, int] = {}           # (N, feature spec) -> the most rows warm-up captures
        self._prefills: dict[tuple, _Captured] = {}        # (Bc, N, S, feature spec) -> a prefill's graph
        self._prefill_logits: dict[int, torch.Tensor] = {}           # Bc -> [Bc, V]
        self._prefill_features: dict[tuple, torch.Tensor] = {}       # (Bc * N, feature spec) -> flat

    def buckets(self, mixed: bool = False) -> tuple[int, ...]:
        return self.mixed_buckets if mixed else self.batch_buckets

    def supports(self, batch: int, mixed: bool = False) -> bool:
        return batch_bucket(batch, self.buckets(mixed)) is not None

    def warm_up(self, shapes: list[tuple], progress=None, prefill_shapes: list[tuple] = ()) -> None:
        """Captures the graph of every (Bc, N, S, feature spec) in `shapes` (verify steps,
        `verify_graph_shapes`) and in `prefill_shapes` (prefills) not captured yet, reporting
        "capturing CUDA graphs: i/total" to `progress`."""
        todo = [(self._capture, key) for key in shapes if key not in self._captured]
        todo += [(self._capture_prefill, key) for key in prefill_shapes if key not in self._prefills]
        for rows, n, _, layers in shapes:
            self._output_rows[(n, layers)] = max(rows, self._output_rows.get((n, layers), 0))
        for i, (capture, key) in enumerate(todo, 1):
            capture(*key)
            if progress is not None and (i == len(todo) or i % 10 == 0):
                progress(f"capturing CUDA graphs: {i}/{len(todo)}")
        self.warmed = True

    def run(self, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor, parents: torch.Tensor,
            node_valid: torch.Tensor, feature_layers: FeatureSpec,
            device_tokens: torch.Tensor | None = None, mixed: bool = False) -> VerifyStep:
        """The step for B <= max bucket requests (arguments as `NativeRunner.verify`; slots
        already reserved) -> its first B rows. `device_tokens` [B, N] on the device, when given,
        replaces token_ids in the step's inputs without the host reading it (multi-step decoding
        feeds each step the previous step's argmax this way). `mixed`: a step that carries
        prompts, which may take the mixed buckets."""
        b, n = token_ids.shape
        rows = batch_bucket(b, self.buckets(mixed))
        assert rows is not None, f"batch {b} is past the largest bucket {self.batch_buckets[-1]}"
        # The tree attention reads each row's length on the device: no span bucket.
        span, flat, inp = self._inputs(slots, cache_lens, token_ids, parents, node_valid, rows)
        if not self.graph:
            if inp is None:
                inp = tree_inputs_on(flat.to(self.device, non_blocking=True), rows, n)
            if device_tokens is not None:
                inp.token_ids[:b].copy_(device_tokens)
            logits, feats = verify_forward(self.model, self.cache, feature_layers, inp)
            return VerifyStep(logits, feats, logits.argmax(-1)).rows(b)
        step = self._captured.get((rows, n, span, feature_layers))
        if step is None:
            if self.warmed:
                captured_while_serving("VerifyGraphs", (rows, n, span, feature_layers))
            step = self._capture(rows, n, span, feature_layers)
        if inp is None:
            copy_tree_inputs(step.flat, step.inputs, flat)   # the step's inputs: one copy, and one of the tables
        else:
            step.inputs.copy_(inp)
        if device_tokens is not None:
            step.inputs.token_ids[:b].copy_(device_tokens)
        step.graph.replay()
        return self._outputs[(rows, n, feature_layers)].rows(b)

    def prefill(self, slots: list[int], token_ids: torch.Tensor, lens: list[int],
                feature_layers: FeatureSpec) -> tuple[torch.Tensor, torch.Tensor | None]:
        """A prefill of B <= max bucket prompts, one chain each at cache length 0: token_ids
        [B, N] the prompts padded to N nodes (the padding invalid), lens their lengths, the slots
        reserved for N entries -> (logits after each prompt [B, V] float32, a copy; features
        [B, N, F] or None, a view of the shared buffer, valid until the next prefill)."""
        b, n = token_ids.shape
        rows = batch_bucket(b, self.batch_buckets)
        assert rows is not None, f"batch {b} is past the largest bucket {self.batch_buckets[-1]}"
        parents = torch.arange(-1, n - 1).expand(b, n)
        valid = torch.arange(n)[None, :] < torch.tensor(lens)[:, None]
        last = torch.zeros(rows, dtype=torch.long, pin_memory=self.device.type == "cuda")
        last[:b] = torch.tensor(lens) - 1
        span, flat, inp = self._inputs(slots, [0] * b, token_ids, parents, valid, rows)
        if not self.graph:
            if inp is None:
                inp = tree_inputs_on(flat.to(self.device), rows, n)
            logits, feats = prefill_forward(self.model, self.cache, feature_layers, inp, last.to(self.device))
            return logits[:b], None if feats is None else feats[:b]
        step = self._prefills.get((rows, n, span, feature_layers))
        if step is None:
            if self.warmed:
                captured_while_serving("VerifyGraphs prefill", (rows, n, span, feature_layers))
            step = self._capture_prefill(rows, n, span, feature_layers)
        if inp is None:
            copy_tree_inputs(step.flat, step.inputs, flat)
        else:
            step.inputs.copy_(inp)
        step.last.copy_(last, non_blocking=True)
        step.graph.replay()
        feats = None if feature_layers is None else self._prefill_features[(rows * n, feature_layers)]
        return (self._prefill_logits[rows][:b].clone(),
                None if feats is None else feats.view(rows, n, -1)[:b])

    def _inputs(self, slots, cache_lens, token_ids, parents, node_valid, rows):
        """-> (span bucket or None, packed host inputs or None, VerifyInputs or None): the tree
        attention's packed inputs (span None), else the dense inputs at the span bucket."""
        n = token_ids.shape[1]
        if self.tree_attention:
            return None, host_tree_inputs(self.cache, slots, cache_lens, token_ids, parents, node_valid, rows), None
        span = span_bucket(max(cache_lens) + n, self.cache.max_len)
        return span, None, verify_inputs(self.cache, slots, cache_lens, token_ids, parents, node_valid, rows, span)

    def _padding(self, rows: int, n: int, span: int | None):
        """(padding inputs, their packed buffer or None) of a (Bc, N, S) graph."""
        if span is None:
            flat = padding_tree_flat(self.cache, rows, n)
            return tree_inputs_on(flat, rows, n), flat
        return padding_inputs(self.cache, rows, n, span), None

    def _feature_width(self, feature_layers: FeatureSpec) -> int:
        if feature_layers is None:
            return 0
        return self.model.spec.hidden_size * (1 if feature_layers == "final" else len(feature_layers))

    def _capture_prefill(self, rows: int, n: int, span: int | None, feature_layers: FeatureSpec) -> _Captured:
        inputs, flat = self._padding(rows, n, span)
        last = torch.zeros(rows, dtype=torch.long, device=self.device)
        logits_out = self._prefill_logits.get(rows)
        if logits_out is None:
            logits_out = torch.empty(rows, self.model.spec.vocab_size, device=self.device)
            self._prefill_logits[rows] = logits_out
        feats_out = None
        if feature_layers is not None:
            feats_out = self._prefill_features.get((rows * n, feature_layers))
            if feats_out is None:
                feats_out = torch.empty(rows * n * self._feature_width(feature_layers),
                                        dtype=next(self.model.parameters()).dtype, device=self.device)
                self._prefill_features[(rows * n, feature_layers)] = feats_out

        def body():
            logits, feats = prefill_forward(self.model, self.cache, feature_layers, inputs, last)
            logits_out.copy_(logits)
            if feats is not None:
                feats_out.view(feats.shape).copy_(feats)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        step = _Captured(inputs, capture_graph(body, self.pool, self.device), flat, last)
        self._prefills[(rows, n, span, feature_layers)] = step
        return step

    def _step_outputs(self, rows: int, n: int, feature_layers: FeatureSpec) -> VerifyStep:
        """The output buffers of the (Bc, N, feature spec) graphs: the first `rows` rows of buffers
        that every row bucket of one (N, feature spec) shares, sized at warm-up for the most rows
        it captures (a run copies its rows out before the next replay, as the span buckets'
        sharing already relies on). A larger capture later gets buffers of its own size, which
        the graphs after it share."""
        key = (n, feature_layers)
        whole = self._shared_outputs.get(key)
        if whole is None or whole.argmax.shape[0] < rows:
            spec = self.model.spec
            width = self._feature_width(feature_layers)
            dtype = next(self.model.parameters()).dtype
            size = max(rows, self._output_rows.get(key, 0))
            whole = VerifyStep(torch.empty(size, n, spec.vocab_size, device=self.device),
                               None if feature_layers is None else torch.empty(size, n, width, dtype=dtype,
                                                                               device=self.device),
                               torch.empty(size, n, dtype=torch.long, device=self.device))
            self._shared_outputs[key] = whole
        return VerifyStep(whole.logits[:rows], None if whole.features is None else whole.features[:rows],
                          whole.argmax[:rows])

    def _capture(self, rows: int, n: int, span: int | None, feature_layers: FeatureSpec) -> _Captured:
        inputs, flat = self._padding(rows, n, span)
        out = self._outputs.get((rows, n, feature_layers))
        if out is None:
            out = self._step_outputs(rows, n, feature_layers)
            self._outputs[(rows, n, feature_layers)] = out

        def body():
            logits, feats = verify_forward(self.model, self.cache, feature_layers, inputs)
            out.logits.copy_(logits)
            out.argmax.copy_(logits.argmax(-1))
            if feats is not None:
                out.features.copy_(feats)

        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        step = _Captured(inputs, capture_graph(body, self.pool, self.device), flat)
        self._captured[(rows, n, span, feature_layers)] = step
        return step


def verify_graph_shapes(max_slots: int, widths: list[int], max_len: int, feature_specs: list[FeatureSpec],
                        tree_attention: bool = False, batch_buckets: tuple[int, ...] = BATCH_BUCKETS) -> list[tuple]:
    """Every graph key (Bc, N, S, feature spec) `VerifyGraphs.run` asks for with at most
    `max_slots` rows, N in `widths` and any cache length: the batch buckets up to max_slots's,
    and every span bucket up to max_len (None with the tree attention, which reads lengths on the
    device). Example: max_slots 3, widths [5], max_len 100, [None] -> (1|2|4, 5, 32|64|100, None)."""
    top = batch_bucket(max_slots, batch_buckets)
    rows = [b for b in batch_buckets if top is None or b <= top]
    spans: list[int | None] = [None]
    if not tree_attention:
        spans = sorted({span_bucket(s, max_len) for s in [min(1 << k, max_len) for k in range(max_len.bit_length() + 1)]})
    return [(r, n, s, f) for r in rows for n in sorted(set(widths)) if n <= max_len for s in spans
            if s is None or s >= n for f in feature_specs]
