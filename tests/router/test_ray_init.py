"""router/links_ray.ray_init: a local cluster whose GCS never comes up is started once more; a
local cluster is given the CUDA GPUs this process sees."""

import pytest
import ray

from router import links_ray


def _fake_ray(monkeypatch, errors):
    calls = {"init": 0, "shutdown": 0}

    def init(**kwargs):
        calls["init"] += 1
        calls["kwargs"] = kwargs
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    return calls


def test_gcs_timeout_starts_the_local_cluster_once_more(monkeypatch):
    calls = _fake_ray(monkeypatch, [RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")])
    links_ray.ray_init(None, num_cpus=2)
    assert (calls["init"], calls["shutdown"]) == (2, 1)


def test_a_second_timeout_or_another_error_is_raised(monkeypatch):
    timeout = lambda: RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")
    calls = _fake_ray(monkeypatch, [timeout(), timeout()])
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        links_ray.ray_init(None)
    assert calls["init"] == 2
    calls = _fake_ray(monkeypatch, [RuntimeError("something else")])
    with pytest.raises(RuntimeError, match="something else"):
        links_ray.ray_init(None)
    assert (calls["init"], calls["shutdown"]) == (1, 0)


@pytest.mark.parametrize("visible", [0, 2])
def test_a_local_cluster_gets_the_gpus_this_process_sees(monkeypatch, visible):
    from spectandem import devices

    monkeypatch.setattr(devices, "cuda_gpus", lambda: visible)
    calls = _fake_ray(monkeypatch, [])
    links_ray.ray_init(None, num_cpus=2)
    assert calls["kwargs"]["num_gpus"] == (visible or None)   # none visible: Ray's own probe
    calls = _fake_ray(monkeypatch, [])
    links_ray.ray_init("auto")   # a cluster joined keeps its own resources
    assert calls["kwargs"] == {"address": "auto"}
