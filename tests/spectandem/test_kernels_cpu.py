"""spectandem.kernels through Triton's interpreter on the CPU: the same kernel-vs-reference and
batch-invariance checks as tests/gpu/test_kernels.py, at smaller sizes.

Runs where Triton is installed and the interpreter is on from the start of the session
(tests/conftest.py turns it on without a GPU; the README's test command and CI install triton);
otherwise the whole module is skipped, saying why. The interpreter executes each program in numpy:
it checks the kernels' logic, their masks, indexing and reduction order, not GPU numerics or speed,
which tests/gpu/test_kernels.py covers on the GPU machine.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed (it is no dependency of spectandem; the README's "
                                     "test command installs it)")
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
    check_packed_causal_matches_reference,
    check_paired_tiles_equal_single,
)

DTYPES = [torch.float32, torch.bfloat16]
DTYPE_IDS = ["fp32", "bf16"]
# The attention kernel against its reference in fp32 and fp16: the interpreter casts fp32 to bf16
# by truncation (the GPU rounds), which puts its bf16 error past the GPU's tolerance. Its bitwise
# batch invariance holds in every dtype (bf16 tl.dot through tests/conftest.py's mend).
ATTENTION_DTYPES = [torch.float32, torch.float16]
ATTENTION_DTYPE_IDS = ["fp32", "fp16"]


# Every test here runs a kernel through the interpreter, with its mends (tests/conftest.py).
pytestmark = pytest.mark.usefixtures("interpreter_patches")


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("num_tokens", [1, 5, 16])
@pytest.mark.parametrize("heads", [(4, 2, 32), (2, 2, 16)], ids=["gqa2-32", "mha-16"])
@pytest.mark.parametrize("tree", [True, False], ids=["tree", "causal"])
def test_attention_matches_reference(dtype, num_tokens, heads, tree):
    check_attention_matches_reference("cpu", dtype, num_tokens, *heads, max_prefix=70, tree=tree, seed=0)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
def test_attention_matches_paged_cache(dtype):
    check_attention_matches_paged_cache("cpu", dtype, seed=0)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES + [torch.bfloat16], ids=ATTENTION_DTYPE_IDS + ["bf16"])
def test_paired_tiles_equal_single(dtype, monkeypatch):
    check_paired_tiles_equal_single("cpu", dtype, monkeypatch, seed=4)


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES + [torch.bfloat16], ids=ATTENTION_DTYPE_IDS + ["bf16"])
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


@pytest.mark.parametrize("dtype", ATTENTION_DTYPES, ids=ATTENTION_DTYPE_IDS)
@pytest.mark.parametrize("lens", [(1,), (40, 3, 70)], ids=["1", "40-3-70"])
def test_packed_causal_matches_reference(dtype, lens):
    check_packed_causal_matches_reference("cpu", dtype, list(lens), 4, 2, 32, seed=len(lens))
