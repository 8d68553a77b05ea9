"""spectandem.kernels through Triton's interpreter on the CPU: the same kernel-vs-reference and
batch-invariance checks as tests/gpu/test_kernels.py, at smaller sizes.

Runs only where Triton is installed and the interpreter is on from the start of the session:

    TRITON_INTERPRET=1 python -m pytest -q tests/spectandem/test_kernels_cpu.py -p no:cacheprovider

Otherwise the whole module is skipped, saying why. CI installs no Triton, so there it is always
skipped and counts as covering nothing: the kernels are covered by tests/gpu/test_kernels.py on the
GPU machine; this module is a developer's quick check of kernel logic without a GPU (the
interpreter executes each program in numpy, so it says nothing about GPU numerics or speed).
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is no dependency of spectandem; CI has none)")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("set TRITON_INTERPRET=1 before the session starts to run the Triton kernels on the CPU",
                allow_module_level=True)

from tests.gpu.test_kernels import (  # noqa: E402  (after the skips: the helpers import spectandem.kernels)
    check_accept_matches_reference,
    check_accept_tie_rule,
    check_attention_batch_invariance,
    check_attention_matches_paged_cache,
    check_attention_matches_reference,
    check_compact_matches_paged_cache,
    check_compact_random_overlaps,
)

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# Triton 3.6's interpreter multiplies bf16 tiles as raw bit patterns in `tl.dot` (bf16 is not
# supported there: triton-lang/triton#11584), so the attention kernel's 16-bit path runs in fp16 here;
# bf16 attention is covered on the GPU only. The other kernels only copy bf16 values and run in bf16.
ATTENTION_DTYPES = [torch.float32, torch.float16]
ATTENTION_DTYPE_IDS = ["fp32", "fp16"]


# Every test here runs a kernel whose loop bound is a runtime value: the interpreter's patch for
# it (tests/conftest.py `loop_bounds_patch`) applies to each.
pytestmark = pytest.mark.usefixtures("loop_bounds_patch")


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("heads", [(4, 2, 32), (2, 2, 16)], ids=["gqa2-32", "mha-16"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "causal"])
def test_attention_matches_reference(dtype, num_tokens, heads, tree):
    check_attention_matches_reference("cpu", dtype, num_tokens, *heads, max_prefix=70, tree=tree, seed=0)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
def test_attention_matches_paged_cache(dtype):
    check_attention_matches_paged_cache("cpu", dtype, seed=0)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
def test_attention_batch_invariance(dtype):
    check_attention_batch_invariance("cpu", dtype, 4, 2, 32, seed=1)


@pytest.mark.parametrize("batch,num_nodes", [(1, 1), (4, 5), (6, 16), (2, 37)])
def test_accept_matches_verify_greedy(batch, num_nodes):
    for seed in range(3):
        check_accept_matches_reference("cpu", batch, num_nodes, seed)


def test_accept_tie_rule():
    check_accept_tie_rule("cpu")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compact_matches_paged_cache(dtype):
    check_compact_matches_paged_cache("cpu", dtype, seed=0)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_compact_random_overlaps(dtype):
    check_compact_random_overlaps("cpu", dtype, seed=0)
