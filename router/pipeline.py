"""How the router runs rounds: the pipeline mode, and whether speculation is worth it now.

`ModeChooser` picks how the next round runs:
- "sequential": draft, verify, extend;
- "ahead": the same, while the verifier verifies the drafter fills its outcome cache for the
  round's trees (drafter/ahead.py), so a hit's next tree is ready when the verdict arrives
  (latency at small batch);
- "pingpong": two micro-batches, the drafter working on one while the verifier verifies the
  other (throughput);
- "short:N": sequential with trees at most N deep;
- "plain": no drafts.
"short:N" and "plain" only touch requests whose tokens do not depend on the tree (deterministic
drafts), and in "auto" so does "ahead" (a sampled request's tree decides its seeded tokens; the
choice must not depend on load). The others keep full drafts.

In "auto" the candidates depend on the batch: below 2 * pingpong_min_batch requests, sequential,
ahead and plain (ahead only while the drafter drafts ahead: one that never does is found out from
its replies, router/loop.py); from there, sequential, ping-pong, each short draft length and
plain. It measures each over a window of rounds (its first round left out) and keeps the fastest
for eight windows, measuring it again as it runs; between keeps it measures one other candidate
(in turn) for a window, so a change of the fastest is found at the cost of one window. A
round's time runs from the end of the round before (where the router went straight on, not
after a wait for requests), so it holds the host work between the two: a plain round whose
decode the verifier queued ahead would otherwise look faster by that work. It includes the
prefill of the requests it admits: in its verify step (sequential, plain) or before it (ahead
and ping-pong admit apart, router/loop.py `_round`); a window times its mode by the rounds that
admitted none where it has enough of them (below).
While the same mode stays the fastest, each keep is twice as long as the one before (up to 32
windows, and at most `max_keep_seconds` (RouterConfig, 4 s), so that a change of traffic is seen within seconds at any
batch): a settled choice spends about 3% of its rounds measuring the others. Candidates that
measured under 85% of the fastest are measured again only every fourth time (a window of
short:1 at batch 64 costs as much as several of plain; at batch 64 on the H200, windows of
sequential at 83% of plain kept between plain's keeps cost 1-3% of plain's throughput), except that
while plain is kept the fastest speculating mode is measured after every keep: traffic whose
drafts start to be accepted shows within one keep (4 s at most), not four. Measurements
belong to a batch class (the candidates and the nearest power of two of the running requests:
46 to 90 running are the class of 64, so a batch of 64 stays in it while its last requests
finish) and survive while the batch is in another class. Ping-pong wins when drafter and
verifier have devices of their own and loses when they share cores (`spectandem bench serve`);
short drafts and plain win at large batches where verifying trees costs more than it saves.
Once plain is kept twice in a row from LARGE_BATCH running requests (`settled_plain`), new
requests whose drafts are deterministic are admitted without the drafter (no target features, no
drafter prefill: "detached"; those whose drafts are sampled still join it, their seeded tokens
following their drafts), and the running ones leave it (router/loop.py `_detach_running`):
keeping them ready to speculate cost plain rounds 2-3% at batch 64 on the H200, and a speculating
server kept on plain served 0.89 of a plain server there while they ended, 0.93-0.97 once they
left (a = 0.6). They decode
plainly; a speculating round that drafts for no request (every request detached, or the
acceptance switch below has speculation off) is not a measurement, so measuring a speculating
mode again waits for requests admitted with the drafter, or for the switch to turn back on.
Detached requests rejoin
the drafter (a resync) once fewer than LARGE_BATCH run, those that may still generate
REJOIN_MIN_TOKENS tokens (router/loop.py).
Ahead must measure AHEAD_EDGE (10%) faster than sequential (and ping-pong) to be kept over
them, in AHEAD_CONFIRM (2) of its windows in a row: at one running request a near tie, or one
window's win, is more often the windows' text than the modes. Where the drafter drafts ahead on a
GPU stream of its own in the router's process (serve --backend local on a GPU), its drafts run
beside the verify rather than in the GPU's turns between processes, and the edge is
AHEAD_EDGE_OWN_STREAM (3%: `RouterConfig.ahead_edge`).
A speculating mode must measure PLAIN_EDGE (5%) faster than plain to be kept over it, and
PLAIN_EDGE_LARGE (15%) from LARGE_BATCH (32) running requests: near a tie, speculation's rounds
commit different counts per request, so a closed batch ends in a tail of nearly empty rounds that
the per-round rate does not see, and the larger the batch the longer that tail (batch 64 on the
H200 at a = 0.9: sequential measured 1.04x plain per round, 0.77x end to end; at a = 0.6-0.8
level rates, plain faster end to end).

A mode's rate is the tokens its kind of draft commits per request-round times the request-rounds
its window ran per second. The first counts only the requests a round drafted for that go on
after it. Detached requests decode plainly beside them: counted in, those that a kept plain
detached would have each later window of speculation commit less than its trees do. Their rows
cost less than drafted ones, so neither does a round where over DETACHED_SHARE of the requests are
detached time its mode where the mode has a speed already: with 60 of 64 detached, the round costs
little more than a plain one, and its request-rounds per second times what the drafted requests
commit would make speculation look about twice as fast as it is. Requests ending in the round commit
what their ends leave (a plain round cut by them is no measurement at all): counted in, a wave's
tail, where many end, has speculation commit less than it does. (At 64 running on the H200, a =
0.8, counting both: kept plain, then sequential kept at 11,647 committed tokens/s against plain's
9,888, then measured at 9,920 and plain kept again: 6,814 tokens/s served where a sequential
server served 7,564.) The first is pooled over the latest rounds of every mode that drafts the
same trees (sequential and ping-pong; ahead; each short length; plain), as many as hold
YIELD_REQUEST_ROUNDS request-rounds, because what a request commits per round depends on its
text: at one running request, windows of different modes see different stretches of text, and a
mode compared on its own window's tokens wins or loses by the text it happened to see. Ahead
pools alone: a hit's tree was drafted before the verdict's target features were known, and with
a real head it commits less than sequential's (`draft_kind`). Pooled by
request-rounds rather than rounds, one window of a large batch (many texts at once) is evidence
enough: when drafts start to be accepted (new traffic) while plain is kept, the first window of
speculation between keeps shows it; at a small batch, a window that commits over YIELD_CHANGE
times more (or less) per request-round than the pooled rounds restarts the pool (the traffic
changed: a text where drafts were never accepted, then one where they are). Such a change in one
drafting kind, at any batch, also forgets the other drafting kinds' pools, and so does a window
that a pool of another kind contradicts (a deeper kind committing less than a shallower one, by
DEPTH_SLACK): their modes are measured again at once. After a keep of plain only the fastest
speculating mode by the old rates is measured, often a short one; without this, sequential
would keep the rate of the text where drafts were rejected until its turn came FAR_EVERY keeps
later (at 16 running on the H100, plain kept through a whole bench run at 1,729-1,837 tok/s
where sequential served 2,698). The second leaves out the window's stalls, the rounds that took
over STALL_FACTOR times the window's median per request-round: a round that captured a CUDA graph
or waited on a stall is not the mode's cost. Nor are the prompts of the requests a round admits
(prefilled in its verify step, or before it): the same work whichever mode runs, that lands in
whichever window the arrivals fall in. A window with ADMISSION_FREE_ROUNDS rounds that admitted
none is timed by those alone. Without this, the window that took a wave of arrivals measured its
mode at a fraction of its speed (the demo pair on 2 CPU cores at 16 running: plain's window took
five rounds of the next requests' prompts, 3.6 s for 8 rounds against 72-76 ms for each round
that admitted none, and plain, measured at a quarter of its speed, was not measured again in that
run). A window of measure or explore with fewer runs on round by round until it has them, for up
to EXTEND_ROUNDS times its length (the ends of a wave of 64 requests spread over a dozen rounds,
each admitting some); a keep is long enough as it is. A window that still has fewer (requests
arriving in most rounds, every mode's windows alike) is timed by all of them, and measures its
mode only where the mode has no speed yet: a speed timed without arrivals is not replaced by one
timed with them. Every other round counts, so that a mode whose rounds differ by nature
(ahead: a hit's round does not draft, a miss's does) is judged by their mean, and a short window
of one mode and a long keep of another by the same rule: a fixed share of the slowest rounds left
out would take a keep of ahead's misses away, and none of a short window's rounds. The
catch-ups that plain rounds hold back for requests still on the drafter and send every
BACKLOG_ROUNDS rounds are plain decoding's cost, spread over the window instead (`record`'s
upkeep), however long the rounds that send them.

`SpeculationSwitch`: when drafts are almost never accepted, drafting only costs time; the router
then decodes plainly for a number of rounds and tries again.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from dataclasses import dataclass, field
from typing import NamedTuple

log = logging.getLogger("spectandem.router")
KEEP_WINDOWS = 8          # windows of a keep after the fastest mode changed
MAX_KEEP_WINDOWS = 32     # ... and at most, while it stays the fastest
EXPLORE_NEAR = 0.85       # candidates measured at this fraction of the fastest or more are "near"
FAR_EVERY = 4             # every this many ends of a keep, any candidate may be measured again
PLAIN_EDGE = 1.05         # a speculating mode is kept over plain only when it measured this much faster
PLAIN_EDGE_LARGE = 1.15   # ... from LARGE_BATCH running requests on
# "ahead" is kept over the modes that draft from the verdict's features only when it measured this
# much faster: at one running request each window sees its own stretch of text, and ahead's trees
# commit less (`draft_kind`), so a near tie is more often the text than the mode (2 CPU cores,
# demo pair over Ray, engines bound: windows measured sequential at 258-345 committed tok/s and
# ahead at 273-287 within seven seconds, where ahead served 267 and 292 tok/s against sequential's
# 311 and 334 over whole runs: benchmarks/results/RESULTS.md, serve-cpu-2core). Where ahead wins
# (a drafter on its own GPU, 8B-shaped pair) it wins by 16-58%.
AHEAD_EDGE = 1.10
# ... where the drafter drafts ahead on a GPU stream of its own beside the verifier, in one process
# (serve --backend local on a GPU). There ahead's rounds are cheaper than sequential's by about the
# draft (one H200, the 8B-shaped pair, a = 0.8, one running request, two servers measured in
# alternation: runs where `auto` kept ahead served 424.5 and 425.8 tok/s, runs that kept sequential
# 375.5-408.9, at the same accept length; benchmarks/results/serve-ab-local-c1-h200.txt), a gain
# AHEAD_EDGE left unused. A tie within 3% either way serves alike; AHEAD_CONFIRM still asks two
# winning windows in a row.
AHEAD_EDGE_OWN_STREAM = 1.03
# ... and in this many of its windows in a row (the first sweep's, then one after a keep), the fastest
# of the other modes kept meanwhile. One window at one running request is
# one stretch of text: on 2 CPU cores over gRPC (the demo pair) a keep of sequential measured it
# 20-25% under its first window and the window of ahead after it past the edge, and `auto` kept ahead
# (1.45-1.48x plain, accept length 3.7) where the run that stayed on sequential served 1.70x (4.4).
AHEAD_CONFIRM = 2
LARGE_BATCH = 32
# Tokens per request-round are pooled per draft kind over the latest rounds that hold this many
# request-rounds: 16 windows at one running request, one window from 16 on.
YIELD_REQUEST_ROUNDS = 128
YIELD_CHANGE = 2.0        # a window committing this many times more (or less) a request-round than the pool restarts it
# Deeper trees commit at least what shallower ones do per request-round (full trees hold each
# short:N tree): a pool of one drafting kind that this much contradicts a window of another is out
# of date (its rounds saw other text) and is forgotten.
DEPTH_SLACK = 1.25
# A round that took over this many times the median round of its window (per request-round, upkeep
# aside) stalled (a CUDA graph's capture, a pause of the host) and is left out of the mode's speed.
STALL_FACTOR = 3.0
# A window with at least this many rounds that admitted no request is timed by those alone (the
# prompts' prefill is no mode's cost).
ADMISSION_FREE_ROUNDS = 2
# A measuring window with fewer runs on, round by round, for up to this many times its length.
EXTEND_ROUNDS = 3
# A speculating round where over this share of the running requests are detached (they decode
# plainly, router/loop.py) does not replace its mode's speed: the plain rows cost less than drafted
# ones. At an eighth, the round costs within a few percent of one where every request drafts (an
# estimate: a verify at these batches costs little more for 64 trees than for 56 trees and 8 roots).
DETACHED_SHARE = 0.125


class _Round(NamedTuple):
    """One recorded round of a phase (`ModeChooser.record`)."""

    seconds: float          # its time, upkeep aside
    request_rounds: int
    upkeep: float           # seconds of work the mode's rounds owe in turn
    admitted: bool          # it admitted new requests (their prefill inside `seconds`)
    mixed: bool             # a drafting round with over DETACHED_SHARE of its requests detached


def _depth(kind: str) -> float:
    """How deep a drafting kind's trees go: short:N N, full and ahead without a cap."""
    return math.inf if kind in ("full", "ahead") else int(kind.split(":")[1])


