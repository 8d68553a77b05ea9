"""Prepared launches (verifier/chained.py): at batch 1 the drafted-ahead trees come before the
verdict, and the verifier packs the next verify's inputs for every outcome then
(VerifierEngine.prepare_next, NativeRunner.prepare_rows); at the verdict, before its commit, the
verify launches the outcome's row (VerifierEngine._launch_prepared).

On the CPU no verify reads packed inputs (that is the GPU's tree attention in CUDA graphs), so the
round test runs the demo target through a runner that says it does and, at each launch from
prepared inputs, compares them byte for byte with the inputs packed afresh at that moment (from
the slot's block table then), before verifying eagerly. Tokens equal plain
decoding's. Control: inputs prepared one entry off are caught. Units: splitting a packed batch
into one-row inputs, and a commit's trim keeping the entries a preparation reserved."""

from __future__ import annotations

import random

import pytest
import torch

from router.links_local import LocalDrafterLink, LocalVerifierLink
from spectandem.config import SamplingParams
from spectandem.kv_cache import PagedKVCache
from tests.e2e.conftest import PROMPT_TEXTS
from tests.router.test_chained_verify import _pair, _serve
from verifier.tree_inputs import host_tree_inputs, tree_input_rows
from verifier.runner import NativeRunner


def _trees(rng: random.Random, rows: int, n: int):
    tok = torch.tensor([[rng.randrange(1, 500) for _ in range(n)] for _ in range(rows)])
    par = torch.tensor([[-1] + [rng.randrange(0, j) for j in range(1, n)] for _ in range(rows)])
    valid = torch.ones(rows, n, dtype=torch.bool)
    valid[-1, n - 1] = False           # one padded node
    tok[-1, n - 1] = -1
    return tok, par, valid


def test_rows_split_from_a_packed_batch_equal_each_row_packed_alone():
    cache = PagedKVCache(1, 3, 1, 256, 8, torch.float32, "cpu", num_blocks=48, block_size=16)
    cache.reserve(1, 60)
    rng = random.Random(3)
    for rows, n in ((1, 5), (4, 5), (5, 7)):
        tok, par, valid = _trees(rng, rows, n)
        lens = [rng.randrange(10, 50) for _ in range(rows)]
        parts = tree_input_rows(host_tree_inputs(cache, [1] * rows, lens, tok, par, valid, rows),
                                rows, n, cache.host_tables.shape[1])
        assert len(parts) == rows
        for i, part in enumerate(parts):
            alone = host_tree_inputs(cache, [1], [lens[i]], tok[i: i + 1], par[i: i + 1], valid[i: i + 1], 1)
            assert torch.equal(part, alone), (rows, n, i)


def test_commit_keeps_the_entries_a_preparation_reserved():
    runner = _pair()[0].verifier.runner
    cache = runner.cache
    cache.reserve(0, 40)              # a verify of 8 nodes at cache length 32: blocks 0..2
    cache.reserve(0, 60)              # a preparation for outcomes up to 60 entries: block 3 too
    path = torch.tensor([[0, 1, 2, -1, -1, -1, -1, -1]])
    runner.commit([0], [32], path, keep=[60])
    assert len(cache.blocks.tables[0]) == 4                     # kept for the prepared launch
    runner.commit([0], [35], torch.tensor([[0, -1]]))          # the next round, nothing prepared
    assert len(cache.blocks.tables[0]) == 3                     # 36 entries: three blocks of 16


class _CheckedRunner(NativeRunner):
    """The demo target's runner, said to read packed inputs: each launch from prepared inputs is
    compared with the inputs packed afresh at that moment, then verified eagerly."""

    packs_tree_inputs = True
    offset = 0             # the control: prepare each outcome's inputs this many entries off
    checked = mismatched = 0

    def prepare_rows(self, slot, cache_lens, token_ids, parents, node_valid):
        return super().prepare_rows(slot, [c + self.offset for c in cache_lens], token_ids, parents, node_valid)

    def verify(self, slots, cache_lens, token_ids, parents, node_valid, flat=None):
        if flat is not None:
            for slot, c in zip(slots, cache_lens):
                self.cache.reserve(slot, c + token_ids.shape[1])
            fresh = host_tree_inputs(self.cache, slots, cache_lens, token_ids, parents, node_valid, 1)
            _CheckedRunner.checked += 1
            _CheckedRunner.mismatched += not torch.equal(flat, fresh)
        return super().verify(slots, cache_lens, token_ids, parents, node_valid)


@pytest.mark.parametrize("offset", [0, 1], ids=["prepared", "control-one-entry-off"])
def test_prepared_launches_equal_the_inputs_packed_at_the_verdict(offset, monkeypatch):
    spec, plain = _pair()
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[1]).ids
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    expected = plain.generate([prompt], [params])[0].token_ids
    monkeypatch.setattr(spec.verifier.runner, "__class__", _CheckedRunner)
    monkeypatch.setattr(_CheckedRunner, "offset", offset)
    monkeypatch.setattr(_CheckedRunner, "checked", 0)
    monkeypatch.setattr(_CheckedRunner, "mismatched", 0)
    real_verify = LocalVerifierLink._verify

    def trees_before_the_verdict(self, armed, *args):
        """As on a GPU, where the forward outlasts drafting ahead: an armed verify's acceptance
        waits for the staged trees (whose inputs are prepared as they are staged)."""
        if armed is None:
            return real_verify(self, armed, *args)
        accept = self.engine._accept
        self.engine._accept = lambda *a: (armed.wait(10.0), accept(*a))[1]
        try:
            return real_verify(self, armed, *args)
        finally:
            del self.engine._accept
    monkeypatch.setattr(LocalVerifierLink, "_verify", trees_before_the_verdict)
    at_verdict = []
    launch_prepared = type(spec.verifier)._launch_prepared

    def counted(self, *args):
        at_verdict.append(launch_prepared(self, *args))
        return at_verdict[-1]
    monkeypatch.setattr(type(spec.verifier), "_launch_prepared", counted)
    dlink = LocalDrafterLink(spec.drafter)
    vlink = LocalVerifierLink(spec.verifier, chain=True)
    (got,), _, _ = _serve(spec, [prompt], [params], chain=True, dlink=dlink, vlink=vlink)
    assert got == expected
    prepared = spec.verifier.launched_prepared
    assert 0 < prepared == _CheckedRunner.checked <= vlink.chained_launches
    assert sum(at_verdict) == prepared     # every chain's launched at its verdict, before the commit
    assert _CheckedRunner.mismatched == (0 if offset == 0 else prepared)
    assert not spec.verifier.requests and spec.verifier._prepared is None
