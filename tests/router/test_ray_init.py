"""router/links_ray.ray_init: a local cluster whose GCS never comes up is started once more."""

import pytest
import ray

from router import links_ray


def _fake_ray(monkeypatch, errors):
    calls = {"init": 0, "shutdown": 0}

    def init(**kwargs):
        calls["init"] += 1
        if errors:
            raise errors.pop(0)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.__setitem__("shutdown", calls["shutdown"] + 1))
    return calls


def test_gcs_timeout_starts_the_local_cluster_once_more(monkeypatch):
    calls = _fake_ray(monkeypatch, [RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")])
    links_ray.ray_init(None, num_cpus=2)
    assert calls == {"init": 2, "shutdown": 1}


def test_a_second_timeout_or_another_error_is_raised(monkeypatch):
    timeout = lambda: RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y")
    calls = _fake_ray(monkeypatch, [timeout(), timeout()])
    with pytest.raises(RuntimeError, match="Timed out waiting"):
        links_ray.ray_init(None)
    assert calls["init"] == 2
    calls = _fake_ray(monkeypatch, [RuntimeError("something else")])
    with pytest.raises(RuntimeError, match="something else"):
        links_ray.ray_init(None)
    assert calls == {"init": 1, "shutdown": 0}
