"""drafter.loader refusals: every malformed or unsafe checkpoint directory (wrong vocabulary or
width, missing config or weights, tensors of the wrong shape, a pickle that holds code, corrupt
files, an unknown target architecture) is refused with a message naming it."""

from __future__ import annotations

import json
import os
import zipfile
from pathlib import Path

import pytest
import torch

from drafter.loader import load_head
from spectandem.checkpoint import CheckpointError, load_weights
from spectandem.modeling.llama import load_llama
from tests.drafter.loader.eagle_checkpoints import (H, HD, HT, L, NKV, V, VD, eagle1_checkpoint, eagle3_checkpoint,
                                                    speculators_checkpoint, write)


# ---------------------------------------------------------------------------------------------
# Refusals: each names the file or directory and says what is wrong.


def _raises_naming(path: Path, *words: str, call):
    with pytest.raises(ValueError) as err:
        call()
    msg = str(err.value)
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg
    return err.value


def test_refuses_head_vocab_other_than_targets(tmp_path, target):
    cfg, t = eagle1_checkpoint(15, fc_bias=True)
    cfg["vocab_size"] = V + 4
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d / "config.json", "vocab_size", str(V + 4), str(V), call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


@pytest.mark.parametrize("field,value", [("hidden_size", 2 * H), ("target_hidden_size", 2 * HT)])
def test_refuses_head_width_other_than_targets(field, value, tmp_path, target):
    cfg, t = eagle3_checkpoint(16)
    cfg[field] = value
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d / "config.json", "hidden size", str(value), str(HT), call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


def test_refuses_missing_config(tmp_path, target):
    cfg, t = eagle3_checkpoint(17)
    d = write(tmp_path, cfg, t)
    (d / "config.json").unlink()
    e = _raises_naming(d / "config.json", "missing config.json", call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)
    _raises_naming(tmp_path / "absent", "not a directory", call=lambda: load_head(tmp_path / "absent", target))


def test_refuses_missing_weights(tmp_path, target):
    cfg, _ = eagle3_checkpoint(18)
    d = tmp_path / "config-only"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    e = _raises_naming(d, "no weights", call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


@pytest.mark.parametrize("key,shape", [("midlayer.self_attn.k_proj.weight", (NKV * HD + 1, 2 * H)),
                                       ("fc.weight", (H, 2 * HT)),
                                       ("lm_head.weight", (VD, H + 2))])
def test_refuses_tensor_of_wrong_shape(key, shape, tmp_path, target):
    cfg, t = eagle3_checkpoint(19)
    t[key] = torch.zeros(shape)
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d, "shape", str(tuple(shape)), key.split(".", 1)[1] if key.startswith("midlayer.") else key,
                       call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


def test_refuses_unknown_target_architecture(tmp_path):
    d = tmp_path / "gpt2"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
                                               "n_embd": 16, "n_layer": 1, "n_head": 2, "vocab_size": V}))
    _raises_naming(d, "GPT2LMHeadModel", "no native implementation", call=lambda: load_llama(d))


