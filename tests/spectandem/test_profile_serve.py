"""benchmarks/profile_serve.py's idle line: the time no engine call is in progress, split by the
innermost router step running then; its engine calls and timers; and the stack sampler of the
engine processes (benchmarks/engine_sampler, `--sample-engines`)."""

import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.profile_serve import ROOT, Timeline, calls_report, idle_report


def test_idle_time_goes_to_the_innermost_step_running_then():
    t = Timeline()
    # Engine calls cover [0, 10] and [14, 20] ms; [10, 14] and [20, 25] are idle.
    t.calls = [("verifier.verify", 0.000, 0.010), ("drafter.draft", 0.014, 0.020)]
    # _round spans all; _apply [10, 12] inside it; _release [21, 23] inside it; [23, 25] outside every step.
    t.steps = [("_round", 0.0, 0.023), ("_apply", 0.010, 0.012), ("_release", 0.021, 0.023)]
    report = idle_report(t, 0.0, 0.025, top=5)
    lines = report.splitlines()
    assert lines[0].startswith("  idle (no engine call) 36.0% of the wall: 2 gaps of 1 ms or more, 9 ms in all, "
                               "the longest 5.0 ms"), lines[0]
    shares = {line.split()[-1]: float(line.split()[0].rstrip("%")) for line in lines[1:]}
    # apply 2 ms, round 2 (12-14) + 1 (20-21) ms, release 2 ms, outside every step 2 ms; of 25 ms.
    assert shares == {"apply": 8.0, "round": 12.0, "release": 8.0, "steps": 8.0}, shares
    assert "between steps" in report


def test_no_idle_time_when_the_calls_cover_the_run():
    t = Timeline()
    t.calls = [("verifier.verify", 0.0, 0.006), ("drafter.draft", 0.005, 0.010)]   # overlapping calls
    t.steps = [("_round", 0.0, 0.010)]
    assert idle_report(t, 0.0, 0.010, top=3).splitlines()[0].startswith(
        "  idle (no engine call) 0.0% of the wall: 0 gaps of 1 ms or more, 0 ms in all")


def test_engine_calls_are_counted_and_timed_by_kind():
    t = Timeline()
    t.calls = [("verifier.verify", 0.0, 0.010), ("verifier.verify", 0.012, 0.016), ("verifier.verify", 0.020, 0.026),
               ("drafter.draft", 0.010, 0.012)]
    assert calls_report(t) == ("  engine calls: verifier.verify 3 x 6.67 ms (p50 6.00), "
                               "drafter.draft 1 x 2.00 ms (p50 2.00)")


def test_timers_wrap_methods_and_the_names_that_imported_a_function():
    import torch

    import drafter.engine as engine
    import spectandem.devices as devices
    from benchmarks.profile_router import Timers

    original = devices.to_host
    timers = Timers(("spectandem.devices:to_host", "drafter.engine:DrafterEngine.flush_deferred"))
    try:
        assert engine.to_host is devices.to_host is not original   # the importer's name too
        engine.to_host(torch.zeros(2))           # off: not counted
        timers.on = True
        engine.to_host(torch.zeros(2))
        devices.to_host(torch.zeros(2))
        assert timers.calls["to_host"] == 2
        assert "to_host" in timers.table(2)
    finally:
        timers.restore()
    assert engine.to_host is devices.to_host is original


def _sampled_process(tmp_path, script: str) -> tuple[subprocess.Popen, Path]:
    """A process started from `script` (a path under tmp_path) with the engine sampler on its
    PYTHONPATH, as profile_serve --sample-engines starts serve's engines -> (it, its folder)."""
    path = tmp_path / script
    path.parent.mkdir(parents=True)
    path.write_text("import time\n\ndef busy():\n    t = time.monotonic()\n    while time.monotonic() - t < 6:\n"
                    "        sum(range(1000))\n\nbusy()\n")
    folder = tmp_path / f"samples-{path.parent.name}"
    folder.mkdir()
    hooks = str(ROOT / "benchmarks" / "engine_sampler")
    env = {**os.environ, "SPECTANDEM_ENGINE_SAMPLES": str(folder),
           "PYTHONPATH": os.pathsep.join([hooks] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.Popen([sys.executable, str(path)], env=env), folder


def test_engine_sampler_writes_an_engine_process_s_stacks_while_marked(tmp_path):
    """benchmarks/engine_sampler in a process run as a drafter's (drafter/__main__.py): the samples
    taken while the folder's "on" file existed, written when it went, name the function the process
    was busy in; a process that is no engine's (the negative control) writes nothing."""
    engine, folder = _sampled_process(tmp_path, "drafter/__main__.py")
    other, other_folder = _sampled_process(tmp_path, "tool/main.py")
    try:
        time.sleep(1.5)   # the sampler looks at the command line after a second
        for f in (folder, other_folder):
            (f / "on").touch()
        time.sleep(1.0)
        for f in (folder, other_folder):
            (f / "on").unlink()
        deadline = time.monotonic() + 5
        while not list(folder.glob("drafter-*.txt")) and time.monotonic() < deadline:
            time.sleep(0.1)
        written = list(folder.glob("drafter-*.txt"))
        assert len(written) == 1, list(folder.iterdir())
        text = written[0].read_text()
        samples = int(text.splitlines()[0].split()[1])
        assert samples > 10, text   # about one a millisecond for a second; a loaded machine gives fewer
        assert "thread MainThread:" in text and "drafter/__main__.py:busy:" in text, text
        assert list(other_folder.iterdir()) == []
    finally:
        for p in (engine, other):
            p.kill()
            p.wait()
