"""Fused mode ("naive EAGLE"): one draft token per round, and a round is one step, with the
drafter engine in the verifier's process (`spectandem generate --fused`). The drafter is reached
through its engine's calls and its proposer's head and cache, never imported.

The step runs the target's verify over [root, draft], commits, runs the head's catch-up over
the accepted pairs with the real target features, and reads the next round's draft off the
catch-up logits.

`FusedStep` composes the engines' own calls (verify, extend, draft): any request, any rule.
`FusedGraphStep` is the same round for greedy requests as ONE static-shape computation: the
target's forward over the two nodes, the greedy verdict, the head's forward over both possible
pairs, and the next draft, chosen on the device. On the GPU it is one CUDA graph replay per
round; `graph=False` runs the same computation eagerly (the CPU tests compare it with FusedStep).

Why both pairs: with root token t and draft x at positions L-1 and L, the target's argmax a0
after the root equals x exactly when x is accepted. The head then absorbs (f0, a0) and, only
if x was accepted, (f1, a1), where f are the target features and a1 the bonus. Both pairs are
always computed; the next draft is read off the row of the last real pair. A rejected round's
second pair sits at head cache index L, past the head's new length, and the next round writes
over it. The committed tokens are the target's greedy tokens either way, so the output is exactly
plain decoding's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from spectandem.devices import to_host
from spectandem.messages import DraftTree
from spectandem.protocol import Tag, Verdict


class FusedStep:
    def __init__(self, verifier, drafter, graph_step: "FusedGraphStep | None" = None):
        if drafter.cfg.num_draft_tokens != 2:
            raise ValueError(f"fused mode needs num_draft_tokens == 2, got {drafter.cfg.num_draft_tokens}")
        self.verifier, self.drafter, self.graph_step = verifier, drafter, graph_step

    def __call__(self, tree: DraftTree) -> tuple[list[Verdict], DraftTree]:
        """Verify `tree`, extend the head, and draft the next round for the same requests."""
        if self.graph_step is not None and self.graph_step.supports(tree):
            return self.graph_step(tree)
        outs = self.verifier.verify(tree)
        self.drafter.extend(outs)
        return outs, self.drafter.draft(tree.request_ids)


@dataclass
class _Inputs:
    verify: object                 # VerifyInputs or TreeVerifyInputs (verifier/graphs.py), N = 2
    head_write: torch.Tensor       # [Bc, 2] physical head-cache rows of the two pairs
    head_read: torch.Tensor        # [Bc, S] physical rows of head-cache entries 0..S-1
    head_mask: torch.Tensor        # [Bc, 2, S] bool
    head_positions: torch.Tensor   # [Bc, 2] RoPE positions L-1, L

    def copy_(self, other: "_Inputs") -> None:
        self.verify.copy_(other.verify)
        for name in ("head_write", "head_read", "head_mask", "head_positions"):
            getattr(self, name).copy_(getattr(other, name))


@dataclass
class _Outputs:
    argmax: torch.Tensor           # [Bc, 2] the target's argmax after the root and after the draft
    accepted: torch.Tensor         # [Bc] bool
    next_draft: torch.Tensor       # [Bc] target ids
    last_hidden: torch.Tensor      # [Bc, H] head output of the last real pair
    last_logits: torch.Tensor      # [Bc, Vd] its draft logits


class FusedGraphStep:
    """The fused round for greedy EAGLE requests (see the module docstring). `verifier` is a
    VerifierEngine over a NativeRunner, `drafter` a DrafterEngine over an EagleProposer."""

    def __init__(self, verifier, drafter, graph: bool = True):
        from verifier.runner import NativeRunner

        runner, proposer = verifier.runner, drafter.proposer
        if not isinstance(runner, NativeRunner) or proposer.head is None:   # an EAGLE head
            raise ValueError("the fused graph needs the native target runner and an EAGLE head")
        if drafter.cfg.num_draft_tokens != 2 or drafter.cfg.topk != 1:
            raise ValueError("the fused graph drafts one token per round (num_draft_tokens 2, topk 1)")
        if runner.batch_invariant:
            raise ValueError("the fused graph does not run the batch-invariant kernels")
        self.verifier, self.drafter, self.runner, self.proposer = verifier, drafter, runner, proposer
        self.graph = graph
        self.device = runner.cache.k[0].device
        if graph and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, the cache is on {self.device}")
        self.pool = None
        self._captured: dict[tuple, tuple[_Inputs, object, _Outputs]] = {}

    def supports(self, tree: DraftTree) -> bool:
        from verifier.graphs import batch_bucket

        if tree.num_nodes != 2 or tree.draft_probs is not None or not bool(tree.node_valid.all()):
            return False
        if batch_bucket(len(tree.request_ids)) is None:
            return False
        return all(self.verifier.requests[r].params.greedy for r in tree.request_ids)

    # ------------------------------------------------------------------ the static computation

    def _inputs(self, tree: DraftTree, rows: int) -> tuple[_Inputs, tuple]:
        from verifier.graphs import span_bucket, verify_inputs
        from verifier.tree_inputs import tree_verify_inputs

        b = len(tree.request_ids)
        vreqs = [self.verifier.requests[r] for r in tree.request_ids]
        slots = [r.slot for r in vreqs]
        cache_lens = [r.committed_len - 1 for r in vreqs]
        for slot, c in zip(slots, cache_lens):
            self.runner.cache.reserve(slot, c + 2)
        if self.runner.triton_attention:
            v_span = None
            vin = tree_verify_inputs(self.runner.cache, slots, cache_lens, tree.token_ids, tree.parents,
                                     tree.node_valid, rows)
        else:
            v_span = span_bucket(max(cache_lens) + 2, self.runner.cache.max_len)
            vin = verify_inputs(self.runner.cache, slots, cache_lens, tree.token_ids, tree.parents, tree.node_valid,
                                rows, v_span)
        p, cache = self.proposer, self.proposer.cache
        hslots = [p.slots.of[r] for r in tree.request_ids]
        hbase = [p.cache_len[r] for r in tree.request_ids]
        for slot, c in zip(hslots, hbase):
            cache.reserve(slot, c + 2)
        h_span = span_bucket(max(hbase) + 2, cache.max_len)
        dev = self.device
        real = torch.arange(rows, device=dev) < b
        base = torch.tensor(hbase + [0] * (rows - b), device=dev)
        pair = torch.arange(2, device=dev)
        cols = torch.arange(h_span, device=dev)
        slot_t = torch.tensor(hslots + [hslots[0]] * (rows - b), device=dev)
        write = torch.where(real[:, None], base[:, None] + pair, cache.trash_index)
        read = torch.where(real[:, None], cols, cache.trash_index)
        mask = cols[None, None, :] <= (base[:, None] + pair)[:, :, None]                  # [Bc, 2, S]
        mask &= real[:, None, None]
        mask[:, :, 0] |= ~real[:, None]             # padding rows attend somewhere; never read
        inp = _Inputs(vin, cache.rows(slot_t, write), cache.rows(slot_t, read), mask,
                      torch.where(real[:, None], base[:, None] + pair, 0))
        return inp, (rows, v_span, h_span, self.runner.feature_layers)

    def _forward(self, inp: _Inputs, out: _Outputs) -> None:
        from spectandem.kv_cache import PagedCacheBatch
        from verifier.graphs import verify_forward

        head = self.proposer.head
        logits, feats = verify_forward(self.runner.model, self.runner.cache, self.runner.feature_layers, inp.verify)
        am = logits.argmax(-1)                                                        # [Bc, 2]
        accepted = am[:, 0] == inp.verify.token_ids[:, 1]
        rows = torch.arange(2, device=self.device).expand(am.shape[0], 2)
        hidden = head.run(am, head.project(feats.to(next(head.parameters()).dtype)), inp.head_positions,
                          PagedCacheBatch(self.proposer.cache, inp.head_write, inp.head_read), inp.head_mask, rows)
        hlogits = head.logits(hidden)                                                 # [Bc, 2, Vd]
        last = accepted.long()[:, None, None]
        out.argmax.copy_(am)
        out.accepted.copy_(accepted)
        out.last_hidden.copy_(hidden.gather(1, last.expand(-1, 1, hidden.shape[-1]))[:, 0])
        lg = hlogits.gather(1, last.expand(-1, 1, hlogits.shape[-1]))[:, 0]
        out.last_logits.copy_(lg)
        out.next_draft.copy_(head.draft_to_target(lg.argmax(-1)))

    def _new_outputs(self, rows: int) -> _Outputs:
        s = self.proposer.head.spec
        dev, dtype = self.device, self.proposer.dtype
        return _Outputs(torch.empty(rows, 2, dtype=torch.long, device=dev), torch.empty(rows, dtype=torch.bool, device=dev),
                        torch.empty(rows, dtype=torch.long, device=dev), torch.empty(rows, s.hidden_size, dtype=dtype, device=dev),
                        torch.empty(rows, s.draft_vocab_size, dtype=torch.float32, device=dev))

    @torch.no_grad()
    def _run(self, tree: DraftTree) -> _Outputs:
        from verifier.graphs import batch_bucket

        rows = batch_bucket(len(tree.request_ids))
        inp, key = self._inputs(tree, rows)
        if not self.graph:
            out = self._new_outputs(rows)
            self._forward(inp, out)
            return out
        if key not in self._captured:
            self._captured[key] = self._capture(rows, key[1], inp)
        static, graph, out = self._captured[key]
        static.copy_(inp)
        graph.replay()
        return out

    def _capture(self, rows: int, v_span, like: _Inputs) -> tuple[_Inputs, object, _Outputs]:
        """(static inputs, graph, outputs) for one shape. Warm-up and capture run on padding
        only: every row reads and writes the trash rows of both caches."""
        from verifier.graphs import capture_graph

        cache = self.proposer.cache
        trash = cache.rows(torch.zeros(rows, dtype=torch.long, device=self.device),
                           torch.full_like(like.head_read, cache.trash_index))
        mask = torch.zeros_like(like.head_mask)
        mask[:, :, 0] = True
        static = _Inputs(_padding_verify(self.runner.cache, rows, v_span), trash[:, :1].expand(-1, 2).clone(), trash,
                         mask, torch.zeros_like(like.head_positions))
        out = self._new_outputs(rows)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        return static, capture_graph(lambda: self._forward(static, out), self.pool, self.device), out

    # ------------------------------------------------------------------ bookkeeping

    def __call__(self, tree: DraftTree) -> tuple[list[Verdict], DraftTree]:
        from spectandem.messages import StaleMessage

        ids = tree.request_ids
        for rid, tag in zip(ids, tree.committed_lens):
            if self.verifier.committed_len(rid) != tag:
                raise StaleMessage(f"draft for {rid!r} was made at committed length {tag}")
        self.drafter.flush_deferred(ids)   # a deferred catch-up (draft ahead) must land before the head reads its cache
        b = len(ids)
        out = self._run(tree)
        argmax, accepted, next_draft = to_host(out.argmax[:b], out.accepted[:b], out.next_draft[:b])
        tokens = [argmax[i].tolist() if bool(accepted[i]) else [int(argmax[i, 0])] for i in range(b)]
        self.verifier.commit(ids, torch.tensor([[0, 1] if bool(a) else [0, -1] for a in accepted]), tokens)
        held = self.verifier.requests
        outs = [Verdict(Tag(rid, held[rid].epoch, held[rid].committed_len), token_ids=toks,
                        num_accepted=len(toks) - 1, num_draft_tokens=1, features=None)
                for rid, toks in zip(ids, tokens)]
        self.drafter.extend_caught_up(outs)
        for i, (rid, toks) in enumerate(zip(ids, tokens)):
            # Copies: with a graph, the outputs are static buffers the next replay overwrites.
            self.proposer.record_catch_up(rid, len(toks), out.last_hidden[i].clone(), out.last_logits[i].clone())
        next_tree = DraftTree(
            request_ids=list(ids), committed_lens=[o.committed_len for o in outs],
            token_ids=torch.stack([torch.tensor([toks[-1] for toks in tokens]), next_draft], 1),
            parents=torch.tensor([[-1, 0]] * b), node_valid=torch.ones(b, 2, dtype=torch.bool),
            scores=torch.zeros(b, 2), draft_probs=None, sampled=[False] * b)
        return outs, next_tree


def _padding_verify(cache, rows: int, span):
    from verifier.graphs import padding_inputs
    from verifier.tree_inputs import padding_tree_inputs

    return padding_tree_inputs(cache, rows, 2) if span is None else padding_inputs(cache, rows, 2, span)
