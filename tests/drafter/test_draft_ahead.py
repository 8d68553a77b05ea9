"""Draft ahead (the outcome cache of drafter/ahead.py), in process, fp32 on the CPU:

- greedy output with the cache equals plain decoding token for token (any tree is valid), for
  every method that drafts ahead, and hits and misses both happen;
- seeded sampled drafts from the cache carry their own q: batched equals alone, and the output
  distribution is the target's (chi-square), with a control that must be caught;
- forks share the request's KV blocks and give every block back;
- the next tree survives preemption (remove with keep_draft, re-prefill at the same length);
- per-request draft length caps (the router's short-draft modes) leave greedy output unchanged.
"""

from __future__ import annotations

import pytest
import torch

from spectandem.block_manager import BlockManager
from spectandem.config import SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.kv_cache import PagedKVCache
from router.local import LocalSpeculator
from tests.e2e.conftest import PROMPT_TEXTS

CASES = [
    ("eagle3", dict(num_steps=4, topk=1, num_draft_tokens=5)),
    ("eagle3", dict(num_steps=4, topk=2, num_draft_tokens=8)),
    ("eagle", dict(num_steps=3, topk=1, num_draft_tokens=4)),
    ("draft-model", dict(num_steps=4, topk=1, num_draft_tokens=5)),
]


def _spec(method, **tree):
    t, d = demo_paths(method)
    return LocalSpeculator(t, d, SpecConfig(method=method, **tree), max_slots=8, max_len=256)


@pytest.fixture(scope="module")
def plain():
    spec = _spec("none")
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:8]]
    return prompts, [c.token_ids for c in spec.generate(prompts, [SamplingParams(max_tokens=40)] * 8)]


@pytest.mark.parametrize("method,tree", CASES, ids=[f"{m}-k{t['topk']}" for m, t in CASES])
def test_greedy_with_outcome_cache_equals_plain(plain, method, tree):
    prompts, expected = plain
    spec = _spec(method, **tree)
    got = spec.generate(prompts, [SamplingParams(max_tokens=40)] * len(prompts), ahead=True)
    assert [c.token_ids for c in got] == expected
    d = spec.drafter
    assert d.ahead_hits > 0 and d.ahead_misses > 0, (d.ahead_hits, d.ahead_misses)
    # Every fork and every request is gone; the pool is whole again.
    assert d.proposer.kv_stats()["used_blocks"] == 0 and not d.proposer.slots.of
    assert not (d.requests or d.kept or len(d.store))   # what it held per request went with the request


def test_outcome_cache_is_off_without_width(plain):
    prompts, expected = plain
    t, dr = demo_paths("eagle3")
    spec = LocalSpeculator(t, dr, SpecConfig(method="eagle3", ahead_width=0), max_slots=8, max_len=256)
    got = spec.generate(prompts[:2], [SamplingParams(max_tokens=40)] * 2, ahead=True)
    assert [c.token_ids for c in got] == expected[:2]
    assert spec.drafter.ahead_hits == spec.drafter.ahead_misses == 0


def test_seeded_sampled_drafts_from_the_cache_are_batch_invariant():
    spec = _spec("eagle3", num_steps=3, topk=1, num_draft_tokens=4)
    prompts = [spec.tokenizer.encode(t).ids for t in PROMPT_TEXTS[:4]]
    params = [SamplingParams(max_tokens=32, temperature=1.0, seed=7 + i) for i in range(4)]
    together = [c.token_ids for c in spec.generate(prompts, params, ahead=True)]
    assert spec.drafter.ahead_hits > 0
    alone = [spec.generate([p], [sp], ahead=True)[0].token_ids for p, sp in zip(prompts, params)]
    assert together == alone
    again = [c.token_ids for c in spec.generate(prompts, params, ahead=True)]
    assert again == together


def _second_token_counts(spec, prompt, n, ahead, temperature=1.0, per_call=16):
    """Counts of the first three tokens over seeds 0..n-1, `per_call` seeded requests of the
    prompt at once (each request's tokens depend on its own seed alone, not on its batch)."""
    counts: dict[int, int] = {}
    hits = spec.drafter.ahead_hits
    for first in range(0, n, per_call):
        seeds = range(first, min(n, first + per_call))
        outs = spec.generate([prompt] * len(seeds), [SamplingParams(max_tokens=3, temperature=temperature, seed=s,
                                                                    ignore_eos=True) for s in seeds], ahead=ahead)
        for c in outs:
            counts[tuple(c.token_ids[:3])] = counts.get(tuple(c.token_ids[:3]), 0) + 1
    return counts, spec.drafter.ahead_hits - hits


