"""Draft ahead, the drafter engine's stage that runs while the verifier verifies.

Draft ahead (SSD's outcome cache): while the verifier checks a
round's tree, `draft_ahead` prepares the next tree for the round's likeliest outcomes. An
outcome is what the round commits: the accepted path plus the bonus token. The drafter forks the
request's state once per tree node and absorbs that node's path with its own predicted features.
This gives the draft distribution after every node. Outcomes (node u, bonus b), with b not a
child of u, are scored by log q(path to u) + log q_u(b), and the `ahead_width` best get a tree
each. When the verdict arrives (`extend`), a hit makes the cached tree the request's next draft.
The catch-up with the real target features is then deferred to the next call that needs the
state: it runs while the verifier is busy with that tree (for a chain, inside the one-pass draft
ahead). A miss drafts on demand; for an argmax chain its catch-up waits for that draft and runs
in the same pass (drafter/engine.py), otherwise at once. Any tree is valid for verification, so hits never change greedy output; sampled trees
carry the q they were drawn from. Chains with deterministic drafts take a one-pass path when the
proposer offers it (`ahead_chains`, drafter/ahead_chains.py): the same outcomes and trees from
one forced chain and one batched chain per outcome, with no forks.
"""

from __future__ import annotations

import logging

from drafter.proposers import DraftRequest
from drafter.tree import host_lists, ready_rows
from spectandem.block_manager import KVCacheFull
from spectandem.devices import to_host
from spectandem.messages import ReadyTree

log = logging.getLogger("spectandem.drafter")
AHEAD_SEP = "\x1f"   # a draft-ahead fork's id: "<request id>\x1fahead<node>", its outcomes "...-<bonus>"


def ahead_owner(request_id: str) -> str:
    """The request a draft-ahead fork was forked from; a request's own id for a request."""
    return request_id.split(AHEAD_SEP, 1)[0]


