"""Chained verifies, VerifierEngine's calls for them (verifier/engine.py holds the state they
read: requests, the runner, `_armed`, `_verdict`, `_launched`, `_prepared`, `_state`).

The router arms a verify (`arm_next`) and, while it runs, the drafter's next tree for each of its
outcomes comes (router/links_local.py). Given the verdict (`take_verdict`) and those trees,
`launch_next` queues the verify of the verdict's next tree at once; its forward runs while the
router takes in the verdict, and the router's verify of that same tree then only waits for it.
The tree is the one the router builds itself (`trees_from_ready` over the same ready trees), so
the tokens are those of the unchained rounds; a verify of any other tree, a decode, or the
release of one of its requests drops it (its KV rows lie past the committed length, where the
next verify writes anyway).

Prepared launches (one request: the latency path). The trees come before the verdict (the
drafter drafts ahead while the target verifies), so `prepare_next`, from the thread that stages
them, packs the next verify's inputs for every outcome then (`NativeRunner.prepare_rows`). At
the verdict the verify itself launches the outcome's row, before its commit where the commit
moves no KV entry (every chain's: `_launch_prepared`), and `launch_next` finds it made: the host
work between a verdict and the next forward is one copy and a graph replay. The request's KV slot
stays reserved for the longest of those verifies through the commit (`commit`'s keep): the rows
they write are the rows packed. A miss's tree, launched once drafted after the verdict, takes the
inputs prepared for an outcome of its shape at its committed length, with its tokens written in
(`_prepared_like`). `_state` (a lock) orders the preparing thread against the engine's own thread wherever
either changes the request's slot; a preparation that comes after the verdict does nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from spectandem.messages import DraftTree, trees_from_ready


@dataclass(frozen=True)
class Prepared:
    """One request's next verify, packed for each outcome before the verdict (`prepare_next`)."""

    request_id: str
    tag: int                        # the committed length of the verify whose outcomes these are
    slot: int                       # the request's KV slot, reserved for `entries` entries
    entries: int                    # the longest outcome's verify reaches this many entries
    outcomes: dict                  # the drafter's trees: committed tokens -> ReadyTree (the object staged)
    rows: dict                      # committed tokens -> row index below
    row_trees: list[DraftTree]      # per row, its one-request tree
    flats: list[torch.Tensor]       # per row, its packed inputs (`NativeRunner.prepare_rows`)

    def row(self, tokens: list[int]) -> int | None:
        """The row of the outcome that commits `tokens`; None where there is none, or where that
        outcome's tree is shorter than its row (padded to a longer outcome's: its own launch)."""
        i = self.rows.get(tuple(tokens))
        if i is None or len(self.outcomes[tuple(tokens)].token_ids) != self.row_trees[i].num_nodes:
            return None
        return i


