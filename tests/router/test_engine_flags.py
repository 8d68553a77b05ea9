"""Every command line `spectandem serve --backend grpc` builds for its engine processes is
accepted by the engines' own parsers (`python -m verifier`, `python -m drafter`) and gives them
the values serve was given."""

from __future__ import annotations

import argparse
import itertools

import pytest

from router.serve import engine_commands, feature_channel
from spectandem.cli import build_parser
from spectandem.generate_cli import spec_from_flags
from spectandem.service_args import add_drafter_args, add_verifier_args

GPU = [[], ["--cuda-graphs"], ["--batch-invariant"], ["--triton-attention"], ["--cuda-graphs", "--batch-invariant"],
       ["--cuda-graphs", "--triton-attention"]]
METHODS = [["--method", "eagle3"], ["--method", "eagle"], ["--method", "ngram"], ["--method", "none"],
           ["--method", "draft-model"]]
SIZES = [[], ["--max-len", "256", "--kv-blocks", "40", "--draft-kv-blocks", "30", "--block-size", "8"]]
OTHER = [[], ["--device", "cuda", "--dtype", "bfloat16", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
              "--ahead-width", "0", "--draft-sampling-min-temperature", "0.3", "--max-running", "12"],
         ["--feature-channel"], ["--no-feature-channel"], ["--feature-channel", "tcp://127.0.0.1:5999"]]


def _parser(add):
    p = argparse.ArgumentParser()
    add(p)
    return p


def _tls_files(tmp_path):
    files = []
    for name in ("ca.pem", "c.pem", "c.key"):
        (tmp_path / name).write_text("x")
        files.append(str(tmp_path / name))
    return ["--internal-tls-ca", files[0], "--internal-tls-cert", files[1], "--internal-tls-key", files[2]]


@pytest.mark.parametrize("tls", [False, True])
def test_every_engine_command_line_serve_builds_parses(tmp_path, tls):
    verifier_p, drafter_p = _parser(add_verifier_args), _parser(add_drafter_args)
    extra_tls = _tls_files(tmp_path) if tls else []
    checked = 0
    for gpu, method, sizes, other in itertools.product(GPU, METHODS, SIZES, OTHER):
        argv = ["serve", "--backend", "grpc", *gpu, *method, *sizes, *other, *extra_tls]
        args = build_parser().parse_args(argv)
        cfg, target, draft = spec_from_flags(args)
        channel = "tcp://127.0.0.1:5999" if feature_channel(args) and cfg.method != "none" else None
        cmds = engine_commands(args, cfg, target, draft, 7001, 7002, channel)
        assert set(cmds) == ({"verifier"} if cfg.method == "none" else {"verifier", "drafter"}), argv
        for role, cmd in cmds.items():
            assert cmd[1:3] == ["-m", role]
            parser = verifier_p if role == "verifier" else drafter_p
            try:
                got = parser.parse_args(cmd[3:])
            except SystemExit:
                pytest.fail(f"python -m {role} refuses the command line serve builds for {argv}: {cmd[3:]}")
            assert got.port == (7001 if role == "verifier" else 7002) and got.host == "127.0.0.1"
            for flag in ("cuda_graphs", "batch_invariant", "triton_attention", "device", "dtype", "max_len",
                         "block_size", "method"):
                assert getattr(got, flag) == getattr(args, flag), (role, flag, argv)
            assert got.max_slots == args.max_running and got.target == target and got.draft == draft
            assert got.feature_channel == channel
            assert (got.tls_cert is not None) == tls
            if role == "verifier":
                assert got.kv_blocks == args.kv_blocks
            else:
                assert got.draft_kv_blocks == args.draft_kv_blocks
                assert (got.num_steps, got.topk, got.num_draft_tokens, got.ahead_width,
                        got.draft_sampling_min_temperature) == (cfg.num_steps, cfg.topk, cfg.num_draft_tokens,
                                                                cfg.ahead_width, cfg.draft_sampling_min_temperature)
            checked += 1
    assert checked > 300


def test_feature_channel_is_on_by_default_where_serve_starts_both_engines():
    def resolved(*argv):
        return feature_channel(build_parser().parse_args(["serve", *argv]))

    assert resolved() == resolved("--backend", "grpc") == resolved("--backend", "ray") == "auto"
    assert resolved("--backend", "grpc", "--feature-channel") == "auto"
    assert resolved("--backend", "grpc", "--feature-channel", "tcp://10.0.0.2:29500") == "tcp://10.0.0.2:29500"
    for off in (["--no-feature-channel"], ["--feature-channel", "off"]):
        assert resolved("--backend", "grpc", *off) is None and resolved("--backend", "ray", *off) is None
    assert resolved("--backend", "local") is None
    assert resolved("--backend", "grpc", "--verifier-address", "h:1") is None
    assert resolved("--backend", "grpc", "--drafter-address", "h:2") is None