class DraftAheadMixin:
    """DrafterEngine's draft-ahead calls (drafter/engine.py holds the state they read: requests,
    in_flight, outcomes, proposer, cfg)."""

    def draft_ahead(self, request_ids: list[str]) -> list[bool | None]:
        """Fills the outcome cache for the trees of these requests now being verified. Returns,
        per request, whether its tree being verified came from the cache (None: no cache then)."""
        flags = [self.last_hit.pop(i, None) for i in request_ids]
        if not self._drafts_ahead:
            return flags
        todo = [i for i in request_ids if self.in_flight.get(i, (-1,))[0] == self.requests[i].committed_len]
        chains = self._chains(todo)
        # A chain group whose every request has a deferred catch-up (a hit's) runs it inside the
        # chain pass (one graph: drafter/ahead_chains.py); every other deferred catch-up runs first.
        inside = {m for m, ids in chains.items() if self.proposer.has_catch_up_ahead_chains and self._all_deferred(ids)}
        self.flush_deferred([i for i in request_ids if not any(i in chains[m] for m in inside)])
        forks: list[str] = []
        try:
            for m, ids in chains.items():   # chains in one pass per length (drafter/ahead_chains.py)
                reqs, ahead = [self.requests[i] for i in ids], [self.in_flight[i][1][1: m + 1] for i in ids]
                if m in inside:
                    pending = [self.deferred.pop(i) for i in ids]
                    trees = self.proposer.catch_up_ahead_chains(reqs, [n for n, _ in pending], [f for _, f in pending],
                                                                ahead, self.cfg.ahead_width)
                else:
                    trees = self.proposer.ahead_chains(reqs, ahead, self.cfg.ahead_width)
                for rid, cache in zip(ids, trees):
                    self.outcomes[rid] = (self.requests[rid].committed_len, cache)
            done = {i for ids in chains.values() for i in ids}
            self._fill_outcomes([i for i in todo if i not in done], forks)
        except KVCacheFull as exc:   # no room for forks now: this round's verdicts draft on demand
            log.info("draft ahead skipped: %s", exc)
            self.flush_deferred(request_ids)   # the groups not reached yet
            for i in todo:
                self.outcomes.pop(i, None)
        finally:
            for f in reversed(forks):   # borrowers before lenders
                self.proposer.remove(f)
        self._outcome_rows(todo)
        return flags

    def outcome_trees(self, request_ids: list[str]) -> list[dict[tuple[int, ...], ReadyTree] | None]:
        """Per request, its outcome cache's trees as the verifier's rows (outcome: the round's
        committed tokens -> the next tree), for the router to verify a hit's tree without a
        draft call; None where there is no cache or its drafts are sampled (their q stays here)."""
        return [self.outcome_rows.get(i) for i in request_ids]

    def _outcome_rows(self, request_ids: list[str]) -> None:
        """Fills `outcome_rows` from the outcome cache of these requests (deterministic drafts
        only), each distinct tree copied to the host once."""
        host: dict[int, list] = {}
        for rid in request_ids:
            self.outcome_rows.pop(rid, None)
            req, cache = self.requests[rid], self.outcomes.get(rid)
            if req.sample_drafts or cache is None or cache[0] != req.committed_len:
                continue
            rows = {}
            for key, (tree, row) in cache[1].items():
                if id(tree) not in host:
                    host[id(tree)] = host_lists(*to_host(tree.token_ids, tree.parents, tree.scores))
                rows[key] = ready_rows(key[-1], host[id(tree)], row)
            self.outcome_rows[rid] = rows

    def _chains(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The requests whose tree being verified is a chain with deterministic drafts, by chain
        length, when the proposer drafts ahead for chains in one pass."""
        out: dict[int, list[str]] = {}
        for rid in request_ids:
            _, _, parents, valid = self.in_flight[rid]
            m = sum(valid) - 1
            if (not self.requests[rid].sample_drafts and m >= 1 and all(valid[: m + 1])
                    and all(parents[j] == j - 1 for j in range(1, m + 1))):
                out.setdefault(m, []).append(rid)
        return {m: ids for m, ids in out.items() if self.proposer.supports_ahead_chains(len(ids))}

    def _fill_outcomes(self, request_ids: list[str], forks: list[str]) -> None:
        if not request_ids:
            return
        width = self.cfg.ahead_width
        # 1. A fork per tree node that has absorbed the path to it: the draft's q after the node.
        nodes, fork_reqs = [], []
        for rid in request_ids:
            req = self.requests[rid]
            _, toks, parents, valid = self.in_flight[rid]
            paths = {0: []}
            for j in range(1, len(toks)):
                if valid[j]:
                    paths[j] = paths[parents[j]] + [toks[j]]   # a parent always has a lower index
            for j, path in paths.items():
                fid = f"{rid}{AHEAD_SEP}ahead{j}"
                forks.append(fid)   # before the fork: a fork that fails half-way is still freed
                self.proposer.ahead_fork(rid, fid)
                nodes.append((rid, j, path))
                fork_reqs.append(DraftRequest(fid, req.token_ids + path, req.params, req.seed, req.sample_drafts))
        self.proposer.ahead_absorb(fork_reqs, [len(p) for _, _, p in nodes])
        logq = self.proposer.ahead_logprobs([f.request_id for f in fork_reqs]).float().cpu()
        row = {(rid, j): i for i, (rid, j, _) in enumerate(nodes)}
        # 2. The likeliest outcomes per request.
        chosen = []
        for rid in request_ids:
            _, toks, parents, valid = self.in_flight[rid]
            children: dict[int, set[int]] = {}
            for j in range(1, len(toks)):
                if valid[j]:
                    children.setdefault(parents[j], set()).add(toks[j])
            reach, cands = {}, []
            for (r, j, path) in nodes:
                if r != rid:
                    continue
                reach[j] = 0.0 if j == 0 else reach[parents[j]] + float(logq[row[(rid, parents[j])], toks[j]])
                lp, tok = logq[row[(rid, j)]].topk(min(width + len(children.get(j, ())), logq.shape[-1]))
                for v, b in zip(lp.tolist(), tok.tolist()):
                    if b not in children.get(j, ()) and v > float("-inf"):
                        cands.append((-(reach[j] + v), j, b, path))
            cands.sort(key=lambda c: c[:3])
            chosen += [(rid, j, b, path) for _, j, b, path in cands[:width]]
        # 3. A fork per outcome absorbs its bonus token and drafts the next tree.
        out_reqs = []
        for rid, j, b, path in chosen:
            src = fork_reqs[row[(rid, j)]]
            fid = f"{src.request_id}-{b}"
            forks.append(fid)
            self.proposer.ahead_fork(src.request_id, fid)
            out_reqs.append(DraftRequest(fid, src.token_ids + [b], src.params, src.seed, src.sample_drafts))
        self.proposer.ahead_absorb(out_reqs, [1] * len(out_reqs))
        for rid in request_ids:
            self.outcomes[rid] = (self.requests[rid].committed_len, {})
        parts: dict[bool, list[int]] = {}
        for i, r in enumerate(out_reqs):
            parts.setdefault(r.sample_drafts, []).append(i)
        for idx in parts.values():
            tree = self.proposer.propose([out_reqs[i] for i in idx])
            for k, i in enumerate(idx):
                rid, _, b, path = chosen[i]
                self.outcomes[rid][1][tuple(path) + (b,)] = (tree, k)
