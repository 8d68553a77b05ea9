"""The drafter's start-up graph captures on the CPU: the keys `warm_up` captures cover every key a
chain, a draft ahead and a catch-up of a served batch look up (so nothing is captured while
serving, up to WARM_MAX_SPAN entries), and the all-padding inputs each capture starts from run
through the same padded computation eagerly, writing only the trash row."""

from __future__ import annotations

import pytest
import torch

from drafter.ahead_chains import AheadChainGraphs, ahead_forward, scratch_entries
from drafter.catchup_graphs import CatchUpGraphs, catch_up_forward
from drafter.graphs import PAIR_BUCKETS, PREFILL_PAIR_BUCKETS, ChainGraphs, chain_forward, pair_bucket, warm_spans
from drafter.proposers import EagleProposer
from spectandem.config import SpecConfig
from spectandem.cuda_graphs import batch_bucket, span_bucket

MAX_LEN = 300
# `target` and `head` (the demo target, each demo head; fp32): tests/drafter/conftest.py.


def test_warm_spans():
    assert warm_spans(300, 4096) == [32, 64, 128, 256, 300]
    assert warm_spans(131072, 4096) == [32, 64, 128, 256, 512, 1024, 2048, 4096]
    assert warm_spans(20, 4096) == [20]
    assert warm_spans(1000, 100) == [32, 64, 128]


def _proposer(head, **cfg):
    return EagleProposer(head, SpecConfig(method=head.spec.kind, topk=1, **cfg), max_slots=8, max_len=MAX_LEN)


def test_chain_keys_cover_every_served_chain(head):
    """Every (batch, catch-up pairs, committed entries) a chain of num_steps or of short:2 takes:
    the key `ChainGraphs._run` looks up is among the warm keys, a prefill's (larger pairs) too."""
    p = _proposer(head, num_steps=4, num_draft_tokens=5)
    graphs = ChainGraphs(head, p.cache, graph=False)
    keys = set(graphs.warm_keys(8, [4, 2], warm_spans(MAX_LEN, 4096)))
    for b in range(1, 9):
        rows = batch_bucket(b, graphs.batch_buckets)
        for steps in (4, 2):
            for new in [0, *range(1, PAIR_BUCKETS[-1] + 1), 33, 100, 200]:
                pairs = 0 if new == 0 else pair_bucket(rows, new, graphs.pair_buckets)
                if pairs is None:   # past every bucket: eager
                    continue
                for base in range(max(new, 1), MAX_LEN - steps + 2, 7):
                    key = (rows, span_bucket(base + steps - 1, MAX_LEN), steps, pairs)
                    assert key in keys, key
    assert not any(k[2] == 3 for k in keys)   # chain lengths no mode drafts are left out


def test_catch_up_and_ahead_keys_cover_served_passes(head):
    p = _proposer(head, num_steps=4, num_draft_tokens=5, ahead_width=4)
    spans = warm_spans(MAX_LEN, 4096)
    catch_up = CatchUpGraphs(head, p.cache, graph=False)
    keys = set(catch_up.warm_keys(8, spans))
    for b in range(1, 9):
        rows = batch_bucket(b, catch_up.batch_buckets)
        for new in [*range(1, 17), 40, 120, 250]:
            pairs = pair_bucket(rows, new, catch_up.pair_buckets)
            for base in range(0, MAX_LEN - new + 1, 9):
                assert (rows, pairs, span_bucket(base + new, MAX_LEN)) in keys
    ahead = AheadChainGraphs(head, p.cache, graph=False)
    keys = set(ahead.warm_keys(8, spans, 4, 4))
    need = scratch_entries(4, 4, 4)
    for b in range(1, 9):
        rows = batch_bucket(b, ahead.batch_buckets)
        for new in range(0, 17):
            pairs = 0 if new == 0 else batch_bucket(new, ahead.pair_buckets)
            for base in range(max(new, 1), MAX_LEN - need + 1, 11):
                assert (rows, span_bucket(base + need, MAX_LEN), 4, 4, 4, pairs) in keys


def _trash_only(cache, run) -> None:
    """`run` writes no cache row but the trash row."""
    keep = [t.clone() for t in (*cache.k, *cache.v)]
    for t in (*cache.k, *cache.v):
        t.normal_()
    before = [t.clone() for t in (*cache.k, *cache.v)]
    run()
    trash = cache.trash_row
    for a, b in zip(before, (*cache.k, *cache.v)):
        changed = (a != b).flatten(1).any(1).nonzero().flatten().tolist()
        assert set(changed) <= {trash}, changed
    for t, k in zip((*cache.k, *cache.v), keep):
        t.copy_(k)


@pytest.mark.parametrize("pairs", [0, 2, 16, PREFILL_PAIR_BUCKETS[0]])
def test_padding_inputs_run_and_write_only_the_trash_row(head, pairs):
    p = _proposer(head, num_steps=4, num_draft_tokens=5, ahead_width=4)
    s = head.spec
    chain = ChainGraphs(head, p.cache, graph=False)
    inp = chain.padding_inputs((4, 64, 4, pairs))
    out = {}
    _trash_only(p.cache, lambda: out.update(chain=chain_forward(head, p.cache, inp)))
    toks, hidden, logits = out["chain"]
    assert toks.shape == (4, 4) and hidden.shape == (4, 1, s.hidden_size) and logits.shape == (4, s.draft_vocab_size)
    if pairs <= PAIR_BUCKETS[-1]:
        ahead = AheadChainGraphs(head, p.cache, graph=False)
        inp = ahead.padding_inputs((2, 64, 4, 4, 4, pairs))
        _trash_only(p.cache, lambda: out.update(ahead=ahead_forward(head, p.cache, inp, ahead.target_to_draft)))
        assert out["ahead"][0].shape == (2, 4, 3 + 4)
    if pairs:
        catch_up = CatchUpGraphs(head, p.cache, graph=False)
        inp = catch_up.padding_inputs((4, pairs, 64))
        _trash_only(p.cache, lambda: out.update(catch_up=catch_up_forward(head, p.cache, inp, 64)))
        assert out["catch_up"][0].shape == (4, 1, s.hidden_size)


def test_warm_up_captures_nothing_without_graphs(head):
    """On the CPU (no CUDA graphs) the proposer has nothing to capture."""
    assert _proposer(head).warm_up(8) == 0
