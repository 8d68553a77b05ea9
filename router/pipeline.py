"""How the router runs rounds: the pipeline mode, and whether speculation is worth it now.

`ModeChooser` picks how the next round runs:
- "sequential": draft, verify, extend;
- "ahead": the same, while the verifier verifies the drafter fills its outcome cache for the
  round's trees (drafter/engine.py), so a hit's next tree is ready when the verdict arrives
  (latency at small batch);
- "pingpong": two micro-batches, the drafter working on one while the verifier verifies the
  other (throughput);
- "short:N": sequential with trees at most N deep;
- "plain": no drafts.
"short:N" and "plain" only touch requests whose tokens do not depend on the tree (deterministic
drafts), and in "auto" so does "ahead" (a sampled request's tree decides its seeded tokens; the
choice must not depend on load). The others keep full drafts.

In "auto" the candidates depend on the batch: below 2 * pingpong_min_batch requests, sequential,
ahead and plain; from there, sequential, ping-pong, each short draft length and plain. It measures
each (committed tokens per second over a window of rounds, its first round left out) and keeps the fastest for a while,
then measures again; a change of candidates starts over. Ping-pong wins when drafter and
verifier have devices of their own and loses when they share cores (benchmarks/serving.py);
short drafts and plain win at large batches where verifying trees costs more than it saves.

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
        self.cands: tuple[str, ...] = ()
        self.phase: str | None = None    # "measure" or "keep"
        self.left = 0                    # rounds left in the current phase
        self.rates: dict[str, float] = {}
        self._acc: dict[str, tuple[int, float]] = {}

    def candidates(self, num_running: int) -> tuple[str, ...]:
        if num_running < 2 * self.cfg.pingpong_min_batch:
            return ("sequential", "ahead", "plain")
        return ("sequential", "pingpong", *(f"short:{n}" for n in self.cfg.short_draft_steps), "plain")

    def choose(self, num_running: int, drafter_up: bool) -> str:
        if not drafter_up:
            return "sequential"
        if self.cfg.pipeline != "auto":
            return "sequential" if self.cfg.pipeline == "pingpong" and num_running < 2 else self.cfg.pipeline
        cands = self.candidates(num_running)
        if cands != self.cands:                                   # another batch class: start over
            self.cands, self.mode, self.phase, self.left, self.rates, self._acc = cands, None, None, 0, {}, {}
        if self.left > 0:
            return self.mode
        todo = [c for c in cands if c not in self.rates]
        if self.phase != "measure":                               # start measuring, first candidate first
            self.mode, self.phase, self.left, self.rates = cands[0], "measure", self.cfg.mode_window, {}
        elif todo:
            self.mode, self.left = todo[0], self.cfg.mode_window
        else:                                                     # all measured: keep the fastest
            self.mode = max(self.rates, key=self.rates.get)
            self.phase, self.left = "keep", self.cfg.mode_window * 8
            log.info("pipeline mode %s (committed tokens/s: %s)", self.mode,
                     {k: round(v, 1) for k, v in self.rates.items()})
        return self.mode

    def record(self, mode: str, tokens: int, seconds: float) -> None:
        if self.mode != mode or self.left <= 0:
            return
        first = self.left == self.cfg.mode_window
        self.left -= 1
        # A window's first round is not counted when the window has others: it pays for the
        # previous mode's leftovers (a pending catch-up, a second micro-batch), not its own.
        if self.phase == "measure" and not (first and self.cfg.mode_window > 1):
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
