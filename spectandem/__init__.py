"""spectandem: lossless speculative decoding with the drafter and the verifier in separate processes.

The client SDK is importable from here (`from spectandem import Client, SamplingParams`). Names are
resolved on first use, so `import spectandem` stays cheap: no torch, no grpc until asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# public name -> the module that defines it
_EXPORTS = {
    "SamplingParams": "spectandem.config",
    **{name: "spectandem.client" for name in (
        "AlreadyExists", "AsyncClient", "Cancelled", "Chunk", "Client", "Completion", "DeadlineExceeded", "InternalError",
        "InvalidArgument", "ResourceExhausted", "SpectandemError", "Unauthenticated", "Unavailable")},
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from spectandem.client import (AlreadyExists, AsyncClient, Cancelled, Chunk, Client, Completion, DeadlineExceeded,
                                   InternalError, InvalidArgument, ResourceExhausted, SpectandemError,
                                   Unauthenticated, Unavailable)
    from spectandem.config import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'spectandem' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