class ChainedLaunchMixin:
    def arm_next(self, request_ids: list[str], committed_lens: list[int], on_verdict=None) -> None:
        """The next verify, of exactly these tags, chains: its verdict is kept (`take_verdict`).
        Called before that verify. `on_verdict()`, if given, is called from inside that verify
        once its verdict is kept and its work is queued, before it builds its outputs: the
        caller launches the next tree there (`take_verdict`, `launch_next`), as early as the
        host can."""
        # The stream its work is queued on (`round_done` is recorded there at its verdict): taken
        # now, before that verify, as asking for the current stream costs tens of microseconds.
        device = self.runner.device
        stream = torch.cuda.current_stream(device) if torch.device(device).type == "cuda" else None
        self._armed = (tuple(request_ids), tuple(committed_lens), on_verdict, stream)

    def take_verdict(self) -> tuple | None:
        """The armed verify's verdict, for `launch_next` (None: the last verify was not armed)."""
        verdict, self._verdict = self._verdict, None
        return verdict

    def verdict_outputs(self) -> list:
        """From inside an armed verify's `on_verdict`: that verify's outputs (Verdict, as it
        will return them; built once), so that the caller can hand them on before the verify
        returns (router/links_local.py starts the drafter's next call from there)."""
        assert self._verdict_outputs is not None, "only from inside an armed verify's on_verdict"
        return self._verdict_outputs()

    def prepare_next(self, request_ids: list[str], committed_lens: list[int], trees: list[dict | None]) -> bool:
        """From any thread, while the armed verify of these tags runs: packs the inputs of the
        next verify for each outcome with a tree (trees: as `launch_next`'s), for one request.
        -> whether it did (not after the verdict, nor for a batch, nor where the runner's verify
        reads no packed inputs: `packs_tree_inputs`)."""
        if not self.runner.packs_tree_inputs or len(request_ids) != 1 or len(trees) != 1 or not trees[0]:
            return False
        rid, tag, outcomes = request_ids[0], committed_lens[0], trees[0]
        with self._state:
            req = self.requests.get(rid)
            if req is None or req.committed_len != tag:
                return False         # the verdict is in, or the request is gone
            keys = list(outcomes)
            # Outcome o commits len(o) tokens: its verify is at committed length tag + len(o).
            tree = trees_from_ready([rid] * len(keys), [tag + len(k) for k in keys], [outcomes[k] for k in keys])
            lens = [c - 1 for c in tree.committed_lens]
            flats = self.runner.prepare_rows(req.slot, lens, tree.token_ids, tree.parents, tree.node_valid)
            if flats is None:
                return False
            # Each outcome's one-row tree too, so that its launch builds nothing.
            self._prepared = Prepared(rid, tag, req.slot, max(lens) + tree.num_nodes, outcomes,
                                      {k: i for i, k in enumerate(keys)},
                                      [_row(tree, i, rid) for i in range(len(keys))], flats)
        return True

    def _kept_entries(self, request_ids: list[str]) -> list[int] | None:
        """Per request, entries its slot keeps reserved past the commit (a prepared launch's,
        made or to come); None: none."""
        prep = self._prepared or self._early
        if prep is None or prep.request_id not in request_ids:
            return None
        return [prep.entries if rid == prep.request_id else 0 for rid in request_ids]

    def _usable(self, prep: Prepared | None, request_ids: list[str]) -> Prepared | None:
        """`prep` where it can serve a verify of these requests: it is for exactly this one
        request, which is still here in the slot the preparation reserved; else None."""
        if prep is None or list(request_ids) != [prep.request_id]:
            return None
        req = self.requests.get(prep.request_id)
        return prep if req is not None and req.slot == prep.slot else None

    def _launch_prepared(self, tree: DraftTree, reqs: list, tokens: list[list[int]],
                         accepted_nodes: torch.Tensor) -> bool:
        """From an armed verify, at its verdict and before its commit: where the verdict's next
        verify was prepared (`prepare_next`) and the commit moves no KV entry (the accepted path
        lies where it was written: every chain's), that verify is launched now; the commit then
        keeps its entries and `launch_next` finds it made. -> whether it launched."""
        with self._state:
            prep = self._usable(self._prepared, tree.request_ids)
            if prep is None or reqs[0].committed_len != prep.tag:
                return False
            toks = tokens[0]
            i = prep.row(toks)
            if i is None:
                return False
            path = accepted_nodes.numpy()[0, : len(toks)]
            if (path != np.arange(len(toks))).any():   # the commit moves entries: the launch must follow it
                return False
            row = prep.row_trees[i]
            self._prepared, self._early = None, prep
            try:
                logits, feats = self.runner.verify([prep.slot], [row.committed_lens[0] - 1], row.token_ids,
                                                   row.parents, row.node_valid, flat=prep.flats[i])
            except (ValueError, KeyError):   # no room: the verdict's own launch will say so
                return False
            self._launched = (row, logits, feats, True)
        self.launched_prepared += 1
        return True

    def _take_prepared(self, request_ids: list[str], trees: list[dict | None],
                       tokens: list[list[int]]) -> tuple[DraftTree, torch.Tensor] | None:
        """The verdict's prepared launch -> (its one-request tree, its packed inputs), or None."""
        prep, self._prepared = self._usable(self._prepared, request_ids), None
        if prep is None or trees[0] is not prep.outcomes:
            return None
        i = prep.row(tokens[0])
        if i is None or prep.row_trees[i].committed_lens[0] != self.requests[prep.request_id].committed_len:
            return None
        return prep.row_trees[i], prep.flats[i]

    def launch_next(self, verdict: tuple | None, trees: list[dict | None]) -> bool:
        """Queues the verify of the verdict's next tree when every request has one -> whether it
        did. trees: per request of the armed verify (in its order), the next tree for each of its
        outcomes (committed tokens -> ReadyTree), or None. The caller has synchronized the last
        verify's work (the launch reuses its buffers)."""
        early, self._early = self._early, None
        if verdict is None:
            return False
        if early is not None:   # launched at the verdict (`_launch_prepared`): from these very trees?
            return (self._launched is not None and len(trees) == 1 and trees[0] is early.outcomes
                    and self._launched[0].request_ids == verdict[0])
        request_ids, committed_lens, tokens = verdict
        if len(trees) != len(request_ids) or any(rid not in self.requests for rid in request_ids):
            return False
        if [self.requests[rid].committed_len for rid in request_ids] != committed_lens:
            return False      # the requests moved on (not by the router's rounds: never in serving)
        ready = [None if t is None else t.get(tuple(toks)) for t, toks in zip(trees, tokens)]
        if any(r is None for r in ready):
            return False
        prepared = self._take_prepared(request_ids, trees, tokens)
        if prepared is not None:
            self.launched_prepared += 1
            return self.launch(prepared[0], chained=True, flat=prepared[1])
        return self.launch(trees_from_ready(request_ids, committed_lens, ready), chained=True)

    def launch(self, tree: DraftTree, chained: bool = False, flat: torch.Tensor | None = None,
               device_tokens: tuple | None = None) -> bool:
        """Queues the forward of `tree` now; the verify of that very tree that follows takes it
        (the others drop it) -> whether it did. The caller has synchronized the last verify's
        work (the launch reuses its buffers). `chained`: launch_next's (counted in `chained`;
        others in `launched_early`). `flat`: its inputs, prepared (`prepare_next`).
        `device_tokens`: (token ids [B, N - 1] on a device, a CUDA event after them or None), a
        miss's tree whose drafting is still running on the drafter's GPU: the forward reads its
        drafts there, the tree's own token ids past its roots are unknown (-1); it waits for
        `confirm_launch` with the tree the host gets."""
        self._unconfirmed = None
        like = flat is None and not chained
        if like:
            flat = self._prepared_like(tree)
        if device_tokens is not None and not self.runner.takes_device_tokens:
            return False
        try:
            reqs, logits, feats = self._launch(tree, flat, device_tokens)
        except (ValueError, KeyError):   # stale, gone, or no room: the router's own verify will say so
            return False
        if device_tokens is None:
            self._launched = (tree, logits, feats, chained)
        else:
            self._launched, self._unconfirmed = None, (tree, logits, feats)
        self.launched_like_prepared += like and flat is not None
        return True

    def confirm_launch(self, tree: DraftTree) -> bool:
        """The tree a launch from device tokens (`launch`) verifies, now on the host: that launch
        becomes the one the router's verify of this tree takes -> whether there was one for this
        tree (the same tags, roots and shape)."""
        pending, self._unconfirmed = self._unconfirmed, None
        if pending is None:
            return False
        early = pending[0]
        if not (early.request_ids == tree.request_ids and early.committed_lens == tree.committed_lens
                and early.token_ids.shape == tree.token_ids.shape and torch.equal(early.parents, tree.parents)
                and torch.equal(early.node_valid, tree.node_valid)
                and torch.equal(early.token_ids[:, 0], tree.token_ids[:, 0])):
            return False
        self._launched = (tree, pending[1], pending[2], False)
        self.launched_from_device += 1
        return True

    def _prepared_like(self, tree: DraftTree) -> torch.Tensor | None:
        """A miss's tree (launched after its verdict: router/links_local.py `_launch_missed`) ->
        the packed inputs prepared for an outcome of its request with the same shape at the same
        committed length (a chain whose bonus token the drafter guessed wrong), its token ids
        written in; None where there is none. Every other field depends only on the slot, the
        committed length and the shape; the preparation reserved those entries and the commit
        kept them (`_kept_entries`). The preparation is spent."""
        with self._state:
            prep = self._usable(self._prepared, tree.request_ids)
            if prep is None:
                return None
            for row, flat in zip(prep.row_trees, prep.flats):
                if (row.committed_lens == tree.committed_lens and row.token_ids.shape == tree.token_ids.shape
                        and torch.equal(row.parents, tree.parents) and torch.equal(row.node_valid, tree.node_valid)):
                    self._prepared = None
                    n = tree.token_ids.shape[1]
                    flat[: 8 * n].view(torch.int64).copy_(tree.token_ids[0].clamp(min=0))   # host_tree_inputs' tokens
                    return flat
        return None


def _row(tree: DraftTree, i: int, request_id: str) -> DraftTree:
    """Row i of a prepared batch of one request's candidate trees, as its own one-row tree."""
    return DraftTree(request_ids=[request_id], committed_lens=[tree.committed_lens[i]],
                     token_ids=tree.token_ids[i: i + 1], parents=tree.parents[i: i + 1],
                     node_valid=tree.node_valid[i: i + 1], scores=tree.scores[i: i + 1])


def same_tree(a: DraftTree, b: DraftTree) -> bool:
    return (a.request_ids == b.request_ids and a.committed_lens == b.committed_lens
            and a.token_ids.shape == b.token_ids.shape and torch.equal(a.token_ids, b.token_ids)
            and torch.equal(a.parents, b.parents) and torch.equal(a.node_valid, b.node_valid)
            and b.draft_probs is None and not any(b.sampled))
