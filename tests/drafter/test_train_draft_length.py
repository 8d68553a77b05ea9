"""`spectandem train-draft --draft-length N`: the head it writes states N draft tokens in its
config (speculators' speculative_tokens), and serve drafts that deep by default."""

from __future__ import annotations

import pytest

from drafter.data import EOS
from drafter.train import TrainConfig
from spectandem.checkpoint import declared_draft_length, read_config
from spectandem.cli import main
from spectandem.config import SpecConfig
from spectandem.demo import demo_paths


def test_train_draft_writes_the_stated_length(tmp_path):
    docs = [f"doc{i}\n" + " ".join(f"word{j % 17} of line {i}" for j in range(60)) for i in range(6)]
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(EOS.join(docs))
    out = tmp_path / "head"
    rc = main(["train-draft", "--target", str(demo_paths("none")[0]), "--corpus", str(corpus), "--out", str(out),
               "--steps", "2", "--batch", "2", "--seq-len", "16", "--draft-vocab-size", "64", "--device", "cpu",
               "--draft-length", "3"])
    assert rc == 0
    assert declared_draft_length(read_config(out)) == 3
    cfg = SpecConfig(method="eagle3").for_draft(str(out))
    assert (cfg.num_steps, cfg.num_draft_tokens) == (3, 4)


def test_train_config_refuses_a_draft_length_below_one():
    with pytest.raises(ValueError, match="draft_length must be >= 1, got 0"):
        TrainConfig(draft_length=0)
