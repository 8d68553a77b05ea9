"""Target model runners: the native Llama-family runner over an explicit KV cache with tree
attention, and a transformers fallback for every other architecture (slower, same tokens:
verifier/hf_runner.py); `load_runner` picks one.

Cache convention (per request): the runner holds K/V for `cache_len = committed_len - 1`
positions; the root of a round (the last committed token) is not in the cache yet. `verify`
writes the tree's N nodes after the committed entries; `commit` keeps the accepted path
(compacting it onto the next positions) and drops the rest.

Features returned per position (what the draft head reads): None, "final" (last hidden after
the final norm, EAGLE-1/2) or a tuple of HF hidden-state indices (EAGLE-3's auxiliary layers).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from spectandem.cuda_graphs import batch_bucket, span_bucket
from spectandem.devices import to_device
from spectandem.kv_cache import KVCache, PackedPrefillBatch, PagedKVCache
from spectandem.modeling.llama import InvariantBatch, LlamaModel
from spectandem.modeling.ops import FUSED_OPS, INVARIANT_OPS
from spectandem.modeling.target import inspect_target, load_target
from verifier.graphs import VerifyGraphs, verify_forward, verify_graph_shapes, verify_inputs
from verifier.tree_inputs import tree_verify_inputs
from verifier.hf_runner import FeatureSpec, HFRunner

__all__ = ["FeatureSpec", "HFRunner", "NativeRunner", "load_runner"]


# With CUDA graphs, prompts of at most GRAPHED_PREFILL_MAX tokens prefill through a graph of the
# verify forward (one chain per prompt, padded to PREFILL_NODE_BUCKETS nodes) where the batch bucket
# times the chain length is at most GRAPHED_PREFILL_ROWS (the tokens of one forward; its features
# buffer: 2,048 x 12,288 bf16 for an 8B EAGLE-3 target, 48 MiB); longer prompts (and resumes past
# it) and larger batches prefill eagerly. On an H100 the 8B-shaped target prefills one prompt of
# 128 tokens in 8 ms graphed and 34 ms eagerly (benchmarks/prefill_timing.py).
GRAPHED_PREFILL_MAX = 512
GRAPHED_PREFILL_ROWS = 2048
# The chain lengths of prefill graphs: powers of two and 1.5 times them, so that a prompt pads by
# at most half its length (a prefill of a few prompts is compute-bound: the padding costs what
# tokens do; 129 tokens padded to 256 took the time of 256).
PREFILL_NODE_BUCKETS = (8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512)
# A graphed prefill of at most GRAPHED_PREFILL_FREE_ROWS rows (batch bucket x chain) beats the
# eager one however much of it is padding: the eager forward's kernel launches cost more than that
# much compute. Past it the prefill is compute-bound, and graphed only where the padding (of the
# chains and of the batch bucket) adds at most PREFILL_PAD_SHARE to the prompts' tokens: on an
# H100, 8 prompts of 133 tokens took 39 ms as 8 chains of 192 nodes and 34 ms eagerly; 4 of 133,
# 20 ms graphed (768 rows) and 27 ms eagerly (benchmarks/prefill_timing.py).
GRAPHED_PREFILL_FREE_ROWS = 1024
# A verify or plain decode step may carry new requests' prompts (`verify_and_prefill`,
# `decode_greedy`'s `prefill`), at most MIXED_PREFILL_TOKENS tokens of them (`mixed_count`): each
# prompt as rows of the step's width N at cache lengths 0, N, 2N, ... of its slot (`prompt_rows`).
# Every layer writes the step's K/V before its attention reads the pool, so a chunk's row sees the
# earlier chunks of its prompt as committed entries, and the prompts' tokens share the step's
# weight reads instead of paying a forward of their own (a graphed prefill of one 133-token
# prompt of the 8B-shaped target took about as long as a verify at batch 16 on an H100). With
# CUDA graphs, such steps replay graphs of MIXED_ROW_BUCKETS rows past the batch buckets.
MIXED_PREFILL_TOKENS = 256
MIXED_ROW_BUCKETS = (96, 128, 192, 256, 320, 384)
# Graphs past the batch buckets are captured for a width only while their rows times the width
# stay within MIXED_GRAPH_TOKENS: each holds logits of rows x width x vocabulary (float32), and a
# wide tree at full batch carries few prompt rows anyway (its prompts then prefill on their own).
MIXED_GRAPH_TOKENS = 2048
PREFILL_PAD_SHARE = 0.25
# Prompts that would prefill as several groups (of several padded lengths, or past the largest
# group) may instead prefill back to back in one eager forward (`_prefill_packed`), no padded row in
# its GEMMs, at most PACKED_PREFILL_TOKENS tokens a forward, where that costs less
# (`packed_prefill_plan`). Costs are in graphed rows: a graphed prefill of r rows costs
# PREFILL_GRAPH_ROWS + r (the fixed part is the weights' read: on an H100 the 8B-shaped target's
# graphed prefill took about 6.5 ms + 23 us a row), an eager forward of a group of r rows
# PREFILL_GRAPH_ROWS + max(r, PREFILL_EAGER_ROWS) (its launches: 34 to 38 ms for a few prompts), a
# packed forward of r tokens PREFILL_GRAPH_ROWS + max(r, PREFILL_PACKED_ROWS): its attention is one
# kernel a layer (spectandem/kernels/prefill_attention.py), and its launches take 19-28 ms. On an
# H200 (about 16 us a graphed row; benchmarks/results/prefill-attention-h200.txt): one prompt of 248
# tokens 19.1 ms packed, 9.1 ms graphed; four of 678 tokens 21-28 ms packed, 25 ms in three graphed
# groups; 16 of 2,287 tokens 53 against 84 ms.
# Example: 16 prompts of 32 to 249 tokens (2,287 in all) make 6 groups costing 4,224 rows, packed 2,543.
PACKED_PREFILL_TOKENS = 4096
PREFILL_GRAPH_ROWS = 256
PREFILL_EAGER_ROWS = 1280
PREFILL_PACKED_ROWS = 1024


def graphed_prefill_pays(rows: int, tokens: int) -> bool:
    """Whether a graphed prefill of `rows` padded rows for prompts of `tokens` tokens in all
    beats the eager prefill of those prompts."""
    return rows <= GRAPHED_PREFILL_FREE_ROWS or rows <= (1 + PREFILL_PAD_SHARE) * tokens


def prefill_nodes(length: int) -> int:
    """The chain a prompt of `length` tokens pads to in a graphed prefill; 0 past the largest
    bucket (eager)."""
    return next((n for n in PREFILL_NODE_BUCKETS if n >= length and n <= GRAPHED_PREFILL_MAX), 0)


def prompt_rows(prompts: list[list[int]], n: int):
    """The prompts as rows of width `n` (`MIXED_PREFILL_TOKENS`): row r holds tokens
    [k n, (k + 1) n) of prompt `owner[r]` as a chain at cache length k n, its nodes past the
    prompt invalid. -> (owner [R], cache length [R], token_ids, parents, node_valid [R, N]).
    Example: prompts of 3 and 5 tokens, n 4 -> owners [0, 1, 1], cache lengths [0, 0, 4]."""
    owner, base = [], []
    for i, p in enumerate(prompts):
        for k in range(0, len(p), n):
            owner.append(i)
            base.append(k)
    tokens = torch.zeros(len(owner), n, dtype=torch.long)
    valid = torch.zeros(len(owner), n, dtype=torch.bool)
    for r, (i, k) in enumerate(zip(owner, base)):
        chunk = prompts[i][k: k + n]
        tokens[r, : len(chunk)] = torch.tensor(chunk, dtype=torch.long)
        valid[r, : len(chunk)] = True
    parents = torch.arange(-1, n - 1).expand(len(owner), n).clone()
    return owner, base, tokens, parents, valid


def rows_of(length: int, n: int) -> int:
    """The rows of width n a prompt of `length` tokens takes (`prompt_rows`)."""
    return -(-length // n)


def mixed_count(lens: list[int], n: int) -> int:
    """How many of these prompts, in order, one step of width `n` carries: as many as keep their
    rows' nodes within MIXED_PREFILL_TOKENS."""
    used = 0
    for i, m in enumerate(lens):
        used += rows_of(m, n) * n
        if used > MIXED_PREFILL_TOKENS:
            return i
    return len(lens)


