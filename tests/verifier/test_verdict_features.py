"""The verdicts' features: each request's accepted path's rows, as views of one gathered tensor
(verifier/engine.py `_path_views`), equal to slicing the tensor request by request."""

from __future__ import annotations

import pytest
import torch

from verifier.engine import _path_views


@pytest.mark.parametrize("lens", [[1, 5, 3], [5, 5], [1], [2, 1, 1, 4]])
def test_path_views_equal_per_request_slices(lens):
    g = torch.Generator().manual_seed(sum(lens))
    picked = torch.randn(len(lens) + 1, 5, 7, generator=g)   # one row more than requests (padding)
    tokens = [list(range(n)) for n in lens]
    views = _path_views(picked[: len(tokens)], tokens)
    assert len(views) == len(lens)
    for b, (v, n) in enumerate(zip(views, lens)):
        assert v.shape == (n, 7) and torch.equal(v, picked[b, :n])
        assert v.data_ptr() == picked[b].data_ptr()   # a view, no copy
