"""The drafter engine: request bookkeeping around a proposer, and the one registry of methods.

Per request it keeps one `HeldRequest`: the committed tokens and what the engine knows of the
request's drafts (the tree being verified, the outcome cache, the next tree, a catch-up not run
yet). The draft probabilities of the round in flight are kept apart, tagged with the committed
length they were drafted at (`DraftProbStore`).

Draft ahead (the outcome cache filled while the verifier verifies): drafter/ahead.py.

Preemption: `remove(..., keep_draft=True)` keeps a request's next tree (and its q) tagged with
its committed length; a re-prefill at the same committed length makes it the next draft again.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from drafter import ahead
from drafter.lm_proposers import DraftModelProposer, NgramProposer
from drafter.proposers import DraftRequest, EagleProposer, Proposer
from drafter.tree import DraftNodes
from spectandem.config import SamplingParams, SpecConfig
from spectandem.devices import to_host
from spectandem.messages import DraftTree, ReadyTree, StaleMessage
from spectandem.protocol import Verdict


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


@dataclass(eq=False)
class HeldRequest(DraftRequest):
    """A request the engine holds: the proposer's view of it (DraftRequest) and the engine's own
    state of its drafts."""

    epoch: int = 0
    # The tree being verified, what draft ahead forks from (`in_flight`): set by `draft` where the
    # engine drafts ahead, as a DraftedRow read out once draft ahead asks; on an outcome cache
    # hit, as the lists themselves.
    flight: DraftedRow | tuple[int, list[int], list[int], list[bool]] | None = None
    # The outcome cache draft ahead filled for that tree: (committed_len, {outcome: (DraftNodes,
    # row)}), an outcome being the round's committed tokens.
    outcomes: tuple[int, dict[tuple[int, ...], tuple[DraftNodes, int]]] | None = None
    # Its deterministic trees as the verifier's rows (outcome -> ReadyTree): what draft_ahead
    # returns to the router, which verifies a hit's tree without a draft call.
    outcome_rows: dict[tuple[int, ...], ReadyTree] | None = None
    # The next tree (committed_len, DraftNodes, row): a hit of the outcome cache, or the draft
    # kept through preemption.
    ready: tuple[int, DraftNodes, int] | None = None
    # A catch-up not run yet (its new pairs, their target features), run by the next call that
    # reads the proposer's state.
    deferred: tuple[int, torch.Tensor | None] | None = None
    # Whether the last verdict hit the outcome cache (None: there was none); draft_ahead's answer.
    last_hit: bool | None = None

    @property
    def in_flight(self) -> tuple[int, list[int], list[int], list[bool]] | None:
        """The tree being verified: (committed_len, token ids, parents, valid), root first."""
        if isinstance(self.flight, DraftedRow):
            self.flight = self.flight.lists()
        return self.flight


@dataclass(frozen=True)
class DraftedRow:
    """One request's row of a round's drafted nodes on the host, under its root, as `draft` left
    it: read out as lists (`lists`) only where draft ahead asks."""

    committed_len: int
    root: int
    token_ids: np.ndarray   # [B, M] the drafted nodes of every request drafted with it
    parents: np.ndarray     # [B, M]
    row: int

    def lists(self) -> tuple[int, list[int], list[int], list[bool]]:
        toks = [self.root, *self.token_ids[self.row].tolist()]
        return self.committed_len, toks, [-1, *self.parents[self.row].tolist()], [t >= 0 for t in toks]


class DrafterEngine:

    def __init__(self, proposer: Proposer, cfg: SpecConfig):
        self.proposer, self.cfg = proposer, cfg
        self.requests: dict[str, HeldRequest] = {}
        self.store = DraftProbStore()
        # Next trees of removed requests, kept through preemption: (committed_len, tree, row).
        self.kept: dict[str, tuple[int, DraftNodes, int]] = {}
        self.ahead_hits = self.ahead_misses = 0
        self._drafts_ahead = bool(cfg.ahead_width and proposer.supports_ahead)

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
                self.remove(request_id, keep_draft=True)  # a re-prefill (resync after a restart or preemption)
            sample = params.drafts_sampled(self.cfg.draft_sampling_min_temperature)
            req = HeldRequest(request_id, list(prompt_ids) + [first_token_id], params, seed, sample, epoch=epoch)
            self.requests[request_id] = req
            kept = self.kept.pop(request_id, None)
            if kept is not None and kept[0] == req.committed_len:
                req.ready = kept   # the draft pending at preemption, still current
            reqs.append(req)
        # A prompt's catch-up waits for the request's first draft where that draft runs it in
        # the same graph (as a miss's does: `_drafts_caught_up`; the proposer's `fuses_catch_up`):
        # the prefill returns at once, and the first tree costs one graph on the GPU.
        now = []
        for req, it in zip(reqs, items):
            if (it[5] is not None and req.ready is None
                    and self._drafts_caught_up(req) and self.proposer.fuses_catch_up(req.committed_len - 1)):
                req.deferred = (req.committed_len - 1, self._stage(it[5]))
            else:
                now.append((req, it[5]))
        if now:
            self.proposer.catch_up([r for r, _ in now], [r.committed_len - 1 for r, _ in now], [f for _, f in now])

    def draft_ahead(self, request_ids: list[str]) -> list[bool | None]:
        """Fills the outcome cache for the trees of these requests now being verified (drafter/
        ahead.py). Returns, per request, whether its tree being verified came from the cache
        (None: no cache then)."""
        return ahead.draft_ahead(self, request_ids)

    def outcome_trees(self, request_ids: list[str]) -> list[dict[tuple[int, ...], ReadyTree] | None]:
        """Per request, its outcome cache's trees as the verifier's rows (outcome: the round's
        committed tokens -> the next tree), for the router to verify a hit's tree without a
        draft call; None where there is no cache or its drafts are sampled (their q stays here)."""
        return [self.requests[i].outcome_rows for i in request_ids]

    def check_tag(self, request_id: str, epoch: int, committed_len: int) -> None:
        """Raises StaleMessage unless the request is at this epoch and committed length."""
        req = self.requests.get(request_id)
        if req is None:
            raise StaleMessage(f"request {request_id!r} is not active on the drafter")
        if (req.epoch, req.committed_len) != (epoch, committed_len):
            raise StaleMessage(f"request {request_id!r} is at epoch {req.epoch}, committed "
                               f"length {req.committed_len}; the message is for {epoch}, {committed_len}")

    def extend(self, outputs: list[Verdict]) -> None:
        """Catch-up after verification: absorb each request's accepted tokens and bonus token. A
        request may appear several times (rounds it was decoded plainly, in order): its rounds are
        absorbed in one catch-up."""
        outputs = _merge_rounds(outputs)
        reqs = [self.requests[out.request_id] for out in outputs]
        # Check every verdict before changing anything: a stale one leaves the whole batch as it was.
        for out, req in zip(outputs, reqs):
            if req.committed_len + len(out.token_ids) != out.committed_len:
                raise StaleMessage(f"{out.request_id!r}: verdict for committed length {out.committed_len} "
                                   f"does not follow the drafter's {req.committed_len}")
        # A catch-up still deferred (a prompt's, waiting for the request's first draft) and this
        # verdict's, where both can wait for the next draft: one catch-up of both inside it,
        # rather than the first one apart now.
        merged = {out.request_id for out, req in zip(outputs, reqs) if self._merges(req, out)}
        self.flush_deferred([out.request_id for out in outputs if out.request_id not in merged])
        now = []
        for out, req in zip(outputs, reqs):
            self.store.drop(out.request_id)  # the round's verdict is in: its q rows are spent
            cache, rows = req.outcomes, req.outcome_rows or {}
            req.flight = req.ready = req.outcomes = req.outcome_rows = None
            if cache is not None and cache[0] == req.committed_len:
                hit = cache[1].get(tuple(out.token_ids))
                req.last_hit = hit is not None
                self.ahead_hits += hit is not None
                self.ahead_misses += hit is None
                if hit is not None:
                    req.ready = (out.committed_len, *hit)
                    # The router may verify this tree without a draft call (it holds the
                    # outcome's rows: `outcome_trees`); draft ahead then forks from it.
                    hit_rows = rows.get(tuple(out.token_ids))
                    if hit_rows is not None:
                        req.flight = _in_flight(out.committed_len, hit_rows)
            req.token_ids.extend(out.token_ids)
            if out.request_id in merged:
                n, feats = req.deferred
                req.deferred = (n + len(out.token_ids), torch.cat([feats, self._stage(out.features)]))
            elif req.ready is not None or (out.features is not None and self._drafts_caught_up(req)):
                req.deferred = (len(out.token_ids), self._stage(out.features))
            else:
                now.append((req, len(out.token_ids), out.features))
        if now:
            self.proposer.catch_up([r for r, _, _ in now], [n for _, n, _ in now], [f for _, _, f in now])

    def _merges(self, req: HeldRequest, out: Verdict) -> bool:
        """Whether the request's deferred catch-up and this verdict's run as one inside its next
        draft: both have their features, no draft ahead is involved, and the one pass takes the
        pairs of both."""
        d = req.deferred
        return (d is not None and d[1] is not None and out.features is not None and req.ready is None
                and req.outcomes is None and self._drafts_caught_up(req)
                and self.proposer.fuses_catch_up(d[0] + len(out.token_ids)))

    def _drafts_caught_up(self, req: DraftRequest) -> bool:
        """Whether a verdict without a ready tree (a miss, or no draft ahead) defers its catch-up
        to the request's next draft, which then runs both in one pass (`catch_up_propose`: an
        argmax chain's catch-up and drafting in one graph on the GPU)."""
        return self.cfg.topk == 1 and not req.sample_drafts and self.proposer.has_catch_up_propose

    def _stage(self, features: torch.Tensor | None) -> torch.Tensor | None:
        """A deferred catch-up's features, moved to the proposer's device now. From another GPU
        the copy runs on that GPU's stream: at the deferred catch-up, the next round's verify is
        queued there and the copy (with all of draft ahead behind it) would wait for it."""
        return None if features is None else self.proposer.stage_features(features)

    def extend_caught_up(self, outputs: list[Verdict]) -> None:
        """`extend` for verdicts whose catch-up already ran on the proposer's state: the fused graph
        round (verifier/fused.py) absorbs the round's pairs on the device and records them with
        `EagleProposer.record_catch_up`. Appends each request's committed tokens and spends its q
        rows; no catch-up runs here."""
        for out in outputs:
            self.requests[out.request_id].token_ids.extend(out.token_ids)
            self.store.drop(out.request_id)

    def _all_deferred(self, request_ids: list[str]) -> bool:
        """Whether every one of these requests has a deferred catch-up with its features (what a
        one-pass catch-up inside a draft or a draft ahead runs)."""
        return all((d := self.requests[i].deferred) is not None and d[1] is not None for i in request_ids)

    def flush_deferred(self, request_ids: list[str]) -> None:
        """Runs the deferred catch-ups of these requests (draft ahead: a hit's catch-up waits
        for the next call that reads the proposer's state)."""
        todo = [(r, *self._take_deferred(r)) for r in (self.requests[i] for i in request_ids) if r.deferred is not None]
        if todo:
            self.proposer.catch_up([r for r, _, _ in todo], [n for _, n, _ in todo], [f for _, _, f in todo])

    @staticmethod
    def _take_deferred(req: HeldRequest) -> tuple[int, torch.Tensor | None]:
        deferred, req.deferred = req.deferred, None
        return deferred

    def draft(self, request_ids: list[str], num_steps: list[int | None] | None = None) -> DraftTree:
        """One round's trees for these requests (sampled and deterministic drafted separately):
        a request's ready tree (outcome cache, or kept through preemption) if it has one at its
        committed length, else a new one of depth at most `num_steps[i]` (None: configured)."""
        steps = list(num_steps) if num_steps is not None else [None] * len(request_ids)
        reqs = [self.requests[i] for i in request_ids]
        drafts: dict[int, tuple[DraftNodes, int]] = {}
        for i, r in enumerate(reqs):
            ready, r.ready = r.ready, None
            if ready is not None and ready[0] == r.committed_len:
                drafts[i] = ready[1:]
        # Groups of one kind of draft (sampled or not, depth); deterministic drafts whose requests
        # have a deferred catch-up with its features form groups of their own, by the kind of pass
        # their catch-ups take (`Proposer.catch_up_group`: a round's pairs, a prompt's), which run
        # it in the same pass (`catch_up_propose`). Every other deferred catch-up runs first. (A
        # request without one, or with a prompt's, thus never makes the batch catch up apart.)
        fuses = self.proposer.has_catch_up_propose
        parts: dict[tuple, list[int]] = {}
        for i, r in enumerate(reqs):
            if i not in drafts:
                d = r.deferred
                inside = (self.proposer.catch_up_group(d[0])
                          if fuses and not r.sample_drafts and d is not None and d[1] is not None else None)
                parts.setdefault((r.sample_drafts, steps[i] or self.cfg.num_steps, inside), []).append(i)
        self.flush_deferred([reqs[i].request_id for key, idx in parts.items() if key[2] is None for i in idx])
        for key, idx in parts.items():
            group = [reqs[i] for i in idx]
            if key[2] is not None:
                pending = [self._take_deferred(r) for r in group]
                tree = self.proposer.catch_up_propose(group, [n for n, _ in pending], [f for _, f in pending], key[1])
            else:
                tree = self.proposer.propose(group, key[1])
            for row, i in enumerate(idx):
                drafts[i] = (tree, row)
        # Each tree's tensors copied to the host once (one wait per tree), as numpy arrays.
        host: dict[int, tuple] = {}
        for d, _ in drafts.values():
            if id(d) not in host:
                t, par, sc, q = to_host(d.token_ids, d.parents, d.scores, d.node_probs)
                host[id(d)] = (t.numpy(), par.numpy(), sc.float().numpy(), q)
        roots = [r.token_ids[-1] for r in reqs]
        tree = _tree_of(list(request_ids), [r.committed_len for r in reqs], roots, drafts, host)
        probs_rows = [None] * len(reqs)
        for i, r in enumerate(reqs):
            if r.sample_drafts:
                d, row = drafts[i]
                q = host[id(d)][3][row]                                          # [mi + 1, V]
                self.store.put(r.request_id, r.committed_len, q)
                probs_rows[i] = q
        if self._drafts_ahead:   # what draft_ahead forks from, read out when it does
            for i, r in enumerate(reqs):
                d, row = drafts[i]
                r.flight = DraftedRow(r.committed_len, roots[i], host[id(d)][0], host[id(d)][1], row)
        if any(q is not None for q in probs_rows):
            b, n = tree.token_ids.shape
            vocab = next(q.shape[-1] for q in probs_rows if q is not None)
            tree.draft_probs = torch.zeros(b, n, vocab, dtype=torch.float64)
            for i, q in enumerate(probs_rows):
                if q is not None:
                    tree.draft_probs[i, : q.shape[0]] = q
        tree.sampled = [r.sample_drafts for r in reqs]
        return tree

    def remove(self, request_id: str, keep_draft: bool = False) -> None:
        """Forgets a request; with keep_draft, its ready next tree stays for a re-prefill at the
        same committed length (preemption)."""
        req = self.requests.pop(request_id, None)
        if keep_draft and req is not None and req.ready is not None:
            self.kept[request_id] = req.ready
        elif not keep_draft:
            self.kept.pop(request_id, None)
        self.store.drop(request_id)
        if req is not None:
            self.proposer.request_ended(req)
        self.proposer.remove(request_id)


