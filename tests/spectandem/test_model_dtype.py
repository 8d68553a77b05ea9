"""`--dtype` of serve, generate and the engine services (spectandem/service_args.py: model_dtype)."""

import argparse

import pytest
import torch

from spectandem.service_args import model_dtype


def test_float64_runs_on_the_cpu_only():
    assert model_dtype(argparse.Namespace(dtype="float64", device="cpu")) is torch.float64
    assert model_dtype(argparse.Namespace(dtype="bfloat16", device="cuda:1")) is torch.bfloat16
    with pytest.raises(ValueError, match="--dtype float64 runs on --device cpu only"):
        model_dtype(argparse.Namespace(dtype="float64", device="cuda"))
