"""Test-session settings.

The demo models are tiny: their ops are too small to gain from intra-op threads, and on a
2-core machine OpenMP threads spin-waiting on busy cores made the suite up to 20x slower.
"""

import torch

torch.set_num_threads(1)