def build_proposer(cfg: SpecConfig, target, draft_dir: str | Path | None, max_slots: int, max_len: int,
                   dtype: torch.dtype = torch.float32, device: str = "cpu", kv_blocks: int | None = None,
                   block_size: int = 16, cuda_graphs: bool = False) -> Proposer | None:
    """The one place a method name becomes a proposer. `target` is the target model, native or
    transformers, or what the drafter reads of it (drafter/loader.py TargetTensors): EAGLE heads
    take embeddings and lm_head from it, a draft model its vocabulary size. `cuda_graphs`: EAGLE catch-ups
    of up to 16 pairs and argmax chains run as CUDA graphs (drafter/graphs.py); other methods, trees
    and long catch-ups (prefills) run eagerly."""
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
        vocab = (target if isinstance(target, TargetTensors) else TargetTensors.of(target)).vocab_size
        if model.spec.vocab_size != vocab:
            raise ValueError(f"{draft_dir}: draft model vocab_size {model.spec.vocab_size} does not match "
                             f"the target's {vocab}")
        return DraftModelProposer(model, cfg, max_slots, max_len, kv_blocks, block_size)
    from drafter.loader import load_head

    head = load_head(draft_dir, target, kind=cfg.method, dtype=dtype, device=device)
    return EagleProposer(head, cfg, max_slots, max_len, kv_blocks, block_size, cuda_graphs)


