"""What input checks say about a value they refuse, shared by every module that validates
tensors (the kernels, acceptance, sampling)."""

from __future__ import annotations

import torch


def describe(value: object) -> str:
    """"shape (2, 3) dtype torch.int64" for a tensor, else the value's type name."""
    if isinstance(value, torch.Tensor):
        return f"shape {tuple(value.shape)} dtype {value.dtype}"
    return type(value).__name__


def describe_placed(value: object) -> str:
    """`describe` and the tensor's device, for kernels that need a particular device."""
    if isinstance(value, torch.Tensor):
        return f"{describe(value)} device {value.device}"
    return type(value).__name__


def is_integer(value: object) -> bool:
    """A tensor of an integer dtype (not float, complex or bool)."""
    return isinstance(value, torch.Tensor) and not (
        value.dtype.is_floating_point or value.dtype.is_complex or value.dtype == torch.bool)
