"""How the router runs rounds: the pipeline mode, and whether speculation is worth it now.

`ModeChooser`: "sequential" (draft, verify, extend per round), "pingpong" (two micro-batches,
the drafter working on one while the verifier verifies the other) or "plain" (no drafts for
requests whose tokens a plain round does not change). In "auto", with enough requests for two
micro-batches, it measures all three (committed tokens per second over a window of rounds each)
and keeps the fastest for a while: ping-pong wins when drafter and verifier have devices of their
own and loses when they share the same cores (benchmarks/serving.py); plain wins at large batches
where verifying trees costs more than it saves (spectandem bench on the H200, batch 64).

`SpeculationSwitch`: when drafts are almost never accepted, drafting only costs time; the router
then decodes plainly for a number of rounds and tries again.
"""

from __future__ import annotations

import logging

log = logging.getLogger("spectandem.router")


class ModeChooser:
    def __init__(self, cfg):
        self.cfg = cfg
        self.mode: str | None = None
        self.phase: str | None = None    # "measure" or "keep"
        self.left = 0                    # rounds left in the current phase
        self.rates: dict[str, float] = {}
        self._acc: dict[str, tuple[int, float]] = {}

    def choose(self, num_running: int, drafter_up: bool) -> str:
        usable = drafter_up and num_running >= 2
        if self.cfg.pipeline != "auto":
            return "pingpong" if self.cfg.pipeline == "pingpong" and usable else "sequential"
        if not usable or num_running < 2 * self.cfg.pingpong_min_batch:
            return "sequential"
        if self.left > 0:
            return self.mode
        if self.mode is None or self.phase == "keep":             # start measuring: sequential first
            self.mode, self.phase, self.left, self.rates = "sequential", "measure", self.cfg.mode_window, {}
        elif self.mode == "sequential" and "pingpong" not in self.rates:
            self.mode, self.left = "pingpong", self.cfg.mode_window
        elif self.mode == "pingpong" and "plain" not in self.rates:
            self.mode, self.left = "plain", self.cfg.mode_window
        else:                                                     # all measured: keep the fastest
            self.mode = max(self.rates, key=self.rates.get)
            self.phase, self.left = "keep", self.cfg.mode_window * 8
            log.info("pipeline mode %s (committed tokens/s: %s)", self.mode,
                     {k: round(v, 1) for k, v in self.rates.items()})
        return self.mode

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        if self.mode != mode or self.left <= 0:
            return
        self.left -= 1
        if self.phase == "measure":
            t, sec = self._acc.get(mode, (0, 0.0))
            self._acc[mode] = (t + tokens, sec + seconds)
            if self.left == 0:
                t, sec = self._acc.pop(mode)
                self.rates[mode] = t / sec if sec > 0 else 0.0


class SpeculationSwitch:
    def __init__(self, cfg):
        self.cfg = cfg
        self._recent: list[int] = []     # accepted drafts of recent drafted request-rounds
        self._off_until = 0              # round number until which speculation is off

    def observe(self, num_accepted: int, round_number: int) -> None:
        w = self.cfg.adaptive_window
        if not w:
            return
        self._recent.append(num_accepted)
        if len(self._recent) >= w:
            mean_len = 1 + sum(self._recent) / len(self._recent)
            self._recent.clear()
            if mean_len < self.cfg.adaptive_min_accept_length:
                self._off_until = round_number + self.cfg.adaptive_off_rounds
                log.info("mean acceptance length %.2f < %.2f: speculation off for %d rounds", mean_len,
                         self.cfg.adaptive_min_accept_length, self.cfg.adaptive_off_rounds)

    def off(self, round_number: int) -> bool:
        return round_number < self._off_until