def draft_kind(mode: str) -> str:
    """The trees a mode verifies: modes of one kind commit the same tokens per request-round.
    Sequential and ping-pong rounds draft from the verdict's target features; "ahead" is a kind of
    its own: a hit's tree was drafted before they were known (the head's own predictions stand
    in), and with a real head commits less (on 2 CPU cores, the demo pair over gRPC: 3.4 tokens a
    round against sequential's 3.9)."""
    return "full" if mode in ("sequential", "pingpong") else mode


def _fastest(rates: dict[str, float], edge: float, ahead_edge: float) -> str:
    """The mode to keep: the fastest, plain given `edge` (`plain_edge`), and ahead kept over the
    modes of the "full" kind only where it measured `ahead_edge` faster than the fastest of them."""
    weight = lambda m: rates[m] * (edge if m == "plain" else 1.0)   # noqa: E731
    best = max(rates, key=weight)
    full = [rates[m] for m in rates if draft_kind(m) == "full"]
    if best == "ahead" and full and rates["ahead"] < ahead_edge * max(full):
        best = max((m for m in rates if m != "ahead"), key=weight)
    return best


def plain_edge(num_running: int) -> float:
    """How much faster than plain a speculating mode must measure to be kept over it."""
    return PLAIN_EDGE_LARGE if num_running >= LARGE_BATCH else PLAIN_EDGE


