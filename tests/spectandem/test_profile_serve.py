"""benchmarks/profile_serve.py's idle line: the time no engine call is in progress, split by the
innermost router step running then; its engine calls and timers; and the stack sampler of the
engine processes (benchmarks/engine_sampler, `--sample-engines`); the engines' recorded calls
(`--engine-timeline`) and the round timeline read from them."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.profile_serve import ROOT, Timeline, calls_report, idle_report, round_timeline_report


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


BUSY = ("import time\n\ndef busy():\n    t = time.monotonic()\n    while time.monotonic() - t < 6:\n"
        "        sum(range(1000))\n\nbusy()\n")
# Times a "verify" call and its "verify.engine" part every 10 ms on a CallClock, for 6 s.
CLOCKED = ("import time\nfrom spectandem.call_clock import CallClock\n\nclock = CallClock()\n"
           "t = time.monotonic()\nwhile time.monotonic() - t < 6:\n    with clock.timing('verify'):\n"
           "        with clock.timing('verify.engine'):\n            time.sleep(0.004)\n        time.sleep(0.001)\n"
           "    time.sleep(0.005)\n")


def _sampled_process(tmp_path, script: str, body: str = BUSY, var: str = "SPECTANDEM_ENGINE_SAMPLES",
                     ) -> tuple[subprocess.Popen, Path]:
    """A process started from `script` (a path under tmp_path, running `body`) with the engine
    sampler on its PYTHONPATH and `var` naming its folder, as profile_serve --sample-engines
    (--engine-timeline) starts serve's engines -> (it, its folder)."""
    path = tmp_path / script
    path.parent.mkdir(parents=True)
    path.write_text(body)
    folder = tmp_path / f"samples-{path.parent.name}"
    folder.mkdir()
    hooks = str(ROOT / "benchmarks" / "engine_sampler")
    env = {**os.environ, var: str(folder),
           "PYTHONPATH": os.pathsep.join([hooks, str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}
    return subprocess.Popen([sys.executable, str(path)], env=env), folder


def _mark_once(*folders: Path) -> tuple[float, float]:
    """A measured run as profile_serve marks it in each folder: "on" for a second, after the
    processes' watchers had a second to look at their command lines -> (on, off) on this clock."""
    time.sleep(1.5)
    for f in folders:
        (f / "on").touch()
    t_on = time.perf_counter()
    time.sleep(1.0)
    for f in folders:
        (f / "on").unlink()
    return t_on, time.perf_counter()


def _written(folder: Path, pattern: str, wait_s: float = 5.0) -> list[Path]:
    """The files matching `pattern` once one is there (or `wait_s` ran out)."""
    deadline = time.monotonic() + wait_s
    while not list(folder.glob(pattern)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return list(folder.glob(pattern))


def test_engine_sampler_writes_an_engine_process_s_stacks_while_marked(tmp_path):
    """benchmarks/engine_sampler in a process run as a drafter's (drafter/__main__.py): the samples
    taken while the folder's "on" file existed, written when it went, name the function the process
    was busy in; a process that is no engine's (the negative control) writes nothing."""
    engine, folder = _sampled_process(tmp_path, "drafter/__main__.py")
    other, other_folder = _sampled_process(tmp_path, "tool/main.py")
    try:
        _mark_once(folder, other_folder)
        written = _written(folder, "drafter-*.txt")
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


def test_engine_timeline_records_the_clock_s_calls_while_marked(tmp_path):
    """SPECTANDEM_ENGINE_TIMELINE in a process run as a verifier's: the calls its CallClock timed
    while "on" existed, with their parts, written when it went, each inside the marked window on
    the host's clock; a process that is no engine's (the negative control) writes nothing."""
    engine, folder = _sampled_process(tmp_path, "verifier/__main__.py", CLOCKED, "SPECTANDEM_ENGINE_TIMELINE")
    other, other_folder = _sampled_process(tmp_path, "tool/main.py", CLOCKED, "SPECTANDEM_ENGINE_TIMELINE")
    try:
        t_on, t_off = _mark_once(folder, other_folder)
        written = _written(folder, "timeline-verifier-*.json")
        assert len(written) == 1, list(folder.iterdir())
        events = json.loads(written[0].read_text())
        calls = [e for e in events if e[0] == "verify"]
        parts = [e for e in events if e[0] == "verify.engine"]
        assert len(calls) > 10 and abs(len(calls) - len(parts)) <= 1, events[:5]   # one part a call
        for _, t0, t1 in events:   # on this process's clock too, within the window (the recorder polls every 20 ms)
            assert t_on - 0.05 <= t0 < t1 <= t_off + 0.05
        for _, t0, t1 in calls:
            assert 0.004 < t1 - t0 < 0.5
        assert list(other_folder.iterdir()) == []
    finally:
        for p in (engine, other):
            p.kill()
            p.wait()


def _round(at: float, tree_wait_ms: float) -> list:
    """The engines' events of one sequential round whose forward ends at `at` + 10 ms (times in
    seconds): a verify call [at, at + 11 ms] with its tree wait and forward, the drafter's work on
    the verdict, its draft call and post; the verdicts sent from 0.25 ms after the forward."""
    ms = 1e-3
    start = at + 0.5 * ms
    wait_end = start + tree_wait_ms * ms
    return [("verify", at, at + 11 * ms), ("verify.tree_wait", start, wait_end),
            ("verify.engine", wait_end, at + 10 * ms), ("verify.verdicts", at + 10.25 * ms, at + 10.5 * ms),
            ("draft_next", at + 10.5 * ms, at + 13 * ms), ("draft_next.post", at + 12.6 * ms, at + 12.8 * ms),
            ("draft", at + 13.5 * ms, at + 14 * ms), ("draft.post", at + 13.8 * ms, at + 14 * ms)]


def test_round_timeline_times_each_hand_off_from_the_last_forward():
    ms = 1e-3
    events, steps = [], []
    # Rounds every 15 ms. The next call starts 12.5 ms after the previous forward's end: its tree
    # wait lasts until 14.5 ms (1.5 ms wait after the 0.5 ms decode of a call starting at 15 + 0.5).
    # The third round's draft call took the early trees: it posts none.
    for k in range(4):
        at = k * 15 * ms
        events += [e for e in _round(at, 1.5 if k else 2.0) if not (k == 2 and e[0] == "draft.post")]
        events.append(("verify.queue", at + 0.1 * ms, at + 0.12 * ms))   # a handler takes the call up
        steps += [("_draft_call", at - 3 * ms, at - 2 * ms), ("_verify", at - 2.5 * ms, at + 11.5 * ms),
                  ("_verify_send", at - 2.4 * ms, at - 2.3 * ms)]
    report = round_timeline_report(sorted(events, key=lambda e: e[1]), steps)
    lines = report.splitlines()
    assert lines[0].startswith("  round timeline, 3 of 3 rounds"), report
    legs_at = next(i for i, line in enumerate(lines) if line.startswith("  each round's legs"))

    def parsed(block):
        return {line[25:].strip(): (float(line[:11]), float(line[11:19]), int(line[19:25])) for line in block}

    got = parsed(lines[1:legs_at])
    expected = {"the verifier starts sending the verdicts (verify.verdicts)": 0.25, "the verifier replies (its call ends)": 1.0, "the drafter starts on the verdict (draft_next)": 0.5,
                "the router has the reply (_verify ends)": 1.5, "the router sends the draft call (_draft_call)": 2.0,
                "the router sends the next verify (_verify)": 2.5,
                "its gRPC call goes out (VerifierStub.Verify)": 2.6,
                "a handler thread of the verifier takes up the next verify (verify.queue)": 5.1,
                "the drafter has posted the next trees early (draft_next.post)": 2.8,
                "the drafter is done with the verdict": 3.0,
                "the drafter starts the draft call": 3.5, "the drafter has posted the trees (draft.post)": 4.0,
                "the verifier starts the next verify": 5.0, "the trees are in (verify.tree_wait ends)": 7.0,
                "the next forward starts (verify.engine)": 7.0}
    assert {k: v[0] for k, v in got.items()} == expected, report
    assert {k: v[2] for k, v in got.items()} == {k: 2 if "draft.post" in k else 3 for k in expected}, report
    # The same rounds' legs, each from its two marks within one round; the verify started before the
    # early post in none of them (it waited 2 ms for the trees after starting at 5 ms).
    legs = parsed(lines[legs_at + 1:-1])
    assert {k.split(" (")[0]: round(v[0], 6) for k, v in legs.items()} == {
        "the verdicts to the drafter": 0.25, "the drafter on the verdict": 2.3, "the reply to the router": 0.5,
        "the router's turn": 1.0, "the gRPC leg": 2.5, "the trees taken": 2.0}, report
    assert all(v[2] == 3 for v in legs.values()), report
    assert lines[-1] == "  the drafter's early post came after the next verify started in 0 of 3 rounds", report
    # Without the drafter's events (a plain server) the rounds count, without the drafter's marks.
    plain = round_timeline_report([e for e in events if not e[0].startswith("draft")], steps)
    assert plain.splitlines()[0].startswith("  round timeline, 3 of 3 rounds") and "drafter" not in plain, plain
    # Without the verifier's calls (in-process engines) none does.
    assert "no round" in round_timeline_report([e for e in events if e[0] == "verify.engine"], steps)


def test_engine_cprofile_writes_a_table_while_marked(tmp_path):
    """SPECTANDEM_ENGINE_CPROFILE in a process run as a drafter's: a cProfile table of the marked
    window, written when "on" went. From Python 3.12 it holds the busy main thread's function;
    before, it says that only the watcher thread was seen. A process that is no engine's (the
    negative control) writes nothing."""
    engine, folder = _sampled_process(tmp_path, "drafter/__main__.py", var="SPECTANDEM_ENGINE_CPROFILE")
    other, other_folder = _sampled_process(tmp_path, "tool/main.py", var="SPECTANDEM_ENGINE_CPROFILE")
    try:
        _mark_once(folder, other_folder)
        written = _written(folder, "cprofile-drafter-*.txt")
        assert len(written) == 1, list(folder.iterdir())
        text = written[0].read_text()
        assert "Ordered by: internal time" in text and "Ordered by: cumulative time" in text, text
        if sys.version_info >= (3, 12):
            assert "(busy)" in text, text
        else:
            assert "saw this watcher thread only" in text, text
        assert list(other_folder.iterdir()) == []
    finally:
        for p in (engine, other):
            p.kill()
            p.wait()