class _Exploit:
    """Pickles as a call to os.system: loading it with plain pickle would run the command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"echo pwned > {self.marker}",))


def test_refuses_bin_that_holds_code(tmp_path, target):
    marker = tmp_path / "pwned.txt"
    cfg, t = eagle1_checkpoint(20, fc_bias=True)
    d = write(tmp_path / "evil", cfg, {}, "bin")
    torch.save({**t, "fc.weight": _Exploit(marker)}, d / "pytorch_model.bin")
    with zipfile.ZipFile(d / "pytorch_model.bin") as z:  # the pickle really calls os.system
        assert b"system" in z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert not marker.exists()

    e = _raises_naming(d / "pytorch_model.bin", "refused", call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)
    _raises_naming(d / "pytorch_model.bin", "refused", call=lambda: load_weights(d))
    assert not marker.exists()


def test_refuses_weights_without_an_eagle_layer(tmp_path, target):
    cfg, t = eagle3_checkpoint(25)
    d = write(tmp_path, cfg, {k: v for k, v in t.items() if "q_proj" not in k})
    _raises_naming(d, "q_proj", "not an EAGLE head", call=lambda: load_head(d, target))


def test_refuses_aux_layers_outside_the_target(tmp_path, target):
    cfg, t = eagle3_checkpoint(26)
    d = write(tmp_path, {**cfg, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, L]}}, t)
    _raises_naming(d / "config.json", f"auxiliary layer {L + 1}", call=lambda: load_head(d, target))


def test_refuses_bin_that_is_not_a_dict_of_tensors(tmp_path, target):
    cfg, t = eagle1_checkpoint(21, fc_bias=True)
    d = write(tmp_path, cfg, {**t, "step": 3}, "bin")
    _raises_naming(d / "pytorch_model.bin", "dict of tensors", call=lambda: load_head(d, target))


def test_refuses_corrupt_safetensors(tmp_path, target):
    cfg, _ = eagle3_checkpoint(22)
    d = tmp_path / "corrupt"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    _raises_naming(d / "model.safetensors", "safetensors", call=lambda: load_head(d, target))


# ---------------------------------------------------------------------------------------------
# Config fields the heads cannot compute: refused, naming the field (and for norm_output, whose
# meaning depends on the format, the format).


@pytest.mark.parametrize("act", ["tanh", "quick_gelu", "gelu_10"])
def test_refuses_unknown_hidden_act(act, tmp_path, target):
    cfg, t = eagle3_checkpoint(27)
    d = write(tmp_path, {**cfg, "hidden_act": act}, t)
    _raises_naming(d / "config.json", "hidden_act", repr(act), call=lambda: load_head(d, target))
    cfg, t = speculators_checkpoint(27, norm_before_residual=False, hidden_act=act)
    d = write(tmp_path / "speculators", cfg, t)
    _raises_naming(d / "config.json", "hidden_act", repr(act), call=lambda: load_head(d, target))


def _speculators_with(edit) -> tuple[dict, dict]:
    cfg, t = speculators_checkpoint(28, norm_before_residual=False)
    edit(cfg)
    return cfg, t


@pytest.mark.parametrize("edit,words", [
    (lambda c: c.pop("norm_before_residual"), ("norm_before_residual",)),
    (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), ("transformer_layer_config.model_type",
                                                                          "qwen3")),
    (lambda c: c["transformer_layer_config"].update(num_hidden_layers=2), ("transformer_layer_config.num_hidden_layers",
                                                                           "2")),
    (lambda c: c.update(speculators_model_type="eagle"), ("speculators_model_type", "'eagle'")),
    (lambda c: c["speculators_config"].update(algorithm="eagle"), ("speculators_config.algorithm",)),
    (lambda c: c.pop("transformer_layer_config"), ("transformer_layer_config",)),
    (lambda c: c.update(norm_output="yes"), ("norm_output", "speculators format", "'yes'")),
    (lambda c: c.update(fc_norm=True), ("fc_norm",)),
    (lambda c: c.update(norm_before_fc=True), ("norm_before_fc",)),
])
def test_refuses_speculators_configs_it_cannot_compute(edit, words, tmp_path, target):
    cfg, t = _speculators_with(edit)
    d = write(tmp_path, cfg, t)
    e = _raises_naming(d / "config.json", *words, call=lambda: load_head(d, target))
    assert isinstance(e, CheckpointError)


def test_refuses_flat_config_naming_the_speculators_architecture(tmp_path, target):
    """An `Eagle3Speculator` config is the speculators format: without its nested decoder config
    its `norm_output` could mean either thing."""
    cfg, t = eagle3_checkpoint(29)
    d = write(tmp_path, {**cfg, "architectures": ["Eagle3Speculator"]}, t)
    _raises_naming(d / "config.json", "speculators_model_type", call=lambda: load_head(d, target))


@pytest.mark.parametrize("fields,words", [
    ({"norm_output": 0}, ("norm_output", "SpecForge format", "0")),
    ({"fc_norm": True}, ("fc_norm",)),
    ({"norm_before_fc": True}, ("norm_before_fc",)),
    ({"norm_before_residual": "true"}, ("norm_before_residual",)),
])
def test_refuses_flat_eagle3_fields_it_cannot_compute(fields, words, tmp_path, target):
    cfg, t = eagle3_checkpoint(30)
    d = write(tmp_path, {**cfg, **fields}, t)
    _raises_naming(d / "config.json", *words, call=lambda: load_head(d, target))


@pytest.mark.parametrize("fields,words", [
    ({"norm_output": True}, ("norm_output=true", "SpecForge format", "EAGLE-1")),
    ({"norm_before_residual": True}, ("norm_before_residual", "EAGLE-1")),
])
def test_refuses_eagle3_options_on_an_eagle1_head(fields, words, tmp_path, target):
    cfg, t = eagle1_checkpoint(31, fc_bias=True)
    d = write(tmp_path, {**cfg, **fields}, t)
    _raises_naming(d / "config.json", *words, call=lambda: load_head(d, target))