def test_cached_sampled_trees_keep_the_target_distribution():
    """One-token sampled drafts: the first round commits token 2 (and 3 when its draft is
    accepted); otherwise token 3 comes from a round whose tree is from the outcome cache when the
    first verdict hit it. The joint law of tokens 1-3 must be the target's, computed exactly from
    its probabilities. Control: a flattened law must be rejected on the same counts."""
    from scipy.stats import chisquare

    t, dr = demo_paths("eagle3")
    spec = LocalSpeculator(t, dr, SpecConfig(method="eagle3", num_steps=1, topk=1, num_draft_tokens=2,
                                            ahead_width=8), max_slots=16, max_len=64)
    prompt = spec.tokenizer.encode("def __init__(self").ids
    n, temp = 900, 0.7
    counts, hits = _second_token_counts(spec, prompt, n, ahead=True, temperature=temp)
    assert hits > n // 8, hits   # a fair share of the draws go through cached trees
    # The exact law of the first three tokens under the target, from its own probabilities.
    model = spec.verifier.runner.model
    exact: dict[tuple, float] = {}

    @torch.no_grad()
    def probs_after(ids):
        from spectandem.kv_cache import KVCache

        s = model.spec
        cache = KVCache(s.num_layers, 1, s.num_kv_heads, len(ids), s.head_dim, torch.float32)
        pos = torch.arange(len(ids))[None]
        mask = torch.tril(torch.ones(len(ids), len(ids), dtype=torch.bool))[None]
        h, _ = model(torch.tensor([ids]), pos, cache.batch(torch.zeros(1, dtype=torch.long), pos, len(ids)), mask)
        return torch.softmax(model.logits(h[0, -1]).double() / temp, -1)

    p1 = probs_after(prompt)
    for a in torch.nonzero(p1 > 1e-3).flatten().tolist():
        p2 = probs_after(prompt + [a])
        for b in torch.nonzero(p2 > 1e-3).flatten().tolist():
            p3 = probs_after(prompt + [a, b])
            for c in torch.nonzero(p3 > 3e-3).flatten().tolist():
                exact[(a, b, c)] = float(p1[a] * p2[b] * p3[c])
    keys = sorted(exact, key=exact.get, reverse=True)
    top = [k for k in keys if exact[k] * n >= 10]
    assert len(top) >= 3, "the prompt must give several likely continuations"
    observed = [counts.get(k, 0) for k in top] + [n - sum(counts.get(k, 0) for k in top)]
    expected = [exact[k] * n for k in top] + [n * (1 - sum(exact[k] for k in top))]
    print("chi-square p", chisquare(observed, expected).pvalue, "hits", hits)
    assert chisquare(observed, expected).pvalue > 1e-3, (observed, expected)
    # Control: a law that is not the target's (its probabilities flattened) must be rejected.
    flat = [e ** 0.7 for e in expected[:-1]]
    flat = [f / sum(flat) * sum(expected[:-1]) for f in flat] + [expected[-1]]
    assert chisquare(observed, flat).pvalue < 1e-3


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    cache = PagedKVCache(1, 4, 1, 64, 2, torch.float32, num_blocks=8, block_size=4)
    cache.reserve(0, 10)                                  # 3 blocks: 4 + 4 + 2 entries
    rows = cache.rows(torch.tensor([0]), torch.arange(10)[None])[0]
    cache.k[0][rows] = torch.arange(10, dtype=torch.float32)[:, None, None].expand(10, 1, 2)
    used = cache.blocks.num_used
    cache.fork(0, 1, 10)
    assert cache.blocks.num_used == used + 1             # only the partial block is new
    fork_rows = cache.rows(torch.tensor([1]), torch.arange(10)[None])[0]
    assert torch.equal(cache.k[0][fork_rows], cache.k[0][rows])
    assert torch.equal(fork_rows[:8], rows[:8]) and not torch.equal(fork_rows[8:], rows[8:])
    cache.reserve(1, 20)                                  # the fork grows into blocks of its own
    cache.trim(1, 0)                                      # never gives back borrowed blocks
    assert cache.blocks.tables[1] == cache.blocks.tables[0][:2]
    cache.free(1)
    assert cache.blocks.num_used == used and cache.blocks.tables[0]
    cache.free(0)
    assert cache.blocks.num_used == 0


