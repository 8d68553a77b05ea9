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
