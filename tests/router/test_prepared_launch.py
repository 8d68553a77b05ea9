"""Prepared launches (verifier/chained.py): at batch 1 the drafted-ahead trees come before the
verdict, and the verifier packs the next verify's inputs for every outcome then
(VerifierEngine.prepare_next, NativeRunner.prepare_rows); at the verdict, before its commit, the
verify launches the outcome's row (VerifierEngine._launch_prepared). A miss's tree, drafted
after the verdict, launches from an outcome's inputs of its shape with its tokens written in.

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

    def verify(self, slots, cache_lens, token_ids, parents, node_valid, flat=None, device_tokens=None, ready=None):
        if flat is not None:
            for slot, c in zip(slots, cache_lens):
                self.cache.reserve(slot, c + token_ids.shape[1])
            if device_tokens is not None:   # a launch from the drafter's drafts: they replace the flat's
                token_ids, flat = token_ids.clone(), flat.clone()
                token_ids[:, 1:] = device_tokens
                flat[: 8 * token_ids.shape[1]].view(torch.int64).copy_(token_ids[0])
            fresh = host_tree_inputs(self.cache, slots, cache_lens, token_ids, parents, node_valid, 1)
            _CheckedRunner.checked += 1
            _CheckedRunner.mismatched += not torch.equal(flat, fresh)
        return super().verify(slots, cache_lens, token_ids, parents, node_valid, device_tokens=device_tokens)


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
    prepared, like = spec.verifier.launched_prepared, spec.verifier.launched_like_prepared
    # A miss's tree launched once drafted takes the inputs of an outcome of its shape at its
    # committed length where one was prepared (VerifierEngine._prepared_like; the demo drafter's
    # outcomes are rarely of its length: the test below makes one): checked the same way.
    assert 0 < prepared <= vlink.chained_launches and like <= vlink.missed_launches
    assert _CheckedRunner.checked == prepared + like
    assert sum(at_verdict) == prepared     # every chain's launched at its verdict, before the commit
    assert _CheckedRunner.mismatched == (0 if offset == 0 else prepared + like)
    assert not spec.verifier.requests and spec.verifier._prepared is None


@pytest.mark.parametrize("offset", [0, 1], ids=["prepared", "control-one-entry-off"])
def test_a_missed_tree_launches_from_the_inputs_prepared_for_its_shape(offset, monkeypatch):
    """Engine level: an armed verify of a root alone commits one token; the outcome trees
    prepared before its verdict (chains of three nodes) guessed another one, so the verdict
    misses. The miss's tree, drafted after the verdict (a chain of that shape at the verdict's
    committed length), launches from the inputs prepared for the outcome of its length with its
    tokens written in (VerifierEngine._prepared_like): byte for byte the inputs packed afresh,
    and its verdict is an unchained engine's. A tree of another shape packs its own. Control:
    inputs prepared one entry off are caught."""
    from tests.router.test_chained_verify import _greedy_next, _reference
    from spectandem.messages import ReadyTree, trees_from_ready

    spec, plain = _pair()
    monkeypatch.setattr(spec.verifier.runner, "__class__", _CheckedRunner)
    monkeypatch.setattr(_CheckedRunner, "offset", offset)
    monkeypatch.setattr(_CheckedRunner, "checked", 0)
    monkeypatch.setattr(_CheckedRunner, "mismatched", 0)
    eng = spec.verifier
    prompt = spec.tokenizer.encode(PROMPT_TEXTS[1]).ids
    first = eng.prefill(["a"], [prompt], [SamplingParams(max_tokens=32)], [0])[0].first_token_id
    n = eng.committed_len("a")
    t = _greedy_next(plain, prompt + [first], 1)[0]        # the verdict's one token
    wrong = (t + 1) % 500
    chain = lambda root, *drafts: ReadyTree((root, *drafts), (-1, 0, 1), (0.0, -1.0, -2.0))
    outcomes = {(wrong,): chain(wrong, 11, 12), (first, wrong): chain(wrong, 13, 14)}
    eng.arm_next(["a"], [n])
    assert eng.prepare_next(["a"], [n], [outcomes])
    out = eng.verify(trees_from_ready(["a"], [n], [ReadyTree((first,), (-1,), (0.0,))]))[0]
    assert out.token_ids == [t] and not eng.launch_next(eng.take_verdict(), [outcomes])   # a miss
    ready = chain(t, 21, 22)
    tree = trees_from_ready(["a"], [n + 1], [ready])
    assert eng.launch(tree)
    assert eng.launched_like_prepared == _CheckedRunner.checked == 1
    assert _CheckedRunner.mismatched == offset
    got = eng.verify(tree)[0]
    assert eng.launched_early == 1 and eng._prepared is None
    assert [got.token_ids, got.num_accepted] == _reference(plain, prompt + [first, t], ready)
    # Another shape at the next committed length, with nothing prepared: packed afresh.
    other = trees_from_ready(["a"], [got.committed_len], [ReadyTree((got.token_ids[-1], 5), (-1, 0), (0.0, -1.0))])
    assert eng.launch(other) and eng.launched_like_prepared == 1 == _CheckedRunner.checked
    eng.verify(other)
    eng.release("a")
