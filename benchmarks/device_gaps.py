"""`benchmarks/profile_router.py --device-gaps`: where the verifier's GPU waits, read from the
device's own clock with no profiler attached.

Timing events go on the verifier's stream around every verify step's graph replay (inside
`VerifyGraphs.run`, after its inputs are copied) and around every prefill
(`VerifierEngine.prefill`), and one more when the batch ends. Replays inside a prefill (the graphed prefill runs the verify step's graph) are part of the
prefill, not steps.

The report: the idle gap on the device before such a step (the previous step's end to
this one's start: host work and waits the GPU did not hide) and the step's own time, then the
batch's first round (the prefill's end to the first step: the drafter's prefill and first draft)
and tail (the last step's end to the batch's end on the host), against the whole window; the
ratio is the window less the prefills over the steps at their median time (1.0: the GPU never
waited after the prefill). A graphed prefill replays the verify step's graph: that replay is
part of the prefill, not a step.
"""

from __future__ import annotations

import threading

import torch

STEP = "verify"   # every step the router called (the report's one row of steps)


class DeviceGaps:
    """Patches the verifier's step and prefill while `on`; `report()` after the batch synced."""

    def __init__(self, device: torch.device):
        from verifier.engine import VerifierEngine
        from verifier.graphs import VerifyGraphs

        self.device, self.on = torch.device(device), False
        self.steps: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []
        self.prefills: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.end: torch.cuda.Event | None = None
        self._patched = []
        gaps, local = self, threading.local()

        def run(inner):
            def timed(*args, **kwargs):
                local.tag = STEP if gaps.on and not getattr(local, "prefill", False) else None
                try:
                    return inner(*args, **kwargs)
                finally:
                    local.tag = None
            return timed

        def replay(inner):
            def timed(graph, *args, **kwargs):
                tag = getattr(local, "tag", None)
                if tag is None:
                    return inner(graph, *args, **kwargs)
                e0 = gaps._record()
                try:
                    return inner(graph, *args, **kwargs)
                finally:
                    gaps.steps.append((tag, e0, gaps._record()))
            return timed

        def prefill(inner):
            def timed(*args, **kwargs):
                if not gaps.on:
                    return inner(*args, **kwargs)
                e0, local.prefill = gaps._record(), True
                try:
                    return inner(*args, **kwargs)
                finally:
                    local.prefill = False
                    gaps.prefills.append((e0, gaps._record()))
            return timed

        for owner, name, wrap in ((VerifyGraphs, "run", run), (torch.cuda.CUDAGraph, "replay", replay),
                                  (VerifierEngine, "prefill", prefill)):
            inner = getattr(owner, name)
            setattr(owner, name, wrap(inner))
            self._patched.append((owner, name, inner))

    def _record(self) -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record(torch.cuda.current_stream(self.device))
        return e

    def finish(self) -> None:
        """The batch's end, as the host saw it (call right after the batch returns)."""
        self.end = self._record()

    def restore(self) -> None:
        for owner, name, inner in reversed(self._patched):
            setattr(owner, name, inner)

    def report(self) -> str:
        torch.cuda.synchronize(self.device)
        if not self.steps:
            return "   (no verify step timed)"
        rows, by_tag = [], {}
        for (_, _, prev_end), (tag, start, end) in zip(self.steps, self.steps[1:]):
            gap, step = prev_end.elapsed_time(start), start.elapsed_time(end)
            by_tag.setdefault(tag, []).append((gap, step))
        first_tag, first_start, first_end = self.steps[0]
        window_start = self.prefills[0][0] if self.prefills else first_start
        window = window_start.elapsed_time(self.end)
        head = self.prefills[-1][1].elapsed_time(first_start) if self.prefills else 0.0
        prefill = sum(a.elapsed_time(b) for a, b in self.prefills)
        tail = self.steps[-1][2].elapsed_time(self.end)
        steps = [s.elapsed_time(e) for _, s, e in self.steps]
        q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]
        rows.append(f"   window {window:.2f} ms (first prefill start -> batch end): prefill {prefill:.2f}, "
                    f"first round {head:.2f} (prefill end -> first step, a {first_tag} step), "
                    f"steps {sum(steps):.2f} ({len(steps)}), gaps between steps "
                    f"{sum(g for v in by_tag.values() for g, _ in v):.2f}, tail {tail:.2f}")
        rows.append(f"   {'before a step launched by':26s} {'count':>5s} {'gap sum':>8s} {'gap med':>8s} "
                    f"{'p25':>6s} {'p75':>6s} {'max':>6s} {'step med':>9s}")
        for tag, v in sorted(by_tag.items()):
            gaps, st = [g for g, _ in v], [s for _, s in v]
            rows.append(f"   {tag:26s} {len(v):5d} {sum(gaps):8.2f} {q(gaps, .5):8.3f} {q(gaps, .25):6.3f} "
                        f"{q(gaps, .75):6.3f} {max(gaps):6.3f} {q(st, .5):9.3f}")
        med = q(steps, .5)
        rows.append(f"   (window - prefill) / (steps x their median {med:.3f} ms): {(window - prefill) / (len(steps) * med):.3f}")
        return "\n".join(rows)
