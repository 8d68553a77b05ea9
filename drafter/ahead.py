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

log = logging.getLogger("spectandem.drafter")
AHEAD_SEP = "\x1f"   # a draft-ahead fork's id: "<request id>\x1fahead<node>", its outcomes "...-<bonus>"


def ahead_owner(request_id: str) -> str:
    """The request a draft-ahead fork was forked from; a request's own id for a request."""
    return request_id.split(AHEAD_SEP, 1)[0]


def draft_ahead(engine, request_ids: list[str]) -> list[bool | None]:
    """`DrafterEngine.draft_ahead`: fills the outcome cache for the trees of these requests now
    being verified. Returns, per request, whether its tree being verified came from the cache
    (None: no cache then)."""
    reqs_of = engine.requests
    flags = []
    for i in request_ids:
        flags.append(reqs_of[i].last_hit)
        reqs_of[i].last_hit = None
    if not engine._drafts_ahead:
        return flags
    todo = [i for i in request_ids if (reqs_of[i].in_flight or (-1,))[0] == reqs_of[i].committed_len]
    chains = _chains(engine, todo)
    proposer, width = engine.proposer, engine.cfg.ahead_width
    # A chain group whose every request has a deferred catch-up (a hit's) runs it inside the
    # chain pass (one graph: drafter/ahead_chains.py); every other deferred catch-up runs first.
    inside = {m for m, ids in chains.items() if proposer.has_catch_up_ahead_chains and engine._all_deferred(ids)}
    engine.flush_deferred([i for i in request_ids if not any(i in chains[m] for m in inside)])
    forks: list[str] = []
    try:
        for m, ids in chains.items():   # chains in one pass per length (drafter/ahead_chains.py)
            reqs = [reqs_of[i] for i in ids]
            ahead = [r.in_flight[1][1: m + 1] for r in reqs]
            if m in inside:
                pending = [engine._take_deferred(r) for r in reqs]
                trees = proposer.catch_up_ahead_chains(reqs, [n for n, _ in pending], [f for _, f in pending],
                                                       ahead, width)
            else:
                trees = proposer.ahead_chains(reqs, ahead, width)
            for r, cache in zip(reqs, trees):
                r.outcomes = (r.committed_len, cache)
        done = {i for ids in chains.values() for i in ids}
        fill_outcomes(engine, [i for i in todo if i not in done], forks)
    except KVCacheFull as exc:   # no room for forks now: this round's verdicts draft on demand
        log.info("draft ahead skipped: %s", exc)
        engine.flush_deferred(request_ids)   # the groups not reached yet
        for i in todo:
            reqs_of[i].outcomes = None
    finally:
        for f in reversed(forks):   # borrowers before lenders
            proposer.remove(f)
    _outcome_rows(engine, todo)
    return flags


def _outcome_rows(engine, request_ids: list[str]) -> None:
    """Fills each request's `outcome_rows` from its outcome cache (deterministic drafts only),
    each distinct tree copied to the host once."""
    host: dict[int, list] = {}
    for rid in request_ids:
        req = engine.requests[rid]
        req.outcome_rows, cache = None, req.outcomes
        if req.sample_drafts or cache is None or cache[0] != req.committed_len:
            continue
        rows = {}
        for key, (tree, row) in cache[1].items():
            if id(tree) not in host:
                host[id(tree)] = host_lists(*to_host(tree.token_ids, tree.parents, tree.scores))
            rows[key] = ready_rows(key[-1], host[id(tree)], row)
        req.outcome_rows = rows


def _chains(engine, request_ids: list[str]) -> dict[int, list[str]]:
    """The requests whose tree being verified is a chain with deterministic drafts, by chain
    length, when the proposer drafts ahead for chains in one pass."""
    out: dict[int, list[str]] = {}
    for rid in request_ids:
        req = engine.requests[rid]
        _, _, parents, valid = req.in_flight
        m = sum(valid) - 1
        if (not req.sample_drafts and m >= 1 and all(valid[: m + 1])
                and all(parents[j] == j - 1 for j in range(1, m + 1))):
            out.setdefault(m, []).append(rid)
    return {m: ids for m, ids in out.items() if engine.proposer.supports_ahead_chains(len(ids))}


def fill_outcomes(engine, request_ids: list[str], forks: list[str]) -> None:
    """Draft ahead through forks of each request's state (the module docstring's three steps)."""
    if not request_ids:
        return
    proposer, width = engine.proposer, engine.cfg.ahead_width
    # 1. A fork per tree node that has absorbed the path to it: the draft's q after the node.
    nodes, fork_reqs = [], []
    for rid in request_ids:
        req = engine.requests[rid]
        _, toks, parents, valid = req.in_flight
        paths = {0: []}
        for j in range(1, len(toks)):
            if valid[j]:
                paths[j] = paths[parents[j]] + [toks[j]]   # a parent always has a lower index
        for j, path in paths.items():
            fid = f"{rid}{AHEAD_SEP}ahead{j}"
            forks.append(fid)   # before the fork: a fork that fails half-way is still freed
            proposer.ahead_fork(rid, fid)
            nodes.append((rid, j, path))
            fork_reqs.append(DraftRequest(fid, req.token_ids + path, req.params, req.seed, req.sample_drafts))
    proposer.ahead_absorb(fork_reqs, [len(p) for _, _, p in nodes])
    logq = proposer.ahead_logprobs([f.request_id for f in fork_reqs]).float().cpu()
    row = {(rid, j): i for i, (rid, j, _) in enumerate(nodes)}
    # 2. The likeliest outcomes per request.
    chosen = []
    for rid in request_ids:
        _, toks, parents, valid = engine.requests[rid].in_flight
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
        proposer.ahead_fork(src.request_id, fid)
        out_reqs.append(DraftRequest(fid, src.token_ids + [b], src.params, src.seed, src.sample_drafts))
    proposer.ahead_absorb(out_reqs, [1] * len(out_reqs))
    for rid in request_ids:
        engine.requests[rid].outcomes = (engine.requests[rid].committed_len, {})
    parts: dict[bool, list[int]] = {}
    for i, r in enumerate(out_reqs):
        parts.setdefault(r.sample_drafts, []).append(i)
    for idx in parts.values():
        tree = proposer.propose([out_reqs[i] for i in idx])
        for k, i in enumerate(idx):
            rid, _, b, path = chosen[i]
            engine.requests[rid].outcomes[1][tuple(path) + (b,)] = (tree, k)
