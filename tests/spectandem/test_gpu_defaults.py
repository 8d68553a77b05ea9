"""The `auto` model flags and the engines' placement (spectandem/config.py): --device, --dtype
and the GPU fast paths resolved for a platform (GPUs visible, Triton, native target), and where
each engine runs per backend. Pure functions: no GPU needed."""

from __future__ import annotations

import argparse

import pytest

from spectandem.config import (GpuPaths, Platform, engine_devices, resolve_device, resolve_dtype,
                               resolve_model_flags)
from spectandem.service_args import add_model_flags

CPU = Platform(gpus=0, triton=True)
ONE_GPU = Platform(gpus=1, triton=True)
NO_TRITON = Platform(gpus=1, triton=False)
HF_TARGET = Platform(gpus=2, triton=True, native=False)


def _flags(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_model_flags(p)
    return p.parse_args(list(argv))


def _resolved(platform: Platform, *argv: str) -> tuple[str, str, GpuPaths]:
    args = resolve_model_flags(_flags(*argv), platform)
    return args.device, args.dtype, GpuPaths.from_args(args)


def test_defaults_are_auto():
    args = _flags()
    assert (args.device, args.dtype, args.cuda_graphs, args.triton_attention, args.batch_invariant,
            args.enforce_eager, args.decode_ahead) == ("auto", "auto", None, None, False, False, None)


@pytest.mark.parametrize("device, gpus, want", [("auto", 0, "cpu"), ("auto", 1, "cuda"), ("auto", 4, "cuda"),
                                                ("cpu", 2, "cpu"), ("cuda", 1, "cuda"), ("cuda:1", 2, "cuda:1")])
def test_resolve_device(device, gpus, want):
    assert resolve_device(device, gpus) == want


@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused(device):
    with pytest.raises(ValueError, match=f"--device {device} needs a CUDA GPU"):
        resolve_device(device, 0)


@pytest.mark.parametrize("dtype, device, want", [("auto", "cpu", "float32"), ("auto", "cuda", "bfloat16"),
                                                 ("auto", "cuda:1", "bfloat16"), ("float16", "cuda", "float16"),
                                                 ("float64", "cpu", "float64"), ("float32", "cuda", "float32")])
def test_resolve_dtype(dtype, device, want):
    assert resolve_dtype(dtype, device) == want


# (platform, flags) -> (device, dtype, paths)
TABLE = [
    (CPU, [], ("cpu", "float32", GpuPaths())),
    (CPU, ["--no-cuda-graphs", "--no-triton-attention", "--enforce-eager"], ("cpu", "float32", GpuPaths())),
    (CPU, ["--dtype", "float64"], ("cpu", "float64", GpuPaths())),
    (ONE_GPU, [], ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, triton_attention=True, decode_ahead=True))),
    (ONE_GPU, ["--device", "cpu"], ("cpu", "float32", GpuPaths())),
    (ONE_GPU, ["--device", "cuda:0", "--dtype", "float16"],
     ("cuda:0", "float16", GpuPaths(cuda_graphs=True, triton_attention=True, decode_ahead=True))),
    (ONE_GPU, ["--no-cuda-graphs"], ("cuda", "bfloat16", GpuPaths(triton_attention=True, decode_ahead=True))),
    (ONE_GPU, ["--enforce-eager"], ("cuda", "bfloat16", GpuPaths(triton_attention=True, decode_ahead=True))),
    (ONE_GPU, ["--enforce-eager", "--no-cuda-graphs"],
     ("cuda", "bfloat16", GpuPaths(triton_attention=True, decode_ahead=True))),
    (ONE_GPU, ["--no-triton-attention"], ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, decode_ahead=True))),
    (ONE_GPU, ["--batch-invariant"],
     ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, batch_invariant=True, decode_ahead=True))),
    (ONE_GPU, ["--batch-invariant", "--enforce-eager"],
     ("cuda", "bfloat16", GpuPaths(batch_invariant=True, decode_ahead=True))),
    (ONE_GPU, ["--batch-invariant", "--no-triton-attention"],
     ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, batch_invariant=True, decode_ahead=True))),
    (NO_TRITON, [], ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, decode_ahead=True))),
    (NO_TRITON, ["--triton-attention"],
     ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, triton_attention=True, decode_ahead=True))),
    (ONE_GPU, ["--no-decode-ahead"], ("cuda", "bfloat16", GpuPaths(cuda_graphs=True, triton_attention=True))),
    (CPU, ["--decode-ahead"], ("cpu", "float32", GpuPaths(decode_ahead=True))),   # asked for: the CPU runs it too
    (HF_TARGET, [], ("cuda", "bfloat16", GpuPaths())),   # its runner decodes step by step: nothing to queue
    (HF_TARGET, ["--cuda-graphs"], ("cuda", "bfloat16", GpuPaths(cuda_graphs=True))),   # the runner refuses it
]


@pytest.mark.parametrize("platform, argv, want", TABLE)
def test_resolution_table(platform, argv, want):
    assert _resolved(platform, *argv) == want


