"""The drafter's factory (drafter/factory.py) reads of the target only what its method uses: an
EAGLE head the embeddings and lm_head, a draft model the vocabulary size, n-gram drafting
nothing; its drafts equal those of a drafter built on the whole loaded target."""

import pytest
import torch

import drafter.factory as factory
import spectandem.modeling.llama as llama
from drafter.factory import build_engine
from spectandem.config import EngineConfig, SamplingParams, SpecConfig
from spectandem.demo import demo_paths
from spectandem.modeling.target import inspect_target, load_embeddings, load_target


def _config(method: str) -> EngineConfig:
    target, draft = demo_paths(method)
    return EngineConfig(target_dir=str(target), draft_dir=None if draft is None else str(draft),
                        spec=SpecConfig(method=method, num_steps=3, topk=1, num_draft_tokens=4), max_slots=2,
                        max_len=128)


def _no_target_model(monkeypatch):
    """Any load of the whole target fails the test."""
    def refuse(*a, **k):
        raise AssertionError("the drafter loaded the whole target model")
    monkeypatch.setattr(factory, "load_target", refuse)
    real = llama.load_llama
    target_dir = str(demo_paths("eagle3")[0])
    monkeypatch.setattr(llama, "load_llama", lambda d, *a, **k: refuse() if str(d) == target_dir else real(d, *a, **k))


def _drafts(engine, head_features: int | None) -> list[list[int]]:
    prompt = [(7 * i) % 4000 + 5 for i in range(20)]
    feats = None
    if head_features:
        g = torch.Generator().manual_seed(3)
        feats = torch.randn(len(prompt), head_features, generator=g)
    engine.add("a", prompt, 11, SamplingParams(), seed=1, features=feats)
    return engine.draft(["a"]).token_ids.tolist()


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_eagle_drafter_holds_no_decoder_layer_and_drafts_alike(method, monkeypatch):
    config = _config(method)
    full = load_target(inspect_target(config.target_dir, config.max_len), config.torch_dtype, "cpu")
    shared, _ = build_engine(config, target=full, context=128)
    _no_target_model(monkeypatch)
    alone, context = build_engine(config)
    assert context == 128
    head = alone.proposer.head
    assert not any(name.startswith(("model.layers", "layers.1")) for name, _ in head.named_parameters())
    assert torch.equal(head.embed_tokens.weight, shared.proposer.head.embed_tokens.weight)
    assert torch.equal(head.lm_head.weight, shared.proposer.head.lm_head.weight)
    f = head.spec.feature_size
    assert _drafts(alone, f) == _drafts(shared, f)


def test_tied_embeddings_give_lm_head_as_the_embeddings():
    checkpoint = inspect_target(demo_paths("eagle3")[0], 128)
    embed, lm_head = load_embeddings(checkpoint)
    full = load_target(checkpoint)
    assert lm_head is embed     # the demo target ties them
    assert torch.equal(embed, full.model.embed_tokens.weight) and torch.equal(lm_head, full.lm_head.weight)


@pytest.mark.parametrize("method", ["draft-model", "ngram"])
def test_other_methods_read_no_target_weights(method, monkeypatch):
    _no_target_model(monkeypatch)
    monkeypatch.setattr(factory, "load_embeddings", lambda *a, **k: pytest.fail("read the target's embeddings"))
    engine, context = build_engine(_config(method))
    assert context == 128 and _drafts(engine, None)
