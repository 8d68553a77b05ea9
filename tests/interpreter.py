"""Triton kernels on the CPU: through Triton's interpreter, which tests/conftest.py turns on
(TRITON_INTERPRET=1, before triton is imported) on a machine without a GPU. The README's test
command and CI install triton for it; where it is missing these tests are skipped, saying why. The
GPU tests (tests/gpu/) run the same kernels on the device. The interpreter's mends (a loop bound,
`tl.dot` a row at a time) are the `interpreter_patches` fixture of tests/conftest.py."""

import os

import pytest

from spectandem.kernels import HAVE_TRITON

_skip = pytest.mark.skipif(
    not HAVE_TRITON or os.environ.get("TRITON_INTERPRET") != "1",
    reason="the kernels run on the CPU only in Triton's interpreter: install triton (pip install triton==3.6.0); "
           "tests/conftest.py sets TRITON_INTERPRET=1 where there is no GPU")
_patched = pytest.mark.usefixtures("interpreter_patches")


def interpreter(test):
    """A test of Triton kernels on the CPU: skipped unless the interpreter is on, run with its
    mends (tests/conftest.py `interpreter_patches`)."""
    return _skip(_patched(test))


needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason="the _triton wrappers need the triton package")