def test_block_manager_share_is_not_given_back_by_the_borrower():
    bm = BlockManager(6, 4)
    lender = bm.allocate(0, 8)
    bm.share(1, lender)
    bm.allocate(1, 12)
    assert bm.num_used == 3
    bm.deallocate(1)
    assert bm.num_used == 2 and sorted(bm.free) == sorted(set(range(6)) - set(lender))
    with pytest.raises(ValueError):
        bm.share(0, [5])


def test_next_tree_is_kept_through_preemption():
    """Greedy EAGLE-3: run rounds with the cache until a verdict hits, preempt (remove with
    keep_draft), re-prefill from the verifier's features: the next draft is the kept tree. A
    kept tree of another committed length is dropped at re-prefill, and a plain remove drops it."""
    spec = _spec("eagle3", num_steps=4, topk=1, num_draft_tokens=5)
    v, d = spec.verifier, spec.drafter
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[0]).ids
    sp = SamplingParams(max_tokens=200)
    first = v.prefill(["r"], [prompt], [sp], [1])[0]
    d.add("r", prompt, first.first_token_id, sp, 1, first.features)
    for _ in range(30):
        tree = d.draft(["r"])
        d.draft_ahead(["r"])
        d.extend(v.verify(tree))
        if d.requests["r"].ready is not None:
            break
    assert d.requests["r"].ready is not None, "no verdict hit the outcome cache in 30 rounds"
    ready_len, ready_tree, row = d.requests["r"].ready
    committed = list(d.requests["r"].token_ids)
    assert ready_len == len(committed)
    d.remove("r", keep_draft=True)
    assert "r" in d.kept and "r" not in d.requests and d.proposer.kv_stats()["used_blocks"] == 0
    d.add("r", committed[:-1], committed[-1], sp, 1, v.features("r"), epoch=1)
    assert "r" not in d.kept and d.requests["r"].ready[0] == len(committed)
    resumed = d.draft(["r"])
    m = ready_tree.token_ids.shape[1]
    assert resumed.token_ids[0, 1: 1 + m].tolist() == ready_tree.token_ids[row].tolist()
    assert resumed.committed_lens == [len(committed)]
    d.extend(v.verify(resumed))
    # A kept tree of another length is not used.
    committed = list(d.requests["r"].token_ids)
    d.remove("r", keep_draft=True)
    d.kept["r"] = (len(committed) - 1, ready_tree, row)
    d.add("r", committed[:-1], committed[-1], sp, 1, v.features("r"), epoch=2)
    assert d.requests["r"].ready is None and "r" not in d.kept
    # A plain remove forgets a kept tree.
    d.kept["r"] = (len(committed), ready_tree, row)
    d.remove("r")
    assert not d.kept and not d.requests
    v.release("r")


@pytest.mark.parametrize("method,tree", CASES[:2] + CASES[3:], ids=["eagle3-chain", "eagle3-tree", "draft-model"])
def test_draft_length_caps_per_request(plain, method, tree):
    """The router's short-draft modes: `draft(ids, num_steps=[...])` caps each request's tree
    depth on its own; greedy output is unchanged and the trees really are shallower."""
    from spectandem.tree import node_depths

    prompts, expected = plain
    spec = _spec(method, **tree)
    v, d = spec.verifier, spec.drafter
    ids = [f"r{i}" for i in range(3)]
    sp = SamplingParams(max_tokens=40)
    for out, p in zip(v.prefill(ids, prompts[:3], [sp] * 3, [1, 2, 3]), prompts):
        d.add(out.request_id, p, out.first_token_id, sp, 1, out.features)
    tokens = {i: [] for i in ids}
    caps = [1, 2, None]
    seen_depths = set()
    while min(len(t) for t in tokens.values()) < 39:
        drafts = d.draft(ids, caps)
        depth = node_depths(drafts.parents, drafts.node_valid).masked_fill(~drafts.node_valid, 0).amax(1).tolist()
        assert depth[0] <= 1 and depth[1] <= 2 and depth[2] <= tree["num_steps"]
        seen_depths.add(depth[2])
        outs = v.verify(drafts)
        for o in outs:
            tokens[o.request_id] += o.token_ids
        d.extend(outs)
    assert max(seen_depths) > 2   # the uncapped request drafts deeper
    for i, rid in enumerate(ids):
        assert [expected[i][0]] + tokens[rid][:38] == expected[i][:39]
    for rid in ids:
        v.release(rid)
        d.remove(rid)
