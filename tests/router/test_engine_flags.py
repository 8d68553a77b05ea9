"""Every command line `spectandem serve --backend grpc` builds for its engine processes is
accepted by the engines' own parsers (`python -m verifier`, `python -m drafter`), carries every
model flag explicitly (no `auto`, no unset GPU path), and resolves in the engine to the settings
serve resolved: device per role, dtype, GPU fast paths. Parse only: no model loads."""

from __future__ import annotations

import argparse
import itertools

import pytest

from router.serve import engine_commands, feature_channel, resolve_serve_flags
from spectandem.cli import build_parser
from spectandem.config import GpuPaths, Platform, resolve_model_flags
from spectandem.service_args import spec_from_flags
from spectandem.service_args import add_drafter_args, add_verifier_args

GPU = [[], ["--cuda-graphs"], ["--no-cuda-graphs"], ["--enforce-eager"], ["--batch-invariant"],
       ["--triton-attention"], ["--no-triton-attention"], ["--cuda-graphs", "--batch-invariant"],
       ["--cuda-graphs", "--triton-attention"], ["--batch-invariant", "--no-cuda-graphs"],
       ["--enforce-eager", "--no-triton-attention"]]
METHODS = [["--method", "eagle3"], ["--method", "eagle"], ["--method", "ngram"], ["--method", "none"],
           ["--method", "draft-model"]]
SIZES = [[], ["--max-len", "256", "--kv-blocks", "40", "--draft-kv-blocks", "30", "--block-size", "8"],
         ["--cpu-kv-cache-gib", "0.25"]]
OTHER = [[], ["--device", "cuda", "--dtype", "bfloat16", "--num-steps", "3", "--topk", "2", "--num-draft-tokens", "6",
              "--ahead-width", "0", "--draft-sampling-min-temperature", "0.3", "--max-running", "12"],
         ["--device", "cpu", "--dtype", "float64", "--engine-threads", "3"], ["--device", "cuda:0", "--drafter-device", "cuda:0"],
         ["--feature-channel"], ["--no-feature-channel"], ["--feature-channel", "tcp://127.0.0.1:5999"]]
PLATFORMS = [Platform(gpus=0, triton=True), Platform(gpus=1, triton=True), Platform(gpus=2, triton=False),
             Platform(gpus=4, triton=True, native=False)]


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
    verifier_p, drafter_p, serve_p = _parser(add_verifier_args), _parser(add_drafter_args), build_parser()
    extra_tls = _tls_files(tmp_path) if tls else []
    checked = refused = 0
    for gpu, method, sizes, other, platform in itertools.product(GPU, METHODS, SIZES, OTHER, PLATFORMS):
        argv = ["serve", "--backend", "grpc", *gpu, *method, *sizes, *other, *extra_tls]
        raw = serve_p.parse_args(argv)
        try:
            cfg, target, draft = spec_from_flags(raw)
            args = resolve_serve_flags(raw, platform)
        except ValueError:   # a GPU path or device asked for where there is no GPU, contradicting ones, or
            refused += 1     # tree flags with --method none
            continue
        serve_paths = GpuPaths.from_args(args)
        channel = "tcp://127.0.0.1:5999" if feature_channel(args) and cfg.method != "none" else None
        cmds = engine_commands(args, cfg, target, draft, 7001, 7002, channel, args.engine_devices)
        assert set(cmds) == ({"verifier"} if cfg.method == "none" else {"verifier", "drafter"}), argv
        for role, cmd in cmds.items():
            assert cmd[1:3] == ["-m", role]
            assert "auto" not in cmd[3:], (role, cmd)
            assert ("--cuda-graphs" in cmd) != ("--no-cuda-graphs" in cmd), cmd
            assert ("--triton-attention" in cmd) != ("--no-triton-attention" in cmd), cmd
            parser = verifier_p if role == "verifier" else drafter_p
            try:
                got = parser.parse_args(cmd[3:])
            except SystemExit:
                pytest.fail(f"python -m {role} refuses the command line serve builds for {argv}: {cmd[3:]}")
            assert got.port == (7001 if role == "verifier" else 7002) and got.host == "127.0.0.1"
            # The engine resolves its flags on the same machine: nothing is left for it to choose.
            engine = resolve_model_flags(got, platform)
            assert engine.device == args.engine_devices[0 if role == "verifier" else 1], (role, argv, platform)
            assert engine.dtype == args.dtype, (role, argv, platform)
            assert GpuPaths.from_args(engine) == serve_paths, (role, argv, platform)
            for flag in ("max_len", "block_size", "method"):
                assert getattr(got, flag) == getattr(args, flag), (role, flag, argv)
            # Both engines know the tree: the verifier captures the graphs of its widths at start.
            shape = (got.num_steps, got.topk, got.num_draft_tokens)
            assert shape == ((cfg.num_steps, cfg.topk, cfg.num_draft_tokens) if cfg.method != "none"
                             else (None, 1, None)), (role, argv)
            assert got.max_slots == args.max_running and got.target == target and got.draft == draft
            assert got.feature_channel == channel
            assert got.threads == args.engine_threads
            assert got.cpu_kv_cache_gib == args.cpu_kv_cache_gib
            assert (got.tls_cert is not None) == tls
            if role == "verifier":
                assert got.kv_blocks == args.kv_blocks
            else:
                assert got.draft_kv_blocks == args.draft_kv_blocks
                assert (got.num_steps, got.topk, got.num_draft_tokens, got.ahead_width,
                        got.draft_sampling_min_temperature) == (cfg.num_steps, cfg.topk, cfg.num_draft_tokens,
                                                                cfg.ahead_width, cfg.draft_sampling_min_temperature)
            checked += 1
    assert checked > 1000 and refused > 100