@dataclass
class _ClassState:
    """What "auto" knows and is doing in one batch class."""

    mode: str | None = None
    phase: str | None = None    # "measure" (every candidate), "keep" (the fastest), "explore" (one other)
    left: int = 0               # rounds left in the phase
    length: int = 0             # rounds of the phase
    fresh: bool = False         # the phase's next round is its first
    extended: int = 0           # rounds the phase ran past its length, waiting for rounds without admissions
    explored: int = 0           # ends of keeps so far: every FAR_EVERY-th explores any other candidate
    near_turn: int = 0          # the next near candidate (within EXPLORE_NEAR of the fastest) in turn
    any_turn: int = 0           # the next other candidate in turn, near or not
    kept: str | None = None     # the mode of the last keep
    keep_windows: int = 0       # windows of the last keep (doubles while the same mode stays the fastest)
    elapsed: float = 0.0        # seconds of the phase's rounds so far
    pooled: list[int] = field(default_factory=lambda: [0, 0, 0])   # the phase's tokens, request-rounds, rounds in `yields`
    speeds: dict[str, float] = field(default_factory=dict)   # mode -> request-rounds/s its last window ran
    acc: dict[str, list[_Round]] = field(default_factory=dict)   # mode -> its phase's rounds so far
    # draft kind -> recent rounds, each (tokens, request-rounds): what the kind commits per request-round
    yields: dict[str, deque] = field(default_factory=dict)
    prior: float | None = None   # what the phase's kind committed per request-round when the phase began
    ahead_wins: int = 0          # windows of ahead in a row that won while another mode was kept (AHEAD_CONFIRM)
    ahead_fresh: bool = False    # a window of ahead ended since the last win counted in ahead_wins

    @property
    def rates(self) -> dict[str, float]:
        """Committed tokens/s per measured mode: its speed times what its kind commits per
        request-round now."""
        out = {}
        for mode, speed in self.speeds.items():
            recent = self.yields.get(draft_kind(mode))
            if recent:   # every pooled round holds request-rounds (`ModeChooser.record`)
                out[mode] = _pool_yield(recent) * speed
        return out

    def start(self, phase: str, mode: str, rounds: int) -> None:
        self.phase, self.mode, self.left, self.length, self.fresh = phase, mode, rounds, rounds, True
        self.elapsed, self.pooled = 0.0, [0, 0, 0]
        self.extended = 0
        pool = self.yields.get(draft_kind(mode))
        self.prior = _pool_yield(pool) if pool else None

    def end(self) -> None:
        """The phase is over: its mode's speed is that of the rounds it measured. Where what its
        rounds committed per request-round is over twice or under half what its kind's pool held
        when it began, the traffic changed: the pool keeps the phase's rounds alone, and where the
        phase drafted, the other drafting kinds' pools are out of date too. So is one that
        contradicts the phase's by more than DEPTH_SLACK (a deeper kind committing less, a
        shallower one more). Out-of-date pools are forgotten, so that their modes are measured
        again: a kept plain is followed by one speculating mode only, and without this the others
        would keep the old text's rates until their turn came, FAR_EVERY keeps later."""
        self.left = 0
        self.ahead_fresh = self.ahead_fresh or self.mode == "ahead"
        rounds = self.acc.pop(self.mode, [])
        speed = _speed(rounds)
        if speed is not None and (self.mode not in self.speeds or _representative(rounds)):
            self.speeds[self.mode] = speed
        if log.isEnabledFor(logging.DEBUG):
            per = sorted(x.seconds / x.request_rounds * 1e3 for x in rounds if x.request_rounds)
            log.debug("auto pipeline: %s of %s over %d rounds in %.1f ms: %s request-rounds/s; %d rounds recorded, "
                      "%d of them admitting, ms a request-round min / median / max %s", self.phase, self.mode,
                      self.length, self.elapsed * 1e3, "-" if speed is None else f"{speed:.1f}", len(rounds),
                      sum(x.admitted for x in rounds),
                      " / ".join(f"{v:.3f}" for v in (per[0], per[len(per) // 2], per[-1])) if per else "-")
        tokens, request_rounds, rounds = self.pooled
        kind = draft_kind(self.mode)
        pool = self.yields.get(kind)
        if not request_rounds or not pool:
            return
        mine = tokens / request_rounds
        changed = self.prior is not None and (mine > YIELD_CHANGE * self.prior or mine * YIELD_CHANGE < self.prior)
        if changed:
            while len(pool) > rounds:
                pool.popleft()
        if kind == "plain":
            return
        for other in [k for k in self.yields if k not in (kind, "plain")]:
            theirs = _pool_yield(self.yields[other])
            deeper, shallower = _depth(other) > _depth(kind), _depth(other) < _depth(kind)
            if changed or (deeper and theirs * DEPTH_SLACK < mine) or (shallower and theirs > DEPTH_SLACK * mine):
                del self.yields[other]


class ModeChooser:
    """The "auto" pipeline mode (module docstring), measured per batch class: the candidates and
    the nearest power of two of the running requests (64 running is another class than 16). A class
    keeps its measurements while the batch is in another one, so a batch that shrinks at its
    tail and grows again (the next requests arriving) resumes where its class was, instead of
    measuring every candidate again, and never keeps a mode it did not measure."""

    def __init__(self, cfg):
        self.cfg = cfg
        self.cands: tuple[str, ...] = ()
        self._key: tuple | None = None
        self._states: dict[tuple, _ClassState] = {}   # batch class -> its state
        self._state = _ClassState()
        # Modes the engines cannot do (`ahead` with a drafter that does not draft ahead: the
        # router finds out from its replies, router/loop.py): never candidates.
        self.unavailable: set[str] = set()

    @property
    def mode(self) -> str | None:
        return self._state.mode

    @property
    def phase(self) -> str | None:
        return self._state.phase

    @property
    def rates(self) -> dict[str, float]:
        return self._state.rates

    def candidates(self, num_running: int) -> tuple[str, ...]:
        if num_running < 2 * self.cfg.pingpong_min_batch:
            cands = ("sequential", "ahead", "plain")
        else:
            cands = ("sequential", "pingpong", *(f"short:{n}" for n in self.cfg.short_draft_steps), "plain")
        return tuple(c for c in cands if c not in self.unavailable)

    def _class(self, num_running: int) -> tuple:
        return self.candidates(num_running), round(math.log2(max(num_running, 1)))

    def rates_for(self, num_running: int) -> dict[str, float]:
        """Committed tokens/s measured so far per candidate in the batch class of `num_running`."""
        state = self._states.get(self._class(num_running))
        return state.rates if state else {}

    def _enter(self, num_running: int) -> None:
        """Switches to the batch class of `num_running` requests."""
        key = self._class(num_running)
        if key == self._key:
            return
        self.cands, self._key = key[0], key
        state = self._state = self._states.setdefault(key, _ClassState())
        if state.left > 0:   # an interrupted phase counts again from its start (keep: from here on)
            state.acc.pop(state.mode, None)
            state.fresh = True
            if state.phase != "keep":
                state.left = state.length

    def choose(self, num_running: int, drafter_up: bool) -> str:
        if not drafter_up:
            return "sequential"
        if self.cfg.pipeline != "auto":
            return "sequential" if self.cfg.pipeline == "pingpong" and num_running < 2 else self.cfg.pipeline
        self._enter(num_running)
        s = self._state
        if s.left > 0 and s.phase == "keep" and s.elapsed >= self.cfg.max_keep_seconds:
            s.end()
        if s.left > 0:
            return s.mode
        window = self.cfg.mode_window
        rates = s.rates
        todo = [c for c in self.cands if c not in rates]
        if todo:                                                  # measure every candidate once, in order
            s.start("measure", todo[0], window)
        elif s.phase == "keep" and (pick := self._explore_pick(s)) is not None:
            s.start("explore", pick, window)                      # then, between keeps, one other again
        else:                                                     # keep the fastest so far
            edge, ahead_edge = plain_edge(num_running), self.cfg.ahead_edge
            best = _fastest(rates, edge, ahead_edge)
            if best != "ahead" or s.kept == "ahead":
                s.ahead_wins = 0
            elif s.ahead_fresh:   # a window of ahead since the last win counted, and it won
                s.ahead_wins, s.ahead_fresh = s.ahead_wins + 1, False
            others = {m: r for m, r in rates.items() if m != "ahead"}
            if best == "ahead" and s.kept != "ahead" and s.ahead_wins < AHEAD_CONFIRM and others:
                best = _fastest(others, edge, ahead_edge)   # not yet: the fastest of the others meanwhile
            changed = best != s.kept
            s.keep_windows = min(2 * s.keep_windows, MAX_KEEP_WINDOWS) if not changed else KEEP_WINDOWS
            s.kept = best
            s.start("keep", best, window * s.keep_windows)
            # a mode kept again after a measurement is not news
            log.log(logging.INFO if changed else logging.DEBUG, "auto pipeline: mode %s at %d running (committed "
                    "tokens/s: %s)", s.mode, num_running, {k: round(v, 1) for k, v in rates.items()})
        return s.mode

    def continues(self, drafter_up: bool) -> bool:
        """Whether the round after this one (being run) is expected in this one's mode: always
        with a fixed pipeline or without a drafter; in "auto", while the phase under way has
        rounds left after this one (the batch staying in its class)."""
        if not drafter_up or self.cfg.pipeline != "auto":
            return True
        s = self._state
        return s.left > 1 and not (s.phase == "keep" and s.elapsed >= self.cfg.max_keep_seconds)

    def forget_text(self) -> None:
        """Keeps what the rounds so far say of the engines and forgets what they say of the text
        (serve's warm-up, router/loop.py): each batch class keeps its modes' speeds (request-rounds
        per second: the engines' work at that batch and tree shape) and plain's tokens per
        request-round (plain steps, whatever the text), and forgets what the drafting modes
        committed per request-round (the acceptance of the warm-up's own prompts) and any phase
        under way. Its first phase then measures only the draft kinds it has no yield for (one
        window of sequential gives ping-pong's and ahead's rate too) instead of every candidate."""
        for key, state in self._states.items():
            plain = state.yields.get("plain")
            self._states[key] = _ClassState(speeds=dict(state.speeds), yields={"plain": plain} if plain else {})
        self._key = None
        self._state = _ClassState()

    def settled(self, num_running: int) -> str | None:
        """The mode "auto" keeps in the batch class of `num_running` for at least the second keep
        in a row, or None (still measuring, or the fastest changed lately)."""
        s = self._states.get(self._class(num_running))
        ok = s is not None and s.phase == "keep" and s.left > 0 and s.keep_windows >= 2 * KEEP_WINDOWS
        return s.mode if ok else None

    def settled_plain(self, num_running: int) -> bool:
        """"auto" has settled on plain at LARGE_BATCH or more running: the router then stops
        keeping new requests whose drafts are deterministic ready to speculate (router/loop.py:
        no target features, no drafter prefill)."""
        return self.cfg.pipeline == "auto" and num_running >= LARGE_BATCH and self.settled(num_running) == "plain"

    def _explore_pick(self, s: _ClassState) -> str | None:
        """The candidate to measure after a keep: near ones in turn, any one in turn every
        FAR_EVERY-th time; None (keep on) when it is not that time and none is near."""
        others = [c for c in self.cands if c != s.mode]
        s.explored += 1
        if s.explored % FAR_EVERY == 0:
            s.any_turn += 1
            return others[(s.any_turn - 1) % len(others)]
        rates = s.rates
        best = rates.get(s.mode, 0.0)
        near = [c for c in others if rates.get(c, 0.0) >= EXPLORE_NEAR * best]
        if not near and s.mode == "plain" and (drafting := [c for c in others if c in rates]):
            # Kept plain: the fastest speculating mode after every keep, so that drafts starting to
            # be accepted (new traffic) show within one keep rather than FAR_EVERY keeps.
            near = [max(drafting, key=rates.__getitem__)]
        if not near:
            return None
        s.near_turn += 1
        return near[(s.near_turn - 1) % len(near)]

    def record(self, mode: str, tokens: int, seconds: float, request_rounds: int = 1, upkeep: float = 0.0,
               admitted: int = 0, drafted: tuple[int, int] | None = None, detached: int = 0) -> None:
        """One round of `mode` that committed `tokens` for `request_rounds` requests in `seconds`,
        `upkeep` of them work the mode's rounds owe in turn (the catch-ups plain rounds hold back
        for drafter-attached requests, sent every BACKLOG_ROUNDS rounds: router/loop.py), and
        admitted `admitted` new requests (their prefill inside `seconds`; `_speed`): every
        phase measures its mode (a keep re-measures the fastest), its first round left out when
        the phase has others: it pays for the previous mode's leftovers (a pending catch-up, a
        second micro-batch), not its own. `drafted`: (tokens, request-rounds) of the requests the
        round drafted for that go on after it, where given what its draft kind commits per
        request-round (`yields`; the module docstring says why); the round's other requests
        count in its speed only. `detached`: how many of the round's requests were detached (they
        decoded plainly): a drafting round with over DETACHED_SHARE of them does not replace its
        mode's speed (`_representative`)."""
        s = self._state
        if s.mode != mode or s.left <= 0:
            return
        first, s.fresh = s.fresh, False
        s.left -= 1
        s.elapsed += seconds
        if not (first and s.length > 1) and request_rounds > 0:
            mixed = mode != "plain" and detached > DETACHED_SHARE * request_rounds
            s.acc.setdefault(mode, []).append(_Round(seconds - upkeep, request_rounds, upkeep, admitted > 0, mixed))
            got, of = (tokens, request_rounds) if drafted is None else drafted
            if of > 0:
                pool = s.yields.setdefault(draft_kind(mode), deque())
                pool.append((got, of))
                s.pooled = [s.pooled[0] + got, s.pooled[1] + of, s.pooled[2] + 1]
                held = sum(r for _, r in pool)
                while held - pool[0][1] >= YIELD_REQUEST_ROUNDS:
                    held -= pool.popleft()[1]
                s.pooled[2] = min(s.pooled[2], len(pool))
        if s.left == 0 and s.phase != "keep" and s.extended < EXTEND_ROUNDS * s.length:
            if not _admission_free(s.acc.get(mode, [])):   # arrivals filled the window: on until rounds without come
                s.left, s.extended = 1, s.extended + 1
        if s.left == 0:
            s.end()


def _pool_yield(pool) -> float:
    """Tokens per request-round of a yields pool's rounds."""
    return sum(t for t, _ in pool) / max(1, sum(r for _, r in pool))


def _admission_free(rounds: list[_Round]) -> bool:
    """Whether a window's rounds time its mode without the prompts it admitted: none admitted, or
    ADMISSION_FREE_ROUNDS of them did not."""
    return sum(not x.admitted for x in rounds) >= ADMISSION_FREE_ROUNDS or not any(x.admitted for x in rounds)


def _unmixed(rounds: list[_Round]) -> list[_Round]:
    """A window's rounds with few detached requests (`record`'s `detached`), or all where none is."""
    return [x for x in rounds if not x.mixed] or rounds


def _representative(rounds: list[_Round]) -> bool:
    """Whether a window's speed may replace its mode's: some of its rounds had few detached
    requests, and those time the mode without the prompts they admitted (`_admission_free`)."""
    return any(not x.mixed for x in rounds) and _admission_free(_unmixed(rounds))


def _speed(rounds: list[_Round]) -> float | None:
    """Request-rounds per second of a window's rounds: those with few detached requests where some are
    (else all), of those the ones that admitted no request where ADMISSION_FREE_ROUNDS of them did
    not (else all); their stalls left out (rounds over STALL_FACTOR times the median per
    request-round, upkeep aside), and the window's upkeep spread over its request-rounds: the
    catch-ups a plain round sends every BACKLOG_ROUNDS rounds are plain decoding's cost while
    requests stay on the drafter, not a stall."""
    if not rounds:
        return None
    timed = _unmixed(rounds)
    timed = [x for x in timed if not x.admitted] if _admission_free(timed) else timed
    per = sorted(x.seconds / x.request_rounds for x in timed)
    median = per[len(per) // 2]
    kept = [(x.seconds, x.request_rounds) for x in timed if x.seconds / x.request_rounds <= STALL_FACTOR * median]
    request_rounds = sum(r for _, r in kept)
    upkeep = sum(x.upkeep for x in rounds) * request_rounds / max(1, sum(x.request_rounds for x in rounds))
    seconds = sum(sec for sec, _ in kept) + upkeep
    return request_rounds / seconds if seconds > 0 else None


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
