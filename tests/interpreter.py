"""Triton kernels on the CPU: through Triton's interpreter (TRITON_INTERPRET=1 set before the
session starts). CI has no triton, so these tests are skipped there and count for nothing; the GPU
tests (tests/gpu/) run the same kernels on the device. The interpreter's loop-bound patch is the
`loop_bounds_patch` fixture of tests/conftest.py."""

import os

import pytest

from spectandem.kernels import HAVE_TRITON

interpreter = pytest.mark.skipif(
    not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernels run on the CPU only in Triton's interpreter: install triton and set TRITON_INTERPRET=1 "
           "before the session starts (CI has no triton; these checks count for nothing there)")
needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="the _triton wrappers need the triton package")
