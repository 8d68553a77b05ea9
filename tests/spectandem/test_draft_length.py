"""The tree serve drafts by default: the depth a draft head's config.json states (speculators'
`speculators_config.proposal_methods[0].speculative_tokens`, which vLLM serves such a head with),
else 4; chains verify depth + 1 nodes (SGLang's rule for --topk 1); the flags over both."""

from __future__ import annotations

import json

import pytest

from spectandem.checkpoint import CheckpointError, declared_draft_length, read_config
from spectandem.cli import build_parser
from spectandem.config import DEFAULT_NUM_STEPS, EngineConfig, SpecConfig
from spectandem.demo import demo_paths
from spectandem.service_args import spec_from_flags


def _tree(cfg) -> tuple[int, int]:
    return cfg.num_steps, cfg.num_draft_tokens


def _stating(value) -> dict:
    return {"speculators_config": {"proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": value}]}}


def _head_dir(tmp_path, config: dict):
    tmp_path.mkdir(parents=True, exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"], **config}))
    return str(tmp_path)


def test_declared_draft_length_reads_the_speculators_field():
    assert declared_draft_length(_stating(7)) == 7
    assert declared_draft_length({}) is None
    assert declared_draft_length({"speculators_config": {"algorithm": "eagle3"}}) is None
    assert declared_draft_length({"speculators_config": {"proposal_methods": [{"proposal_type": "greedy"}]}}) is None


@pytest.mark.parametrize("value", [0, -2, "5", 2.5, True])
def test_declared_draft_length_refuses_what_is_no_positive_integer(value):
    with pytest.raises(CheckpointError, match=r"head/config.json: speculators_config.proposal_methods\[0\]"
                                              r".speculative_tokens must be an integer >= 1"):
        declared_draft_length(_stating(value), "head/config.json")


def test_declared_draft_length_refuses_proposal_methods_that_are_no_list_of_objects():
    with pytest.raises(CheckpointError, match="speculators_config.proposal_methods must be a list of objects"):
        declared_draft_length({"speculators_config": {"proposal_methods": ["greedy"]}})


def test_tree_defaults_follow_the_head_then_the_fallback(tmp_path):
    stating, silent = _head_dir(tmp_path / "a", _stating(6)), _head_dir(tmp_path / "b", {})
    assert _tree(SpecConfig(method="eagle3").for_draft(stating)) == (6, 7)
    assert _tree(SpecConfig(method="eagle").for_draft(stating)) == (6, 7)
    assert _tree(SpecConfig(method="eagle3").for_draft(silent)) == (DEFAULT_NUM_STEPS, DEFAULT_NUM_STEPS + 1)
    # Methods without an EAGLE head never read one; a draft model's config is no head's.
    assert _tree(SpecConfig(method="draft-model").for_draft(stating)) == (DEFAULT_NUM_STEPS, DEFAULT_NUM_STEPS + 1)
    assert _tree(SpecConfig(method="ngram").for_draft(None)) == (DEFAULT_NUM_STEPS, DEFAULT_NUM_STEPS + 1)
    # The flags win; the node count follows the depth for chains, is 2 for fused, 5 for wider trees.
    assert _tree(SpecConfig(method="eagle3", num_steps=3).for_draft(stating)) == (3, 4)
    assert _tree(SpecConfig(method="eagle3", num_draft_tokens=4).for_draft(stating)) == (6, 4)
    assert _tree(SpecConfig(method="eagle3", fused=True).for_draft(stating)) == (6, 2)
    assert _tree(SpecConfig(method="eagle3", topk=2).for_draft(stating)) == (6, 5)


def test_a_bad_stated_length_is_refused_at_start_unless_the_flag_decides(tmp_path):
    head = _head_dir(tmp_path, _stating(0))
    with pytest.raises(CheckpointError, match="speculative_tokens must be an integer >= 1"):
        _tree(SpecConfig(method="eagle3").for_draft(head))
    assert _tree(SpecConfig(method="eagle3", num_steps=4).for_draft(head)) == (4, 5)


def test_serve_flags_take_the_demo_heads_stated_length():
    """The demo EAGLE-3 head states 5 draft tokens (the depth that served it fastest on the 2-core
    CPU; benchmarks/results/draft-length-cpu-2core.txt); the EAGLE-1 head states none."""
    parser = build_parser()
    stated = declared_draft_length(read_config(demo_paths("eagle3")[1]))
    assert stated == 5
    cfg, _, draft = spec_from_flags(parser.parse_args(["serve"]))
    assert (cfg.method, cfg.num_steps, cfg.num_draft_tokens, cfg.max_draft_nodes) == ("eagle3", 5, 6, 5)
    assert draft == str(demo_paths("eagle3")[1])
    cfg, _, _ = spec_from_flags(parser.parse_args(["serve", "--num-steps", "3"]))
    assert (cfg.num_steps, cfg.num_draft_tokens) == (3, 4)
    cfg, _, _ = spec_from_flags(parser.parse_args(["serve", "--method", "eagle"]))
    assert (cfg.num_steps, cfg.num_draft_tokens) == (DEFAULT_NUM_STEPS, DEFAULT_NUM_STEPS + 1)
    cfg, _, _ = spec_from_flags(parser.parse_args(["serve", "--fused", "--num-steps", "1"]))
    assert (cfg.num_steps, cfg.num_draft_tokens, cfg.fused) == (1, 2, True)


@pytest.mark.parametrize("flags, named", [
    (["--num-steps", "3"], "--num-steps"),
    (["--num-draft-tokens", "4"], "--num-draft-tokens"),
    (["--topk", "2"], "--topk"),
    (["--fused"], "--fused"),
    (["--draft", "head"], "--draft"),
    (["--num-steps", "3", "--fused"], "--num-steps, --fused"),
])
@pytest.mark.parametrize("command", ["serve", "generate"])
def test_method_none_refuses_the_draft_flags(command, flags, named):
    """Plain decoding drafts nothing: a draft flag given with it is refused, naming the flag."""
    extra = ["hi"] if command == "generate" else []
    args = build_parser().parse_args([command, *extra, "--method", "none", *flags])
    with pytest.raises(ValueError, match=f"^{named}: --method none decodes plainly"):
        spec_from_flags(args)


def test_method_none_without_draft_flags_is_plain():
    for command, extra in (("serve", []), ("generate", ["hi"])):
        cfg, target, draft = spec_from_flags(build_parser().parse_args([command, *extra, "--method", "none"]))
        assert cfg.method == "none" and draft is None and cfg.max_draft_nodes == 0
        assert target == str(demo_paths("none")[0])


def test_the_python_api_drafts_as_deep_as_serve():
    """An engine built in Python (EngineConfig, which LocalSpeculator builds too) takes the depth the
    head states where the SpecConfig gives none, as serve does; a given depth stays."""
    target, head = (str(p) for p in demo_paths("eagle3"))
    served, _, _ = spec_from_flags(build_parser().parse_args(["serve"]))
    built = EngineConfig(target_dir=target, draft_dir=head, spec=SpecConfig(method="eagle3")).spec
    assert _tree(built) == _tree(served) == (5, 6)
    assert built == served
    kept = EngineConfig(target_dir=target, draft_dir=head, spec=SpecConfig(method="eagle3", num_steps=3)).spec
    assert _tree(kept) == (3, 4)
    # Without a head to read, the fallback; the nodes follow the depth, fused verifies 2.
    assert _tree(SpecConfig()) == (DEFAULT_NUM_STEPS, DEFAULT_NUM_STEPS + 1)
    assert _tree(SpecConfig(fused=True)) == (DEFAULT_NUM_STEPS, 2)
    assert _tree(SpecConfig(topk=3)) == (DEFAULT_NUM_STEPS, 5)


def test_local_speculator_drafts_the_heads_stated_depth():
    from router.local import LocalSpeculator

    spec = LocalSpeculator(*demo_paths("eagle3"), SpecConfig(method="eagle3"), max_slots=2, max_len=128)
    assert _tree(spec.cfg) == (5, 6)
