"""Test-session settings.

The demo models are tiny: their ops are too small to gain from intra-op threads, and on a
2-core machine OpenMP threads spin-waiting on busy cores made the suite up to 20x slower.
"""

import os

import pytest
import torch

torch.set_num_threads(1)

# Without a GPU, the Triton kernels run through Triton's interpreter (tests/interpreter.py), which
# is chosen when triton is first imported: here, before any test module imports it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tests start local Ray clusters as `spectandem serve` does, with its GCS start-up wait (serve
# sets it in its entry point; a 2-core machine under load needs it).
os.environ.setdefault("RAY_gcs_server_port_wait_time_s", "120")

# Helper modules whose assertions are tests' checks: rewritten like test modules, so a failure
# shows the values compared. Registered here, before any test module imports them.
pytest.register_assert_rewrite("tests.drafter.tree_oracle", "tests.router.link_harness", "tests.verifier.accept_law")


# The CPU suite runs on this many pytest-xdist workers (pyproject's addopts: `-n auto --dist
# loadgroup`); a run of single files stays in one process, where a worker would only add its start,
# and so do GPU runs (`-m gpu`: one device).
SUITE_WORKERS = 2


def pytest_xdist_auto_num_workers(config) -> int:
    """Workers for `-n auto`: SUITE_WORKERS for the CPU tests of directories, 0 for files or GPU runs."""
    paths = [str(a).split("::")[0] for a in config.args]
    if config.getoption("markexpr") != "not gpu" or (paths and all(p.endswith(".py") for p in paths)):
        return 0
    return SUITE_WORKERS


@pytest.hookimpl(tryfirst=True)   # before xdist's own hook, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    """Under `--dist loadgroup` each test module is one unit of work (its module fixtures, such
    as served routers, start once), less its tests that name an `xdist_group` of their own: the
    tests of one group run one after another in one worker.

    The modules holding tests of the "ray" group (tests/router/conftest.py RAY_CLUSTERS, local Ray
    clusters, about 30% of the suite's time in one unit) go first: units go out to the workers in
    collection order, and a long unit handed out late would leave one worker running it alone at
    the end."""
    def file_of(item) -> str:
        return item.nodeid.split("::")[0]

    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(file_of(item)))
    ray_files = {file_of(item) for item in items if item.get_closest_marker("xdist_group").args[:1] == ("ray",)}
    items.sort(key=lambda item: file_of(item) not in ray_files)   # stable


@pytest.fixture
def interpreter_patches():
    """Two mends to Triton 3.6's interpreter, applied per test (tests/interpreter.py):

    - a runtime loop bound becomes an int through `int(array of shape (1,))`, which numpy >= 2.4
      refuses; triton-lang/triton#9171 squeezes first;
    - `tl.dot` is one numpy matmul of the whole tile, and numpy's BLAS rounds a row differently
      by where it sits in the tile (rows 6-15 of a 16-row tile differ in the last bit from the
      same row alone), where the GPU's tensor cores accumulate every row the same way. Our
      batch-invariance checks compare a row in a tile with that row alone, so here each output
      row is its own product. bf16 tiles, which the interpreter multiplies as raw bit patterns
      (triton-lang/triton#11584), are widened to fp32 first: exact, as the GPU's products are.
    """
    import numpy as np
    from triton.runtime import interpreter as interp

    original_patch, original_dot = interp._patch_lang_tensor, interp.InterpreterBuilder.create_dot

    def patched(tensor, scope):
        original_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    def widened(handle):
        if handle.dtype.scalar.is_bf16():   # stored as the raw 16 bits
            return (handle.data.astype(np.uint32) << 16).view(np.float32)
        return handle.data

    def dot_by_rows(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8:   # fp8: the interpreter's own
            return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        a_data, b_data, acc = widened(a), widened(b), d.data
        out = np.empty_like(acc)
        for i in range(a_data.shape[-2]):
            out[..., i: i + 1, :] = np.matmul(a_data[..., i: i + 1, :], b_data, dtype=acc.dtype)
        return interp.TensorHandle(out + acc, d.dtype.scalar)

    interp._patch_lang_tensor = patched
    interp.InterpreterBuilder.create_dot = dot_by_rows
    yield
    interp._patch_lang_tensor = original_patch
    interp.InterpreterBuilder.create_dot = original_dot
