"""spectandem/devices.py on the GPU (run with `python -m pytest -m gpu tests/gpu/test_devices_gpu.py`):
`to_host` returns what `.cpu()` returns for several tensors after one wait, None kept; and
`to_device_all` gives what per-tensor copies give, with the host tensors' one copy split into
rows of the right lengths (zero-length rows included), a dtype cast, and a mixed list (a device
tensor among host ones) falling back to per-tensor copies."""

from __future__ import annotations

import pytest
import torch

from spectandem.devices import to_device_all, to_host

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def test_to_host_equals_cpu() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 1000, device="cuda", generator=g)
    b = torch.randint(0, 9, (3, 5), device="cuda", generator=g)
    later = a * 2            # queued work: to_host must wait for it
    host = to_host(a, None, b, later, torch.ones(2))
    assert host[1] is None and all(t.device.type == "cpu" for i, t in enumerate(host) if i != 1)
    assert torch.equal(host[0], a.cpu()) and torch.equal(host[2], b.cpu()) and torch.equal(host[3], later.cpu())
    assert torch.equal(host[4], torch.ones(2))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_to_device_all_equals_per_tensor_copies(dtype) -> None:
    g = torch.Generator().manual_seed(1)
    rows = [torch.randn(n, 16, generator=g) for n in (3, 0, 1, 7)]
    got = to_device_all(rows, "cuda", dtype)
    want = [r.to("cuda", dtype or r.dtype) for r in rows]
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(t.device.type == "cuda" and t.dtype == w.dtype and torch.equal(t, w) for t, w in zip(got, want))
    mixed = [rows[0], rows[2].cuda()]
    assert all(torch.equal(t, w.cuda()) for t, w in zip(to_device_all(mixed, "cuda"), [rows[0], rows[2]]))