class NativeRunner:
    def __init__(self, model: LlamaModel, feature_layers: FeatureSpec, max_slots: int, max_len: int,
                 kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = False,
                 batch_invariant: bool = False, triton_attention: bool = False):
        """cuda_graphs: verify through CUDA graphs (verifier/graphs.py) for batches up to the
        largest bucket, eagerly beyond; needs a CUDA device.
        batch_invariant: prefill and verify through the batch-invariant kernels
        (spectandem/kernels/batch_invariant.py), so a token's logits do not depend on the batch or
        tree around it and greedy speculation equals plain decoding bit for bit in bf16; needs a
        CUDA device and Triton, runs eagerly (not with cuda_graphs).
        triton_attention: verify attends through the Triton paged tree attention
        (spectandem/kernels/attention.py, via PagedTreeBatch) instead of gathering the span and
        masking it densely; eager or with cuda_graphs; prefill keeps the dense path. Needs a CUDA
        device and Triton (tests set the attribute after construction to run the same path on the
        torch reference). The model then runs the fused ops (spectandem/modeling/ops.py):
        fewer launches, the same bits.
        `self.model` is the model under the ops this runner runs (`model.with_ops`: the same
        weights); `model` itself is left as it is."""
        s = model.spec
        self.spec, self.feature_layers = s, feature_layers
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        self.max_len = max_len
        self.max_slots = max_slots
        if triton_attention:
            _check_triton_attention(self.device, batch_invariant)
            model = model.with_ops(FUSED_OPS)
        self.model = model
        self.batch_invariant = batch_invariant
        # The same weights under the batch-invariant kernels: prefill and verify where
        # `batch_invariant` (tests set it after construction to run that path on the CPU).
        self.invariant_model = model.with_ops(INVARIANT_OPS)
        if batch_invariant:
            _check_batch_invariant(self.device, cuda_graphs)
        self.triton_attention = triton_attention
        self._mixed_widths: set[int] = set()   # widths with graphs past the batch buckets (`mixed_graph_shapes`)
        self.set_cache(kv_blocks, block_size, cuda_graphs)

    def set_cache(self, kv_blocks: int | None, block_size: int, cuda_graphs: bool) -> None:
        """A new, empty KV pool of `kv_blocks` (None: every slot at full context), and new graphs
        on it where `cuda_graphs` (the factory's profiling pass runs on a small pool first). No
        request may be held."""
        s = self.spec
        self.cache = self.graphs = None   # the old pool goes before the new one is allocated
        self.cache = PagedKVCache(s.num_layers, self.max_slots, s.num_kv_heads, self.max_len, s.head_dim, self.dtype,
                                  self.device, num_blocks=kv_blocks, block_size=block_size)
        self.graphs = (VerifyGraphs(self.model, self.cache, tree_attention=self.triton_attention,
                                    mixed_buckets=MIXED_ROW_BUCKETS) if cuda_graphs else None)

    def kv_stats(self) -> dict:
        return self.cache.stats()

    def graph_shapes(self, widths: list[int]) -> list[tuple]:
        """The verify graphs this runner replays for trees of N in `widths` (plain steps: 1), with
        and without features."""
        if self.graphs is None:
            return []
        feats = [None] + ([self.feature_layers] if self.feature_layers is not None else [])
        shapes = verify_graph_shapes(self.max_slots, list(widths) + [1], self.max_len, feats, self.triton_attention,
                                     self.graphs.batch_buckets)
        seen = set(shapes)
        return shapes + [k for k in self.mixed_graph_shapes(widths) if k not in seen]

    def mixed_graph_shapes(self, widths: list[int]) -> list[tuple]:
        """The graphs of steps that carry prompts (`verify_and_prefill`, `decode_greedy`), for
        plain steps and the widest tree of `widths`: every bucket of rows up to max_slots plus
        the rows of MIXED_PREFILL_TOKENS (`_mixed_top`), with the runner's features."""
        if self.graphs is None:
            return []
        self._mixed_widths = {n for n in {1, max(widths, default=1)} if n <= self.max_len}
        return [key for n in sorted(self._mixed_widths)
                for key in verify_graph_shapes(self._mixed_top(n), [n], self.max_len, [self.feature_layers],
                                               self.triton_attention, self.graphs.buckets(mixed=True))]

    def _mixed_top(self, n: int) -> int:
        """The most rows a step of width n that carries prompts runs in graphs warm-up captured:
        the batch buckets' top for max_slots, and for the widths of `mixed_graph_shapes` the
        bucket of max_slots plus MIXED_PREFILL_TOKENS' rows where within MIXED_GRAPH_TOKENS."""
        top = batch_bucket(self.max_slots, self.graphs.batch_buckets) or self.graphs.batch_buckets[-1]
        if n in self._mixed_widths:
            mixed = batch_bucket(self.max_slots + -(-MIXED_PREFILL_TOKENS // n), self.graphs.buckets(mixed=True))
            top = max([top] + [b for b in self.graphs.buckets(mixed=True)
                               if b <= (mixed or 0) and b * n <= MIXED_GRAPH_TOKENS])
        return top

    def prefill_graph_shapes(self) -> list[tuple]:
        """The prefill graphs this runner replays (`_graphed_prefill_nodes`): chains of 8 to
        GRAPHED_PREFILL_MAX nodes (PREFILL_NODE_BUCKETS) at every batch bucket up to max_slots's
        where the bucket times the chain is at most GRAPHED_PREFILL_ROWS, with the runner's
        features."""
        if self.graphs is None:
            return []
        top = batch_bucket(self.max_slots, self.graphs.batch_buckets)
        rows = [r for r in self.graphs.batch_buckets if top is None or r <= top]
        shapes = []
        for n in PREFILL_NODE_BUCKETS:
            if n > min(GRAPHED_PREFILL_MAX, self.max_len):   # cache length 0: one span
                break
            span = None if self.triton_attention else span_bucket(n, self.max_len)
            shapes += [(r, n, span, self.feature_layers) for r in rows if r * n <= GRAPHED_PREFILL_ROWS]
        return shapes

    def warm_up(self, widths: list[int], progress=None) -> None:
        """Captures every verify graph of `graph_shapes(widths)` and every prefill graph now, so
        none is captured while serving; nothing without CUDA graphs (the CPU)."""
        if self.graphs is not None and self.graphs.graph:
            self.graphs.warm_up(self.graph_shapes(widths), progress, self.prefill_graph_shapes())

    def _features(self, hidden, aux):
        if self.feature_layers is None:
            return None
        return hidden if self.feature_layers == "final" else aux

    def _capture(self) -> tuple[int, ...]:
        return self.feature_layers if isinstance(self.feature_layers, tuple) else ()

    @torch.no_grad()
    def prefill(self, slots: list[int], prompts: list[list[int]]):
        """-> (logits after each prompt [B, V], features per request [[P_b, F]] or None).
        With CUDA graphs, the prompts prefill in groups of one padded length (`prefill_groups`),
        each as one chain per prompt through a prefill graph (`_prefill_graphed`) where it fits,
        else eagerly, or back to back in packed forwards (`_prefill_packed`) where those cost less
        (`packed_prefill_plan`); without, in one eager forward."""
        if self.graphs is not None and not self.batch_invariant and len(prompts) > 1:
            lens = [len(p) for p in prompts]
            groups = prefill_groups(lens, self.graphs.batch_buckets)
            packed = packed_prefill_plan(lens, groups, self.graphs.batch_buckets, self.cache.max_len)
            if len(groups) > 1 or packed:
                logits, feats = [None] * len(prompts), [None] * len(prompts)
                plan = [(self._prefill_packed, idx) for idx in packed] if packed else \
                    [(self._prefill_one_group, idx) for idx in groups]
                for run, idx in plan:
                    lg, fs = run([slots[i] for i in idx], [prompts[i] for i in idx])
                    for j, i in enumerate(idx):
                        logits[i], feats[i] = lg[j], None if fs is None else fs[j]
                return torch.stack(logits), None if self.feature_layers is None else feats
        return self._prefill_one_group(slots, prompts)

    def _prefill_packed(self, slots: list[int], prompts: list[list[int]]):
        """`prefill` of the prompts back to back in one eager forward (kv_cache.PackedPrefillBatch):
        every GEMM over their tokens alone, each prompt attending over its own entries."""
        lens = [len(p) for p in prompts]
        for slot, m in zip(slots, lens):
            self.cache.reserve(slot, m)
        view = PackedPrefillBatch.of(self.cache, slots, lens)
        toks = to_device(torch.tensor([t for p in prompts for t in p], dtype=torch.long)[None], self.device)
        positions = to_device(torch.from_numpy(np.concatenate([np.arange(m) for m in lens]))[None], self.device)
        hidden, aux = self.model(toks, positions, view, None, self._capture())
        ends = np.cumsum(lens)
        last = hidden[0].index_select(0, to_device(torch.from_numpy(ends - 1), self.device))
        feats = self._features(hidden, aux)
        per_req = None if feats is None else [feats[0, e - m: e] for e, m in zip(ends.tolist(), lens)]
        return self.model.logits(last[:, None])[:, 0], per_req

    def _prefill_one_group(self, slots: list[int], prompts: list[list[int]]):
        if self.graphs is not None and not self.batch_invariant and self._padding_fits(
                slots, self._graphed_prefill_nodes(prompts)):
            return self._prefill_graphed(slots, prompts)
        for slot, p in zip(slots, prompts):
            self.cache.reserve(slot, len(p))
        lens = torch.tensor([len(p) for p in prompts], device=self.device)
        t = int(lens.max())
        toks = torch.zeros(len(prompts), t, dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):
            toks[i, : len(p)] = torch.tensor(p, device=self.device)
        ar = torch.arange(t, device=self.device)
        positions = ar.expand(len(prompts), t)
        real = ar[None] < lens[:, None]                                               # [B, T]
        write = torch.where(real, positions, self.cache.trash_index)
        mask = (ar[None, None, :] <= ar[None, :, None]) & real[:, :, None]
        mask[:, :, 0] |= True  # padding rows attend somewhere; never read
        slot_t = torch.tensor(slots, device=self.device)
        if self.batch_invariant:
            hidden, aux = self.invariant_model(toks, positions, self._prefill_keys(slot_t, write, real), None,
                                               self._capture())
        else:
            hidden, aux = self.model(toks, positions, self.cache.batch(slot_t, write, t), mask, self._capture())
        last = hidden.gather(1, (lens - 1)[:, None, None].expand(-1, 1, hidden.shape[-1]))
        feats = self._features(hidden, aux)
        per_req = None if feats is None else [feats[i, : len(p)] for i, p in enumerate(prompts)]
        logits = (self.invariant_model if self.batch_invariant else self.model).logits(last)
        return logits[:, 0], per_req

    def _graphed_prefill_nodes(self, prompts: list[list[int]]) -> int:
        """`graphed_prefill_chain` of these prompts on this runner's graphs and cache."""
        return graphed_prefill_chain([len(p) for p in prompts], self.graphs.batch_buckets, self.cache.max_len)

    def _padding_fits(self, slots: list[int], n: int) -> bool:
        """Whether the pool holds `n` entries for each slot now (a graphed prefill's chains,
        padding included, until it trims them): False for n = 0 (no graphed prefill), and where
        the padding would take blocks a prompt alone would not need (a pool near full)."""
        blocks = self.cache.blocks
        return n > 0 and sum(blocks.missing(s, n) for s in slots) <= len(blocks.free)

    def _prefill_graphed(self, slots: list[int], prompts: list[list[int]]):
        """`prefill` as one chain per prompt at cache length 0 through a prefill graph
        (VerifyGraphs.prefill), padded to `prefill_nodes` nodes (the padding nodes invalid): node
        j is the prompt's token j at position j, seeing tokens 0..j, its K/V written at entry j,
        as the eager prefill does; the padding's entries lie past the prompt, where the next
        verify writes. One captured graph per (batch bucket, node bucket) instead of an eager
        forward, which the host's kernel launches make several times slower."""
        b, lens = len(prompts), [len(p) for p in prompts]
        n = self._graphed_prefill_nodes(prompts)
        for slot in slots:
            self.cache.reserve(slot, n)
        tokens = torch.zeros(b, n, dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(p, dtype=torch.long)
        logits, feats = self.graphs.prefill(slots, tokens, lens, self.feature_layers)
        for slot, m in zip(slots, lens):   # the padding's blocks back to the pool (the next verify writes there)
            self.cache.trim(slot, m)
        # Copies: the graph's features buffer is the next prefill's too.
        per_req = None if feats is None else [feats[i, :m].clone() for i, m in enumerate(lens)]
        return logits, per_req

    chains_decode = True         # decode_greedy

    @torch.no_grad()
    def verify(self, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor, parents: torch.Tensor,
               node_valid: torch.Tensor):
        """One forward over every tree node. token_ids, parents [B, N]; node_valid [B, N].
        -> (logits [B, N, V] float32, features [B, N, F] or None)."""
        b, n = token_ids.shape
        self.cache.reserve_many(slots, [c + n for c in cache_lens])
        logits, feats, _ = self._step(slots, cache_lens, token_ids, parents, node_valid)
        return logits, feats

    def _mixable(self, b: int, n: int, prompt_slots: list[int], prompts: list[list[int]]) -> int:
        """How many of the prompts (in order) a step of b rows of width n carries: within
        MIXED_PREFILL_TOKENS, within a graph bucket that warm-up captured (with CUDA graphs),
        and where the pool holds their rows' entries (the last chunk's padding included, until
        `_mixed_step` trims it). The step's own rows must be reserved already."""
        if self.batch_invariant or not prompts:
            return 0
        k = mixed_count([len(p) for p in prompts], n)
        k = next((i for i, p in enumerate(prompts[:k]) if rows_of(len(p), n) * n > self.max_len), k)
        blocks = self.cache.blocks
        while k:
            rows = b + sum(rows_of(len(p), n) for p in prompts[:k])
            need = sum(blocks.missing(s, rows_of(len(p), n) * n) for s, p in zip(prompt_slots[:k], prompts[:k]))
            graphed = self.graphs is None or (self.graphs.supports(rows, mixed=True) and (
                not self.graphs.warmed or rows <= self._mixed_top(n)))   # after warm-up: only what it captured
            if graphed and need <= len(blocks.free):
                return k
            k -= 1
        return 0

    def _mixed_step(self, slots, cache_lens, token_ids, parents, node_valid, prompt_slots, prompts,
                    device_tokens=None, features: bool = True):
        """`_step` of the rows with the prompts' rows (`prompt_rows`) after them -> (logits,
        features, argmax of the step's own rows; logits after each prompt [P, V]; features per
        prompt [[len, F]] or None). The slots of the step's rows must be reserved."""
        b, n = token_ids.shape
        owner, base, toks, pars, valid = prompt_rows(prompts, n)
        for slot, p in zip(prompt_slots, prompts):
            self.cache.reserve(slot, rows_of(len(p), n) * n)
        if device_tokens is not None:   # the step's own rows read the device's tokens; the prompts' the host's
            device_tokens = torch.cat([device_tokens, to_device(toks, self.device)])
        logits, feats, argmax = self._step(list(slots) + [prompt_slots[i] for i in owner], list(cache_lens) + base,
                                           torch.cat([token_ids, toks]), torch.cat([parents, pars]),
                                           torch.cat([node_valid.bool(), valid]), device_tokens, features, mixed=True)
        last_row = np.cumsum([rows_of(len(p), n) for p in prompts]) - 1 + b
        last_node = [(len(p) - 1) % n for p in prompts]
        dev = logits.device
        first = logits[to_device(last_row.tolist(), dev), to_device(last_node, dev)]
        per = None
        if feats is not None:
            flat = feats[b:].reshape(-1, feats.shape[-1])
            starts = np.concatenate([[0], np.cumsum([rows_of(len(p), n) * n for p in prompts])[:-1]]).tolist()
            per = [flat[st: st + len(p)] for st, p in zip(starts, prompts)]
        for slot, p in zip(prompt_slots, prompts):   # the last chunk's padding back to the pool
            self.cache.trim(slot, len(p))
        return logits[:b], None if feats is None else feats[:b], argmax[:b], first, per

    @torch.no_grad()
    def verify_and_prefill(self, slots: list[int], cache_lens: list[int], token_ids: torch.Tensor,
                           parents: torch.Tensor, node_valid: torch.Tensor, prompt_slots: list[int],
                           prompts: list[list[int]]):
        """`verify` with new requests' prompts in the same forward, as many of them as it carries
        (`_mixable`, in order) -> (logits [B, N, V], features [B, N, F] or None, how many prompts
        it prefilled (k), logits after each of them [k, V], their features [[len, F]] or None).
        The caller prefills the rest. Each prompt's slot is empty; its KV afterwards is as after
        `prefill`."""
        b, n = token_ids.shape
        self.cache.reserve_many(slots, [c + n for c in cache_lens])
        k = self._mixable(b, n, prompt_slots, prompts)
        if k == 0:
            logits, feats, _ = self._step(slots, cache_lens, token_ids, parents, node_valid)
            return logits, feats, 0, None, None
        logits, feats, _, first, per = self._mixed_step(slots, cache_lens, token_ids, parents, node_valid,
                                                        prompt_slots[:k], prompts[:k])
        return logits, feats, k, first, per

    def _step(self, slots, cache_lens, token_ids, parents, node_valid, device_tokens=None, features: bool = True,
              mixed: bool = False):
        """The verify forward on the runner's path (slots reserved) -> (logits, features, argmax
        [B, N] on the device). `device_tokens` [B, N] on the device (decode_greedy's previous
        step's argmax) replaces token_ids, read there without the host waiting for it.
        `features` False: none captured (the same logits; graphs of their own). `mixed`: a step
        that carries prompts (`_mixed_step`): it may take the graphs' mixed buckets."""
        b, n = token_ids.shape
        layers = self.feature_layers if features else None
        if self.batch_invariant:
            toks = token_ids if device_tokens is None else device_tokens
            logits, feats = self._verify_invariant(slots, cache_lens, toks, parents, node_valid)
            return logits, feats if features else None, logits.argmax(-1)
        if self.graphs is not None and self.graphs.supports(b, mixed=mixed):
            step = self.graphs.run(slots, cache_lens, token_ids, parents, node_valid, layers, device_tokens, mixed)
            return step.logits, step.features, step.argmax
        # Eagerly: the static-shape step without padding (rows = B; dense: span = max(cache_len) + N).
        if self.triton_attention:
            inp = tree_verify_inputs(self.cache, slots, cache_lens, token_ids, parents, node_valid, b)
        else:
            inp = verify_inputs(self.cache, slots, cache_lens, token_ids, parents, node_valid, b,
                                max(cache_lens) + n)
        if device_tokens is not None:
            inp.token_ids[:b].copy_(device_tokens)
        logits, feats = verify_forward(self.model, self.cache, layers, inp)
        return logits, feats, logits.argmax(-1)

    @torch.no_grad()
    def decode_greedy(self, slots: list[int], cache_lens: list[int], last_tokens: list[int], steps: int,
                      features: bool = True, prompt_slots: list[int] = (), prompts: list[list[int]] = ()):
        """Plain greedy decoding of `steps` tokens per request, each step a one-node verify whose
        token is the previous step's argmax, fed on the device: the host prepares step s + 1
        while the device runs step s, and waits only for the caller's read of the result.
        Request b's KV holds cache_len_b entries and its last committed token is last_tokens[b]
        (the first step's input). Afterwards each holds cache_len_b + steps entries: every
        step's input, the last output excluded, as after `steps` verify/commit rounds.
        -> (tokens [B, steps] int64 on the device, features [B, steps, F] or None: step s's
        features are those of its input, as a verify's are of its accepted path; None as well
        with `features` False, when no caller wants them).
        `prompts` (new requests' prompts, their empty slots `prompt_slots`): the first step
        carries as many of them as it can (`_mixable`, in order), as `verify_and_prefill`
        does; then the result has three more entries: how many it prefilled (k), the logits
        after each of them [k, V] and their features ([[len, F]] or None)."""
        b = len(slots)
        self.cache.reserve_many(slots, [c + steps for c in cache_lens])
        parents = torch.full((b, 1), -1, dtype=torch.long)
        valid = torch.ones(b, 1, dtype=torch.bool)
        placeholder = torch.zeros(b, 1, dtype=torch.long)
        cur = torch.tensor(last_tokens, dtype=torch.long).view(b, 1).to(self.device, non_blocking=True)
        k = self._mixable(b, 1, list(prompt_slots), list(prompts)) if prompts else 0
        first = per = None
        tokens, feats = [], []
        for s in range(steps):
            lens = [c + s for c in cache_lens]
            if s == 0 and k:   # the prompts' features are wanted whether the step's are or not
                _, f, argmax, first, per = self._mixed_step(slots, lens, placeholder, parents, valid,
                                                            prompt_slots[:k], prompts[:k], cur,
                                                            features or self.feature_layers is not None)
                f = f if features else None
            else:
                _, f, argmax = self._step(slots, lens, placeholder, parents, valid, cur, features)
            cur = argmax                 # graphs: a copy of the step's output; eager: its own
            tokens.append(cur)
            feats.append(f)
        out = torch.cat(tokens, dim=1)
        feats = None if feats[0] is None else torch.cat(feats, dim=1)
        return (out, feats, k, first, per) if prompts else (out, feats)

    def _prefill_keys(self, slot_t: torch.Tensor, write: torch.Tensor, real: torch.Tensor) -> InvariantBatch:
        """Prompt token t reads entries 0..t (itself included) through the table: the keys it
        would read decoded alone. Padding rows (`real` False) read only their own trash row."""
        rows = self.cache.rows(slot_t, write)                                         # [B, T]
        upto = torch.arange(1, write.shape[1] + 1, device=self.device)
        return InvariantBatch(self.cache, rows, self.cache._tables[slot_t], torch.where(real, upto, 0),
                              rows[..., None], (~real).long())

    def _verify_invariant(self, slots, cache_lens, token_ids, parents, node_valid):
        """`verify` through the invariant ops: node j (written at cache_len + j) reads
        the committed entries, then its path from the root."""
        from spectandem.kernels.batch_invariant import tree_paths

        b, n = token_ids.shape
        slot_t = torch.tensor(slots, device=self.device)
        base = torch.tensor(cache_lens, device=self.device)[:, None]                   # [B, 1]
        write = self.cache.rows(slot_t, base + torch.arange(n, device=self.device))     # [B, N]
        path_rows, path_lens = tree_paths(parents.to(self.device), node_valid.to(self.device), write)
        keys = InvariantBatch(self.cache, write, self.cache._tables[slot_t], base.expand(b, n), path_rows, path_lens)
        hidden, aux = self.invariant_model(token_ids.clamp(min=0).to(self.device), base + path_lens - 1, keys, None,
                                           self._capture())
        return self.invariant_model.logits(hidden), self._features(hidden, aux)

    @torch.no_grad()
    def features(self, tokens: list[int]) -> torch.Tensor | None:
        """[len(tokens), F] features of a causal forward over `tokens`, in a scratch cache."""
        if self.feature_layers is None:
            return None
        s = self.spec
        t = len(tokens)
        scratch = KVCache(s.num_layers, 1, s.num_kv_heads, t, s.head_dim, self.dtype, self.device)
        pos = torch.arange(t, device=self.device)[None]
        mask = torch.tril(torch.ones(t, t, dtype=torch.bool, device=self.device))[None]
        hidden, aux = self.model(torch.tensor([tokens], device=self.device), pos,
                                 scratch.batch(torch.zeros(1, dtype=torch.long, device=self.device), pos, t),
                                 mask, self._capture())
        return self._features(hidden, aux)[0]

    def commit(self, slots: list[int], cache_lens: list[int], accepted_nodes: torch.Tensor) -> None:
        """Keeps the accepted path: accepted_nodes [B, A] node indices (root first, -1 padded),
        node j was written at cache_len + j and moves to cache_len + its rank on the path.
        Example: cache_len 10, path [0, 2, 5] -> entries 10, 12, 15 move to 10, 11, 12. A path
        whose node j has rank j (every chain, a decode step) is already in place: nothing moves.
        accepted_nodes is a host result: nothing here waits for the device."""
        nodes = accepted_nodes.cpu().numpy()                  # [B, A] (numpy: this runs every round)
        ok = nodes >= 0
        kept = ok.sum(1).tolist()
        rank = np.arange(nodes.shape[1])[None]
        if (ok & (nodes != rank)).any():
            base = np.asarray(cache_lens, dtype=np.int64)[:, None]                       # [B, 1]
            trash = self.cache.trash_index
            self.cache.compact(slots, torch.from_numpy(np.where(ok, base + nodes, trash)),
                               torch.from_numpy(np.where(ok, base + rank, trash)))
        # The tree's scratch past the committed entries goes back to the pool.
        self.cache.trim_many(slots, [c + k for c, k in zip(cache_lens, kept)])

    def trim(self, slot: int, num_entries: int) -> None:
        """The slot's blocks past its first `num_entries` entries go back to the pool (a decode
        ahead that nobody took: verifier/engine.py)."""
        self.cache.trim(slot, num_entries)

    def release(self, slot: int) -> None:
        self.cache.free(slot)


def prefill_groups(lens: list[int], batch_buckets: tuple[int, ...]) -> list[list[int]]:
    """The prompts of a graphed prefill (their lengths) in groups, as indices: one group per
    padded length (`prefill_nodes`), each cut into runs of at most the
    largest batch bucket whose rows at that length stay within GRAPHED_PREFILL_ROWS; the prompts
    past GRAPHED_PREFILL_MAX in one group (eager). A batch of mixed lengths pads each prompt to
    its own group's length instead of the longest's, and each group fits one prefill graph.
    Example: lens [100, 20, 300, 120], buckets (1, 2, 4, 8) -> [[1], [0, 3], [2]]."""
    by_n: dict[int, list[int]] = {}
    for i, m in enumerate(lens):
        by_n.setdefault(prefill_nodes(m), []).append(i)
    groups = []
    for n in sorted(by_n, key=lambda n: n or float("inf")):
        idx = by_n[n]
        fit = [b for b in batch_buckets if b * n <= GRAPHED_PREFILL_ROWS]
        size = max(fit) if n and fit else len(idx)
        groups += [idx[k: k + size] for k in range(0, len(idx), size)]
    return groups


def graphed_prefill_chain(lens: list[int], batch_buckets: tuple[int, ...], max_len: int) -> int:
    """The chain length a graphed prefill of prompts of `lens` tokens pads to (`prefill_nodes` of
    the longest), or 0 where they prefill eagerly: a prompt past GRAPHED_PREFILL_MAX tokens, a chain
    past the cache's length `max_len`, a graph whose logits would hold more than
    GRAPHED_PREFILL_ROWS rows (its static buffers stay), or one whose padding costs more than the
    eager forward's launches save (`graphed_prefill_pays`)."""
    n, rows = prefill_nodes(max(lens)), batch_bucket(len(lens), batch_buckets)
    fits = n > 0 and n <= max_len and rows is not None and rows * n <= GRAPHED_PREFILL_ROWS
    return n if fits and graphed_prefill_pays(rows * n, sum(lens)) else 0


def packed_runs(lens: list[int]) -> list[list[int]]:
    """Prompts of `lens` tokens in order, as the fewest runs of at most PACKED_PREFILL_TOKENS tokens
    (a longer prompt alone) with about even shares of the tokens. Example: 64 prompts of 133
    tokens -> runs of 22, 22 and 20."""
    total = sum(lens)
    share = -(-total // -(-total // PACKED_PREFILL_TOKENS))   # the tokens of each of the fewest runs, evened
    runs, tokens = [[]], 0
    for i, m in enumerate(lens):
        if runs[-1] and (tokens >= share or tokens + m > PACKED_PREFILL_TOKENS):
            runs.append([])
            tokens = 0
        runs[-1].append(i)
        tokens += m
    return runs


def packed_prefill_plan(lens: list[int], groups: list[list[int]], batch_buckets: tuple[int, ...],
                        max_len: int) -> list[list[int]] | None:
    """The prompts of a graphed runner's prefill (their lengths) in `packed_runs`, one packed forward
    each, where these cost less than `groups` (`prefill_groups`, each graphed or eager as
    `graphed_prefill_chain` says); None where the groups cost less. Costs: PACKED_PREFILL_TOKENS'
    comment. Examples: lens [248, 226, 42, 162, 135, 244] (3 groups, 2,224 rows with their fixed
    parts) -> [[0, 1, 2, 3, 4, 5]] (1,313 rows); 64 prompts of 133 tokens (8 eager groups, 12,288
    rows) -> runs of 22, 22 and 20 (9,280 rows)."""
    def group_cost(idx: list[int]) -> int:
        group = [lens[i] for i in idx]
        n = graphed_prefill_chain(group, batch_buckets, max_len)
        rows = batch_bucket(len(group), batch_buckets) * n if n else len(group) * max(group)
        return PREFILL_GRAPH_ROWS + (rows if n else max(PREFILL_EAGER_ROWS, rows))

    runs = packed_runs(lens)
    packed = sum(PREFILL_GRAPH_ROWS + max(PREFILL_PACKED_ROWS, sum(lens[i] for i in run)) for run in runs)
    return runs if packed < sum(group_cost(g) for g in groups) else None


def _check_batch_invariant(device: torch.device, cuda_graphs: bool) -> None:
    from spectandem.kernels import HAVE_TRITON

    if device.type != "cuda" or not HAVE_TRITON:
        raise ValueError(f"batch_invariant needs a CUDA device and the triton package; the model is on {device}, "
                         f"triton is {'installed' if HAVE_TRITON else 'not installed'}")
    if cuda_graphs:
        raise ValueError("batch_invariant verify runs eagerly; it cannot be combined with cuda_graphs=True")


def _check_triton_attention(device: torch.device, batch_invariant: bool) -> None:
    from spectandem.kernels import HAVE_TRITON

    if device.type != "cuda" or not HAVE_TRITON:
        raise ValueError(f"triton_attention needs a CUDA device and the triton package; the model is on {device}, "
                         f"triton is {'installed' if HAVE_TRITON else 'not installed'}")
    if batch_invariant:
        raise ValueError("triton_attention and batch_invariant are two verify paths; choose one "
                         "(batch_invariant already attends through its own Triton kernel)")


def load_runner(target_dir: str | Path, feature_layers: FeatureSpec, max_slots: int, max_len: int | None,
                dtype: torch.dtype = torch.float32, device: str = "cpu", force_hf: bool = False,
                kv_blocks: int | None = None, block_size: int = 16, cuda_graphs: bool = False,
                batch_invariant: bool = False, triton_attention: bool = False):
    """Native runner for Llama-family checkpoints, transformers otherwise (or when forced).
    Returns (runner, the loaded model: native LlamaModel or transformers'). `cuda_graphs`
    (native runner only): verify steps run as CUDA graphs. `batch_invariant` (native runner
    only): prefill and verify through the batch-invariant kernels (NativeRunner).
    `triton_attention` (native runner only): verify attends through the Triton paged tree
    attention (NativeRunner)."""
    target = inspect_target(target_dir, max_len, force_hf)
    if target.native:
        model = load_target(target, dtype, device)
        return NativeRunner(model, feature_layers, max_slots, target.max_len, kv_blocks, block_size, cuda_graphs,
                            batch_invariant, triton_attention), model
    arch = target.architecture
    if cuda_graphs:
        raise ValueError(f"{target_dir}: CUDA graphs need the native runner; architecture {arch!r} "
                         f"(force_hf={force_hf}) runs on transformers")
    if batch_invariant:
        raise ValueError(f"{target_dir}: batch-invariant verification needs the native runner; architecture "
                         f"{arch!r} (force_hf={force_hf}) runs on transformers")
    if triton_attention:
        raise ValueError(f"{target_dir}: the Triton tree attention needs the native runner; architecture "
                         f"{arch!r} (force_hf={force_hf}) runs on transformers")
    model = load_target(target, dtype, device)
    return HFRunner(model, feature_layers, target.max_len), model

