"""Test-session settings.

The demo models are tiny: their ops are too small to gain from intra-op threads, and on a
2-core machine OpenMP threads spin-waiting on busy cores made the suite up to 20x slower.
"""

import pytest
import torch

torch.set_num_threads(1)

# Helper modules whose assertions are tests' checks: rewritten like test modules, so a failure
# shows the values compared. Registered here, before any test module imports them.
pytest.register_assert_rewrite("tests.drafter.tree_oracle", "tests.router.link_harness", "tests.verifier.accept_law")


@pytest.fixture
def loop_bounds_patch():
    """Triton 3.6's interpreter turns a runtime loop bound into an int with `int(array of shape
    (1,))`, which numpy >= 2.4 refuses; triton-lang/triton#9171 squeezes first. Applied per test
    (tests/interpreter.py)."""
    from triton.runtime import interpreter as interp

    original = interp._patch_lang_tensor

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interp._patch_lang_tensor = patched
    yield
    interp._patch_lang_tensor = original
