"""Where serve's engines run: the Ray placement plan for 0/1/2/4 GPUs and one or two actors
(router/links_ray.py bundle_plan), and the start-up line that says where each engine runs, in
which dtype, with which fast paths (router/serve.py placement_line). Pure functions."""

from __future__ import annotations

import pytest

from router.links_ray import bundle_plan
from router.serve import placement_line, resolve_serve_flags
from spectandem.cli import build_parser
from spectandem.config import Platform
from spectandem.service_args import spec_from_flags


@pytest.mark.parametrize("gpus, actors, share", [(1, 1, 1), (1, 2, 0.5), (2, 1, 1), (2, 2, 1), (4, 1, 1),
                                                 (4, 2, 1)])
def test_bundles_on_gpus(gpus, actors, share):
    bundles, strategy = bundle_plan(gpus, actors, on_gpu=True)
    assert bundles == [{"GPU": share, "CPU": 1}] * actors and strategy == "STRICT_PACK"
    assert sum(b["GPU"] for b in bundles) <= gpus


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("actors", [1, 2])
def test_bundles_on_the_cpu(gpus, actors):
    assert bundle_plan(gpus, actors, on_gpu=False) == ([{"CPU": 1}] * actors, "PACK")


def test_gpu_bundles_without_a_gpu_are_refused():
    with pytest.raises(ValueError, match="needs a GPU; the cluster has none"):
        bundle_plan(0, 2, on_gpu=True)


def _line(argv, platform):
    raw = build_parser().parse_args(["serve", *argv])
    cfg, _, _ = spec_from_flags(raw)
    return placement_line(resolve_serve_flags(raw, platform), cfg)


@pytest.mark.parametrize("argv, platform, want", [
    (["--backend", "grpc"], Platform(gpus=0), "verifier on cpu (float32, eager); drafter on cpu (float32, eager)"),
    (["--backend", "grpc"], Platform(gpus=1, triton=True),
     "verifier on cuda:0 (bfloat16, CUDA graphs, Triton attention, decode ahead); drafter on cuda:0 (bfloat16, "
     "CUDA graphs)"),
    (["--backend", "local", "--enforce-eager"], Platform(gpus=2, triton=True),
     "verifier on cuda:0 (bfloat16, Triton attention, decode ahead); drafter on cuda:1 (bfloat16, eager)"),
    (["--backend", "ray", "--batch-invariant"], Platform(gpus=1, triton=True),
     "verifier on 0.5 of a shared GPU (bfloat16, batch-invariant kernels, decode ahead); drafter on 0.5 of a "
     "shared GPU "
     "(bfloat16, CUDA graphs)"),
    (["--backend", "ray", "--no-triton-attention"], Platform(gpus=2, triton=True),
     "verifier on a GPU of its own (bfloat16, CUDA graphs, decode ahead); drafter on a GPU of its own (bfloat16, "
     "CUDA graphs)"),
    (["--backend", "ray", "--method", "none"], Platform(gpus=1, triton=False),
     "verifier on a GPU of its own (bfloat16, CUDA graphs, decode ahead)"),
    (["--backend", "local", "--method", "none", "--no-decode-ahead"], Platform(gpus=1, triton=True),
     "verifier on cuda:0 (bfloat16, CUDA graphs, Triton attention)"),
])
def test_placement_line(argv, platform, want):
    assert _line(argv, platform) == want
