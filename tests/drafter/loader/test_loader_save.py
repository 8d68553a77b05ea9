"""drafter.loader.save_head writes the public format (bf16); what it writes loads back to the
same head."""

from __future__ import annotations

import pytest
import torch

from drafter.loader import load_head, save_head
from spectandem.checkpoint import load_weights
from tests.drafter.loader.eagle_checkpoints import (eagle1_checkpoint, eagle3_checkpoint, pairs, run_pairs,
                                                    speculators_checkpoint, write)


def _bf16_exact(t: dict) -> dict:
    return {k: v.bfloat16().float() if v.is_floating_point() else v for k, v in t.items()}


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_save_head_round_trip(kind, tmp_path, target):
    if kind == "eagle":
        cfg, t = eagle1_checkpoint(23, fc_bias=True, qkv_bias=True)
    else:
        cfg, t = eagle3_checkpoint(23, head_dim=16)
        cfg["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": [0, 2, 5]}
    head = load_head(write(tmp_path / "src", cfg, _bf16_exact(t)), target)
    save_head(head, tmp_path / "saved")
    again = load_head(tmp_path / "saved", target)

    assert again.spec == head.spec
    saved = load_weights(tmp_path / "saved")
    assert "embed_tokens.weight" not in saved
    if kind == "eagle3":
        assert saved["d2t"].dtype == torch.int64 and saved["t2d"].dtype == torch.bool
        assert torch.equal(saved["t2d"], t["t2d"]) and torch.equal(saved["d2t"], t["d2t"])
        assert all(k.startswith(("midlayer.", "fc.", "norm.", "lm_head.", "d2t", "t2d")) for k in saved)
    else:
        assert "lm_head.weight" not in saved and all(k.startswith(("layers.0.", "fc.")) for k in saved)
    tokens, feats = pairs(24, head.spec.feature_size)
    out, logits = run_pairs(head, tokens, feats, chunks=(3, 4))
    out2, logits2 = run_pairs(again, tokens, feats, chunks=(3, 4))
    assert torch.equal(out, out2) and torch.equal(logits, logits2)


@pytest.mark.parametrize("fields", [{"hidden_act": "gelu", "norm_before_residual": True},
                                    {"hidden_act": "gelu_pytorch_tanh", "norm_output": False}])
def test_save_head_keeps_the_computation_options(fields, tmp_path, target):
    cfg, t = eagle3_checkpoint(32)
    head = load_head(write(tmp_path / "src", {**cfg, **fields}, _bf16_exact(t)), target)
    save_head(head, tmp_path / "saved")
    again = load_head(tmp_path / "saved", target)
    assert again.spec == head.spec
    assert (head.spec.hidden_act, head.spec.norm_before_residual, head.spec.final_norm) == \
        (fields["hidden_act"], fields.get("norm_before_residual", False), fields.get("norm_output", True))


def test_save_head_refuses_normed_feedback(tmp_path, target):
    """The flat format has no field for speculators' norm_output (its norm_output means another thing)."""
    cfg, t = speculators_checkpoint(33, norm_before_residual=False, norm_output=True)
    head = load_head(write(tmp_path / "src", cfg, t), target)
    with pytest.raises(ValueError, match="norm_output"):
        save_head(head, tmp_path / "saved")


def test_save_head_states_its_draft_length(tmp_path, target):
    """`draft_length` goes into the config as speculators state it; the head loads as before, and
    serve's default depth is then that length (spectandem/config.py SpecConfig.for_draft)."""
    from spectandem.checkpoint import declared_draft_length, read_config
    from spectandem.config import SpecConfig

    cfg, t = eagle3_checkpoint(23, head_dim=16)
    head = load_head(write(tmp_path / "src", cfg, _bf16_exact(t)), target)
    save_head(head, tmp_path / "plain")
    save_head(head, tmp_path / "stated", draft_length=6)
    assert declared_draft_length(read_config(tmp_path / "plain")) is None
    assert declared_draft_length(read_config(tmp_path / "stated")) == 6
    assert load_head(tmp_path / "stated", target).spec == head.spec
    cfg = SpecConfig(method="eagle3").for_draft(str(tmp_path / "stated"))
    assert (cfg.num_steps, cfg.num_draft_tokens) == (6, 7)