def test_engine_command_lines_need_resolved_flags():
    raw = build_parser().parse_args(["serve", "--backend", "grpc"])
    cfg, target, draft = spec_from_flags(raw)
    with pytest.raises(ValueError, match="--device, --dtype, --cuda-graphs, --triton-attention not resolved"):
        engine_commands(raw, cfg, target, draft, 7001, 7002)


@pytest.mark.parametrize("gpus, devices", [(1, ("cuda:0", "cuda:0")), (2, ("cuda:0", "cuda:1")),
                                           (4, ("cuda:0", "cuda:1"))])
def test_engines_serve_starts_get_their_gpu(gpus, devices):
    """One GPU: both engine processes on cuda:0; two or more: the drafter on cuda:1. Defaults on
    CUDA: bfloat16, CUDA graphs and Triton attention, passed explicitly."""
    raw = build_parser().parse_args(["serve", "--backend", "grpc"])
    cfg, target, draft = spec_from_flags(raw)
    args = resolve_serve_flags(raw, Platform(gpus=gpus, triton=True))
    cmds = engine_commands(args, cfg, target, draft, 7001, 7002, None, args.engine_devices)
    for role, device in zip(("verifier", "drafter"), devices):
        cmd = cmds[role]
        assert cmd[cmd.index("--device") + 1] == device
        assert cmd[cmd.index("--dtype") + 1] == "bfloat16"
        assert "--cuda-graphs" in cmd and "--triton-attention" in cmd and "--batch-invariant" not in cmd


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


def test_engine_call_timeout_is_each_split_backends_deadline_and_refused_in_process():
    from router.links import GRPC_CALL_TIMEOUT_S, RAY_CALL_TIMEOUT_S
    from router.serve import engine_call_timeout_s

    parse = build_parser().parse_args
    assert engine_call_timeout_s(parse(["serve", "--backend", "grpc"])) == GRPC_CALL_TIMEOUT_S
    assert engine_call_timeout_s(parse(["serve", "--backend", "ray"])) == RAY_CALL_TIMEOUT_S
    assert engine_call_timeout_s(parse(["serve", "--backend", "local"])) == GRPC_CALL_TIMEOUT_S   # unused there
    for backend in ("grpc", "ray"):
        assert engine_call_timeout_s(parse(["serve", "--backend", backend, "--engine-call-timeout", "2.5"])) == 2.5
    with pytest.raises(ValueError, match="--engine-call-timeout applies to --backend grpc and ray"):
        engine_call_timeout_s(parse(["serve", "--backend", "local", "--engine-call-timeout", "5"]))
    for bad in ("0", "-1", "inf", "nan"):
        with pytest.raises(ValueError, match="--engine-call-timeout must be a number of seconds > 0"):
            engine_call_timeout_s(parse(["serve", "--backend", "grpc", "--engine-call-timeout", bad]))


def test_vllm_flag_names_are_the_same_settings():
    parse = build_parser().parse_args
    args = parse(["serve", "--max-num-seqs", "12", "--max-model-len", "512"])
    assert args.max_running == 12 and args.max_len == 512
    assert parse(["serve", "--max-running", "12", "--max-len", "512"]).max_running == 12
    for role_args in (add_verifier_args, add_drafter_args):
        p = argparse.ArgumentParser()
        role_args(p)
        assert p.parse_args(["--max-model-len", "300"]).max_len == 300


@pytest.mark.parametrize("flags, nodes", [([], 5), (["--num-steps", "7"], 7), (["--num-steps", "3", "--num-draft-tokens", "3"], 2)])
def test_a_verifier_process_warms_up_for_the_tree_it_is_told(flags, nodes):
    """`python -m verifier` takes the drafter's tree flags (serve passes them on) and builds the
    tree its graphs are captured for from them, the depth the head states where none is given:
    the draft nodes a round of the drafter started beside it verifies."""
    from spectandem.config import EngineConfig
    from spectandem.demo import demo_paths
    from verifier.service import verifier_spec

    target, head = (str(p) for p in demo_paths("eagle3"))
    args = _parser(add_verifier_args).parse_args(["--target", target, "--draft", head, *flags])
    spec = EngineConfig(target_dir=target, draft_dir=head, spec=verifier_spec(args)).spec
    drafted, _, _ = spec_from_flags(build_parser().parse_args(["serve", *flags]))
    assert spec.max_draft_nodes == drafted.max_draft_nodes == nodes


def test_a_verifier_process_for_plain_decoding_refuses_tree_flags():
    from verifier.service import run_verifier

    args = _parser(add_verifier_args).parse_args(["--method", "none", "--num-steps", "3"])
    with pytest.raises(ValueError, match="^--num-steps: --method none decodes plainly"):
        run_verifier(args)