def _tree_of(request_ids: list[str], committed_lens: list[int], roots: list[int],
             drafts: dict[int, tuple[DraftNodes, int]], host: dict[int, tuple]) -> DraftTree:
    """The round's DraftTree: request i's row is row drafts[i][1] of the drafted nodes
    drafts[i][0] (on the host in `host`, by id: token ids, parents, scores), under its root
    `roots[i]`, padded to the widest (-1 tokens and parents, -inf scores); what `ready_rows` and
    `trees_from_ready` make of the rows one by one, filled a tree at a time."""
    b = len(request_ids)
    n = 1 + max(host[id(d)][0].shape[1] for d, _ in drafts.values())
    token_ids = np.full((b, n), -1, dtype=np.int64)
    parents = np.full((b, n), -1, dtype=np.int64)
    scores = np.full((b, n), float("-inf"), dtype=np.float32)
    token_ids[:, 0] = roots
    scores[:, 0] = 0.0
    by_tree: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(b):
        d, row = drafts[i]
        at, rows = by_tree.setdefault(id(d), ([], []))
        at.append(i)
        rows.append(row)
    for key, (at, rows) in by_tree.items():
        t, par, sc, _ = host[key]
        m = t.shape[1]
        token_ids[at, 1: m + 1], parents[at, 1: m + 1], scores[at, 1: m + 1] = t[rows], par[rows], sc[rows]
    return DraftTree(request_ids=request_ids, committed_lens=committed_lens, token_ids=torch.from_numpy(token_ids),
                     parents=torch.from_numpy(parents), node_valid=torch.from_numpy(token_ids >= 0),
                     scores=torch.from_numpy(scores))


def _in_flight(committed_len: int, rt: ReadyTree) -> tuple[int, list[int], list[int], list[bool]]:
    """The draft-ahead record of a tree being verified: (committed_len, tokens, parents, valid)."""
    return committed_len, list(rt.token_ids), list(rt.parents), [t >= 0 for t in rt.token_ids]


def _merge_rounds(outputs: list[Verdict]) -> list[Verdict]:
    """One output per request, in order of first appearance: a request's consecutive rounds
    joined (tokens and feature rows concatenated, the last committed length)."""
    merged: dict[str, Verdict] = {}
    for out in outputs:
        prev = merged.get(out.request_id)
        if prev is None:
            merged[out.request_id] = out
            continue
        feats = None if prev.features is None else torch.cat([prev.features, out.features.to(prev.features)])
        merged[out.request_id] = Verdict(out.tag, token_ids=list(prev.token_ids) + list(out.token_ids),
                                         num_accepted=prev.num_accepted + out.num_accepted,
                                         num_draft_tokens=prev.num_draft_tokens + out.num_draft_tokens,
                                         features=feats)
    return list(merged.values())
