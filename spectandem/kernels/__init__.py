"""Triton GPU kernels for the verifier's hot path, each beside the torch reference it must match.

    attention.py   tree-masked attention over the paged KV cache (batch-invariant)
    prefill_attention.py   causal attention of prompts packed back to back (a packed prefill)
    accept.py      greedy acceptance over draft trees, one program per request
    compact.py     KV compaction of the accepted path, all layers in one launch

Triton is not a dependency of spectandem. Every module imports it under a guard and every public
function has three forms: `<name>_triton` (the kernel behind a validating wrapper; needs Triton),
`<name>_ref` (plain torch, any device) and `<name>` (the kernel for CUDA tensors when Triton is
installed, the reference otherwise). On a CPU the kernels run under Triton's interpreter
(`TRITON_INTERPRET=1` set before Triton is imported), which is how tests/spectandem checks them.
"""

try:
    import triton  # probed here (and `interpreted`); the kernel modules import what they use

    HAVE_TRITON = True
except ImportError:
    HAVE_TRITON = False


def interpreted(kernel) -> bool:
    """Whether a `triton.jit` kernel runs under Triton's interpreter (numpy, CPU tensors): with
    TRITON_INTERPRET=1 set before Triton was imported, `triton.jit` makes InterpretedFunctions.
    Only with HAVE_TRITON."""
    return not isinstance(kernel, triton.runtime.JITFunction)

from spectandem.kernels.accept import GreedyAcceptance, greedy_accept, greedy_accept_ref, greedy_accept_triton
from spectandem.kernels.attention import (
    paged_tree_attention,
    paged_tree_attention_ref,
    paged_tree_attention_triton,
)
from spectandem.kernels.compact import compact_rows, compact_rows_ref, compact_rows_triton

__all__ = [
    "HAVE_TRITON",
    "GreedyAcceptance",
    "compact_rows",
    "compact_rows_ref",
    "compact_rows_triton",
    "greedy_accept",
    "greedy_accept_ref",
    "greedy_accept_triton",
    "paged_tree_attention",
    "paged_tree_attention_ref",
    "paged_tree_attention_triton",
]