@pytest.mark.parametrize("argv, message", [
    (["--cuda-graphs"], "--cuda-graphs need a CUDA device; got --device cpu"),
    (["--triton-attention"], "--triton-attention need a CUDA device"),
    (["--batch-invariant"], "--batch-invariant need a CUDA device"),
    (["--device", "cuda"], "--device cuda needs a CUDA GPU"),
    (["--dtype", "float64", "--device", "cpu", "--cuda-graphs"], "--cuda-graphs need a CUDA device"),
])
def test_gpu_paths_asked_for_on_the_cpu_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _resolved(CPU, *argv)


@pytest.mark.parametrize("argv, message", [
    (["--batch-invariant", "--triton-attention"], "choose one"),
    (["--enforce-eager", "--cuda-graphs"], "--enforce-eager and --cuda-graphs contradict"),
    (["--dtype", "float64"], "float64 runs on --device cpu only"),
])
def test_contradicting_flags_on_cuda_are_refused(argv, message):
    with pytest.raises(ValueError, match=message):
        _resolved(ONE_GPU, *argv)


def test_resolution_leaves_the_parsed_flags_alone():
    args = _flags()
    out = resolve_model_flags(args, ONE_GPU)
    assert (args.device, args.cuda_graphs) == ("auto", None) and (out.device, out.cuda_graphs) == ("cuda", True)
    assert resolve_model_flags(out, ONE_GPU).__dict__ == out.__dict__   # resolved flags stay as they are


@pytest.mark.parametrize("paths", [GpuPaths(), GpuPaths(cuda_graphs=True), GpuPaths(triton_attention=True),
                                   GpuPaths(cuda_graphs=True, triton_attention=True),
                                   GpuPaths(cuda_graphs=True, batch_invariant=True), GpuPaths(batch_invariant=True)])
def test_flags_round_trip(paths):
    assert _resolved(ONE_GPU, *paths.flags())[2] == paths


def test_describe():
    fast = GpuPaths(cuda_graphs=True, triton_attention=True)
    assert fast.describe("verifier") == "CUDA graphs, Triton attention" and fast.describe("drafter") == "CUDA graphs"
    invariant = GpuPaths(cuda_graphs=True, batch_invariant=True)   # the target runs eagerly with it
    assert invariant.describe("verifier") == "batch-invariant kernels" and invariant.describe("drafter") == "CUDA graphs"
    assert GpuPaths().describe("verifier") == GpuPaths().describe("drafter") == "eager"


@pytest.mark.parametrize("device, gpus, backend, want", [
    ("cpu", 0, "local", ("cpu", "cpu")), ("cpu", 0, "grpc", ("cpu", "cpu")), ("cpu", 0, "ray", ("cpu", "cpu")),
    ("cpu", 2, "grpc", ("cpu", "cpu")),
    ("cuda", 1, "local", ("cuda:0", "cuda:0")), ("cuda", 1, "grpc", ("cuda:0", "cuda:0")),
    ("cuda", 2, "local", ("cuda:0", "cuda:1")), ("cuda", 2, "grpc", ("cuda:0", "cuda:1")),
    ("cuda", 4, "grpc", ("cuda:0", "cuda:1")),
    ("cuda", 1, "ray", ("cuda", "cuda")), ("cuda", 2, "ray", ("cuda", "cuda")),   # Ray picks each actor's GPU
    ("cuda:1", 2, "grpc", ("cuda:1", "cuda:1")), ("cuda:0", 2, "local", ("cuda:0", "cuda:0")),
])
def test_engine_devices(device, gpus, backend, want):
    assert engine_devices(device, gpus, backend) == want


def test_drafter_device_given():
    assert engine_devices("cuda", 2, "local", "cuda:0") == ("cuda:0", "cuda:0")
    assert engine_devices("cuda:1", 2, "grpc", "cuda:0") == ("cuda:1", "cuda:0")
    with pytest.raises(ValueError, match="--drafter-device is for --backend local and grpc"):
        engine_devices("cuda", 2, "ray", "cuda:1")
    with pytest.raises(ValueError, match="give --device cuda"):
        engine_devices("cuda:1", 2, "ray")


def test_drafter_device_is_resolved_with_the_device():
    args = _flags()
    args.drafter_device = "cuda:1"
    assert resolve_model_flags(args, Platform(gpus=2)).drafter_device == "cuda:1"
    with pytest.raises(ValueError, match="must both be CUDA or both be the CPU"):
        args.device = "cpu"
        resolve_model_flags(args, Platform(gpus=2))


def test_decode_ahead_reaches_engine_processes():
    """--decode-ahead, on or off, is handed explicitly to the engine processes serve starts."""
    on, off = GpuPaths.from_args(_flags("--decode-ahead")), GpuPaths.from_args(_flags())
    assert on.decode_ahead and "--decode-ahead" in on.flags()
    assert not off.decode_ahead and "--no-decode-ahead" in off.flags()
    assert GpuPaths.from_args(_flags(*off.flags())) == off
    assert GpuPaths.from_args(_flags(*on.flags())) == on
