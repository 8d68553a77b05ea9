"""The pipeline-mode chooser (pure router logic): measures each candidate over a window and keeps
the fastest; the candidates depend on the batch (sequential, ahead and plain below two
micro-batches; sequential, ping-pong, short drafts and plain from there); fixed modes are honoured;
no drafter means sequential."""

import pytest

from router.pipeline import ModeChooser, SpeculationSwitch
from router.requests import RouterConfig


def _cfg(**kw):
    """Rounds of these tests take abstract seconds: keeps are bounded by windows alone unless a
    test says otherwise."""
    return RouterConfig(max_len=256, eos_token_ids=(0,), lookahead=5, want_features=True,
                        **({"mode_window": 3, "max_keep_seconds": float("inf")} | kw))


def _run(chooser, rates, rounds, num_running=8):
    chosen = []
    for _ in range(rounds):
        mode = chooser.choose(num_running=num_running, drafter_up=True)
        chosen.append(mode)
        chooser.record(mode, tokens=10, seconds=10.0 / rates[mode])   # the rate in the round's time
    return chosen


def test_auto_measures_every_mode_then_keeps_the_fastest():
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    for fastest in order:
        rates = {m: 100.0 for m in order} | {fastest: 150.0}
        chosen = _run(ModeChooser(_cfg(pipeline="auto")), rates, 15 + 24)
        assert chosen[:15] == [m for m in order for _ in range(3)]
        assert set(chosen[15:]) == {fastest}


def test_auto_small_batches_choose_between_sequential_ahead_and_plain():
    """The fastest is kept; ahead once AHEAD_CONFIRM (2) of its windows in a row have won: the first
    sweep's, then its next window (after keeps of the fastest of the others, plain by plain's edge,
    and a window of sequential in turn), which runs on as its keep."""
    order = ["sequential", "ahead", "plain"]
    for fastest in order:
        rates = {m: 100.0 for m in order} | {fastest: 150.0}
        chosen = _run(ModeChooser(_cfg(pipeline="auto")), rates, 9 + 24 + 3 + 48 + 3 + 24, num_running=3)
        assert chosen[:9] == [m for m in order for _ in range(3)]
        if fastest != "ahead":
            assert set(chosen[9:33]) == {fastest}
        else:
            assert _windows(chosen[9:]) == [("plain", 24), ("sequential", 3), ("plain", 48), ("ahead", 27)]


def test_after_forget_text_only_the_draft_kinds_without_a_yield_are_measured():
    """Serve's warm-up (Router.warm_up) keeps each mode's speed and plain's yield: the first phase
    after it measures sequential (whose yield ping-pong shares), short:1 and short:2, then keeps
    the fastest by the warm-up's speeds; a fresh chooser (the control) measures all five."""
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    rates = {m: 100.0 for m in order} | {"pingpong": 150.0}
    chooser = ModeChooser(_cfg(pipeline="auto"))
    _run(chooser, rates, 15 + 24)
    chooser.forget_text()
    assert chooser.rates_for(8).keys() == {"plain"}
    chosen = _run(chooser, rates, 9 + 24)
    assert chosen[:9] == [m for m in ("sequential", "short:1", "short:2") for _ in range(3)]
    assert set(chosen[9:]) == {"pingpong"}
    fresh = _run(ModeChooser(_cfg(pipeline="auto")), rates, 15)
    assert fresh == [m for m in order for _ in range(3)]


def test_forget_text_drops_what_the_drafts_committed():
    """What a drafting mode committed per request-round in the warm-up says nothing of the
    clients' text: with every draft rejected there (plain the fastest), the clients' accepted
    drafts make sequential the fastest at once."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    for _ in range(15 + 24):   # the warm-up: drafts commit 1 token a round, plain 4 in a faster round
        mode = chooser.choose(num_running=8, drafter_up=True)
        chooser.record(mode, tokens=4 if mode == "plain" else 1, seconds=1.0 if mode == "plain" else 1.2)
    assert chooser.mode == "plain"
    chooser.forget_text()
    chosen = []
    for _ in range(9 + 24):    # the clients: sequential commits 8 a round
        mode = chooser.choose(num_running=8, drafter_up=True)
        chosen.append(mode)
        chooser.record(mode, tokens=4 if mode == "plain" else (8 if mode == "sequential" else 3), seconds=1.2)
    assert set(chosen[9:]) <= {"sequential", "pingpong"} and chosen[-1] in ("sequential", "pingpong")


def test_a_new_batch_class_starts_measuring_again():
    chooser = ModeChooser(_cfg(pipeline="auto"))
    rates = {"sequential": 100.0, "ahead": 150.0, "plain": 90.0}
    _run(chooser, rates, 15, num_running=1)
    assert chooser.choose(8, True) == "sequential" and chooser.phase == "measure"


def test_batch_classes_are_powers_of_two_of_the_running_requests():
    """16 and 64 running requests have the same candidates but are measured apart: speculation
    that wins at 16 may lose at 64."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    at16 = {m: 100.0 for m in order} | {"sequential": 150.0}
    at64 = {m: 100.0 for m in order} | {"plain": 150.0}
    assert set(_run(chooser, at16, 15 + 5, num_running=16)[15:]) == {"sequential"}   # keeping, mid-way
    chosen = _run(chooser, at64, 15 + 24, num_running=64)
    assert chosen[:15] == [m for m in order for _ in range(3)]
    assert set(chosen[15:]) == {"plain"}


def test_a_class_keeps_its_measurements_while_the_batch_is_in_another():
    """A batch's tail (fewer requests running) and the next batch: back at 64 running, the chooser
    keeps the mode it measured there instead of measuring every candidate again, and a window
    cut short by the excursion counts again from its start."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    at64 = {m: 100.0 for m in order} | {"plain": 150.0}
    _run(chooser, at64, 15 + 2, num_running=64)
    tail = {"sequential": 200.0, "ahead": 100.0, "plain": 90.0}
    assert _run(chooser, tail, 9 + 3, num_running=3)[9:] == ["sequential"] * 3
    assert chooser.rates_for(64) == at64 and chooser.rates_for(3) == tail
    assert set(_run(chooser, at64, 22, num_running=64)) == {"plain"}, "the 64-class resumes keeping plain"
    assert chooser.rates_for(16) == {}
    # An interrupted measurement: 64's window of sequential cut after one round, then resumed.
    chooser = ModeChooser(_cfg(pipeline="auto"))
    _run(chooser, at64, 1, num_running=64)
    _run(chooser, tail, 2, num_running=3)
    assert _run(chooser, at64, 15, num_running=64) == [m for m in order for _ in range(3)]
    assert chooser.rates == at64


def test_fixed_modes():
    assert ModeChooser(_cfg(pipeline="sequential")).choose(8, True) == "sequential"
    assert ModeChooser(_cfg(pipeline="pingpong")).choose(8, True) == "pingpong"
    assert ModeChooser(_cfg(pipeline="pingpong")).choose(1, True) == "sequential"     # one request: no halves
    assert ModeChooser(_cfg(pipeline="ahead")).choose(1, True) == "ahead"
    for pipeline in ("pingpong", "ahead", "auto"):
        assert ModeChooser(_cfg(pipeline=pipeline)).choose(8, False) == "sequential"   # no drafter


def test_speculation_switch_turns_off_on_low_acceptance_only():
    switch = SpeculationSwitch(_cfg(adaptive_window=4, adaptive_off_rounds=10))
    for n in (3, 2, 4, 3):
        switch.observe(n, round_number=5)
    assert not switch.off(6)
    for _ in range(4):
        switch.observe(0, round_number=20)
    assert switch.off(21) and switch.off(29) and not switch.off(30)


def test_a_windows_first_round_is_not_counted():
    """The first round after a switch pays the previous mode's leftovers: a slow first round of
    "sequential" must not make "plain" look better."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    for i in range(9):
        mode = chooser.choose(num_running=1, drafter_up=True)
        slow_start = i % 3 == 0 and mode == "sequential"
        seconds = {"sequential": 1.0, "ahead": 3.0, "plain": 1.5}[mode]
        chooser.record(mode, tokens=30, seconds=50.0 if slow_start else seconds)
    assert chooser.choose(num_running=1, drafter_up=True) == "sequential"


def _windows(chosen):
    """[(mode, rounds)] of consecutive runs of one mode."""
    import itertools

    return [(m, len(list(g))) for m, g in itertools.groupby(chosen)]


def test_between_keeps_one_other_candidate_is_measured_and_a_faster_one_is_kept():
    """After the first sweep, a keep of 8 windows, then one window of another candidate (the
    near ones in turn; every fourth time any one in turn), then a keep again, twice as long while
    the same mode stays the fastest (at most 32 windows); when plain becomes the fastest, the next
    window that measures it keeps it, for 8 windows, and then the fastest speculating mode is
    measured again, however far below plain it measured."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    rates = {m: 130.0 for m in order} | {"sequential": 150.0}     # every other one near (>= 85%)
    chosen = _run(chooser, rates, 15 + 24 + 3 + 48 + 3 + 96 + 3 + 96 + 3, num_running=64)
    assert _windows(chosen[15:]) == [("sequential", 24), ("pingpong", 3), ("sequential", 48), ("short:1", 3),
                                     ("sequential", 96), ("short:2", 3), ("sequential", 96), ("pingpong", 3)]
    rates["plain"] = 300.0            # plain decoding got faster (say, the batch grew)
    chosen = _run(chooser, rates, 96 + 3 + 24 + 3, num_running=64)
    # measured, then kept: 8 windows; then sequential (the fastest speculating mode, under 85% of plain)
    assert _windows(chosen) == [("sequential", 96), ("plain", 3 + 24), ("sequential", 3)]
    assert chooser.rates["plain"] == pytest.approx(300.0)


def test_kept_plain_finds_drafts_accepted_again_within_one_keep():
    """Traffic whose drafts were never accepted keeps plain; once they are (new traffic), the
    window of the fastest speculating mode after the current keep finds it, and it is kept."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    rates = {"sequential": 60.0, "ahead": 50.0, "plain": 150.0}
    chosen = _run(chooser, rates, 9 + 24 + 3 + 48, num_running=1)
    assert _windows(chosen[9:]) == [("plain", 24), ("sequential", 3), ("plain", 48)]
    rates |= {"sequential": 300.0, "ahead": 320.0}
    chosen = _run(chooser, rates, 3 + 24, num_running=1)
    assert chosen == ["sequential"] * (3 + 24)   # its window, then its keep


def test_candidates_far_below_the_fastest_are_measured_only_every_fourth_time():
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    # pingpong near (90%); short drafts and plain far, one of them at 80%: far is under 85%
    rates = {m: 50.0 for m in order} | {"sequential": 150.0, "pingpong": 135.0, "short:2": 120.0}
    chosen = _run(chooser, rates, 15 + 24 + 48 + 96 * 6 + 8 * 3, num_running=64)
    explored = [m for m, _ in _windows(chosen[15:]) if m != "sequential"]
    assert explored == ["pingpong"] * 7 + ["short:1"]


def test_batch_classes_are_nearest_powers_of_two():
    """A batch of 64 whose last requests finish (63, 50 running) stays in the class of 64."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    at64 = {m: 100.0 for m in order} | {"plain": 150.0}
    _run(chooser, at64, 15, num_running=64)
    assert chooser.rates_for(50) == chooser.rates_for(90) == pytest.approx(at64)
    assert chooser.rates_for(45) == {} and chooser.rates_for(91) == {}
    assert set(_run(chooser, at64, 10, num_running=50)) == {"plain"}


def test_a_keep_measures_its_mode_again():
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    rates = {m: 100.0 for m in order} | {"sequential": 150.0}
    _run(chooser, rates, 15, num_running=64)
    rates["sequential"] = 120.0       # slower now, still the fastest
    _run(chooser, rates, 24, num_running=64)
    assert chooser.rates["sequential"] == pytest.approx(120.0)


@pytest.mark.parametrize("num_running", [16, 64])
def test_plain_is_kept_over_a_speculating_mode_it_nearly_ties(num_running):
    """Within the edge of plain (PLAIN_EDGE, PLAIN_EDGE_LARGE from LARGE_BATCH running), plain is
    kept; a clear win keeps the speculating mode."""
    from router.pipeline import LARGE_BATCH, PLAIN_EDGE, PLAIN_EDGE_LARGE

    edge = PLAIN_EDGE_LARGE if num_running >= LARGE_BATCH else PLAIN_EDGE
    assert PLAIN_EDGE < PLAIN_EDGE_LARGE and 16 < LARGE_BATCH <= 64
    chooser = ModeChooser(_cfg(pipeline="auto"))
    order = list(chooser.candidates(num_running))
    near = {m: 50.0 for m in order} | {"plain": 100.0, "sequential": 100.0 * (edge - 0.02)}
    warm = len(order) * 3
    assert set(_run(ModeChooser(_cfg(pipeline="auto")), near, warm + 24, num_running=num_running)[warm:]) == {"plain"}
    clear = near | {"sequential": 100.0 * (edge + 0.02)}
    assert set(_run(ModeChooser(_cfg(pipeline="auto")), clear, warm + 24,
                    num_running=num_running)[warm:]) == {"sequential"}


def _chosen_with_text(chooser, rounds, tokens_of, seconds_of, num_running=1):
    """Runs `rounds` rounds; the text decides the tokens (`tokens_of(i)`, round i), the mode the time."""
    chosen = []
    for i in range(rounds):
        mode = chooser.choose(num_running=num_running, drafter_up=True)
        chosen.append(mode)
        tokens = tokens_of(i) if mode != "plain" else num_running
        chooser.record(mode, tokens=tokens, seconds=seconds_of[mode], request_rounds=num_running)
    return chosen


def test_modes_that_draft_the_same_trees_are_compared_by_their_round_time_not_their_windows_text():
    """Sequential and ping-pong rounds verify the same trees. At four running requests each window
    sees other text: sequential's first window a stretch where drafts are rejected (1.5 tokens a
    request-round), the later ones one where they are accepted (4). Ping-pong's rounds are slower;
    judged on its own window's tokens it would win (4 / 1.2 against 1.5 / 1.0) and be kept."""
    n = 4
    chooser = ModeChooser(_cfg(pipeline="auto"))
    text = lambda i: n * (1.5 if i < 3 else 4.0)                  # a hard stretch, then an easy one
    times = {"sequential": 1.0, "pingpong": 1.2, "short:1": 1.0, "short:2": 1.0, "short:3": 1.0, "plain": 0.5}
    chosen = _chosen_with_text(chooser, 200, text, times, n)
    assert chosen[:3] == ["sequential"] * 3 and "pingpong" in chosen[3:12]
    kept = [m for m, k in _windows(chosen[12:]) if k > 3]   # longer than one window: kept, not measured
    assert kept and set(kept) == {"sequential"}, _windows(chosen)
    rates = chooser.rates
    assert rates["sequential"] / rates["pingpong"] == pytest.approx(1.2)   # the same tokens a round


def _one_lucky_window_of_ahead() -> list[str]:
    """One running request: sequential rounds at 100 committed tokens/s, ahead's at 100 too but for
    its second window, which measures 130 (a stretch of text: past AHEAD_EDGE); plain at 50."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    chosen, ahead_windows = [], 0
    for _ in range(600):
        mode = chooser.choose(num_running=1, drafter_up=True)
        if mode == "ahead" and (not chosen or chosen[-1] != "ahead"):
            ahead_windows += 1
        chosen.append(mode)
        rate = {"sequential": 100.0, "plain": 50.0}.get(mode, 130.0 if ahead_windows == 2 else 100.0)
        chooser.record(mode, tokens=10, seconds=10.0 / rate)
    return chosen


def test_ahead_is_kept_only_after_winning_twice_in_a_row(monkeypatch):
    """One window of ahead past the edge (its text) does not make it kept: its next window, a keep
    later, measures it at sequential's rate again, and sequential stays. Control: with
    AHEAD_CONFIRM 1, ahead is kept for a keep on the one window."""
    import router.pipeline

    assert max(n for m, n in _windows(_one_lucky_window_of_ahead()) if m == "ahead") == 3
    monkeypatch.setattr(router.pipeline, "AHEAD_CONFIRM", 1)
    assert max(n for m, n in _windows(_one_lucky_window_of_ahead()) if m == "ahead") > 3


def test_ahead_is_judged_by_what_it_commits():
    """A hit's tree was drafted before the verdict's target features were known: with a real head
    ahead commits less a round than sequential (3.4 against 3.9 tokens) in rounds a little faster
    (0.92 against 1.0). Judged by its own rounds it measures below sequential, which is kept;
    pooled with sequential's rounds (the same trees, which they are not) it would be kept."""
    chooser = ModeChooser(_cfg(pipeline="auto"))
    chosen = []
    for _ in range(120):
        mode = chooser.choose(num_running=1, drafter_up=True)
        chosen.append(mode)
        tokens = {"sequential": 3.9, "ahead": 3.4, "plain": 1.0}[mode]
        chooser.record(mode, tokens=tokens, seconds={"sequential": 1.0, "ahead": 0.92, "plain": 0.5}[mode])
    kept = [m for m, k in _windows(chosen[9:]) if k > 3]
    assert kept and set(kept) == {"sequential"}, _windows(chosen)
    rates = chooser.rates
    assert rates["ahead"] == pytest.approx(3.4 / 0.92) and rates["sequential"] == pytest.approx(3.9)


def test_ahead_is_kept_over_sequential_only_where_it_measured_ahead_edge_faster():
    """Within AHEAD_EDGE of sequential, sequential is kept (a near tie at one request is as often
    the windows' text); a clear win keeps ahead; and ahead's edge is over the full kind only: over
    plain it needs plain's edge alone."""
    from router.pipeline import AHEAD_EDGE, PLAIN_EDGE

    order = ["sequential", "ahead", "plain"]
    near = {"sequential": 100.0, "ahead": 100.0 * (AHEAD_EDGE - 0.03), "plain": 50.0}
    assert set(_run(ModeChooser(_cfg(pipeline="auto")), near, 9 + 24, num_running=1)[9:]) == {"sequential"}
    # A clear win keeps ahead once confirmed: the first sweep's win keeps sequential for a keep, the
    # window of ahead after it wins again.
    clear = near | {"ahead": 100.0 * (AHEAD_EDGE + 0.03)}
    chosen = _run(ModeChooser(_cfg(pipeline="auto")), clear, 9 + 24 + 3 + 24, num_running=1)
    assert chosen[9:33] == ["sequential"] * 24 and set(chosen[33:]) == {"ahead"}
    # Sequential far behind plain: ahead just past plain's edge is kept, plain's edge the only one.
    over_plain = {"sequential": 40.0, "ahead": 100.0 * (PLAIN_EDGE + 0.02), "plain": 100.0}
    chosen = _run(ModeChooser(_cfg(pipeline="auto")), over_plain, 9 + 24 + 3 + 24, num_running=1)
    assert chosen[9:33] == ["plain"] * 24 and set(chosen[33:]) == {"ahead"}
    assert order == list(ModeChooser(_cfg(pipeline="auto")).candidates(1))


def test_one_stalled_round_in_a_window_does_not_decide_the_mode():
    """A round that captured a CUDA graph (60 times a round's time) in speculation's window:
    left out, so speculation (3 tokens a round in 1.0 s) stays ahead of plain (1 in 0.5 s)."""
    cfg = _cfg(pipeline="auto", mode_window=9)
    chooser = ModeChooser(cfg)
    chosen = []
    for i in range(27 + 40):
        mode = chooser.choose(num_running=1, drafter_up=True)
        chosen.append(mode)
        seconds = {"sequential": 1.0, "ahead": 1.1, "plain": 0.5}[mode] * (60 if i == 4 else 1)
        chooser.record(mode, tokens=1 if mode == "plain" else 3, seconds=seconds)
    assert chosen[4] == "sequential"
    assert set(chosen[27:]) == {"sequential"}


def test_when_drafts_start_to_be_accepted_the_first_window_of_speculation_shows_it():
    """At 64 running, drafts first never accepted (a speculating round commits a token a request,
    like plain, in a round 2.5 times as long): plain is kept, and speculation, far below it, is
    measured only every fourth time between keeps. Then the text changes and drafts are accepted
    (3.3 tokens a request-round: 1.3 times plain's rate). The first window that measures
    sequential again is evidence enough at this batch (YIELD_REQUEST_ROUNDS): sequential is kept
    from there on, instead of after the several more windows it would take to outweigh the old
    ones."""
    from router.pipeline import YIELD_REQUEST_ROUNDS

    n = 64
    chooser = ModeChooser(_cfg(pipeline="auto"))
    times = {"sequential": 2.5, "pingpong": 4.0, "short:1": 4.0, "short:2": 4.0, "plain": 1.0}
    change = 15 + 24 + 48 + 96 * 4
    chosen = _chosen_with_text(chooser, change + 4 * 100 * 3, lambda i: n * (1.0 if i < change else 3.3), times, n)
    assert chosen[change - 1] == "plain"
    after = _windows(chosen[change:])
    first = next(k for k, (m, _) in enumerate(after) if m == "sequential")
    assert 2 * n >= YIELD_REQUEST_ROUNDS, "a window (its first round left out) holds this much evidence"
    keeps = [m for m, rounds in after[first + 1:] if rounds > 3]    # the others: one window between keeps
    assert keeps and set(keeps) == {"sequential"}, after


def test_a_keep_ends_after_max_keep_seconds_however_many_windows_it_was_given():
    """Slow rounds (a large batch): a keep of up to 32 windows would last minutes; it ends after
    `max_keep_seconds`, and another candidate is measured."""
    chooser = ModeChooser(_cfg(pipeline="auto", max_keep_seconds=4.0))
    order = ["sequential", "pingpong", "short:1", "short:2", "plain"]
    rates = {m: 130.0 for m in order} | {"plain": 150.0}          # every other one near
    round_s = 4.0 / 10
    chosen = []
    for _ in range(15 + 60):
        mode = chooser.choose(num_running=64, drafter_up=True)
        chosen.append(mode)
        chooser.record(mode, tokens=round(rates[mode] * round_s), seconds=round_s, request_rounds=64)
    keeps = [rounds for m, rounds in _windows(chosen[15:]) if m == "plain"]
    assert len(keeps) >= 3 and max(keeps[:-1]) <= 11, _windows(chosen[15:])   # 10 rounds, and float sums


def test_at_one_request_a_window_far_from_the_pool_restarts_it():
    """At one running request the pool spans 16 windows. Drafts accepted (3.3 tokens a round in
    rounds 1.5 times plain's): sequential kept. Then a stretch where they are not (1.2 a round):
    the kept rounds fill the pool with it and plain takes over; sequential, now far below plain,
    is measured only every fourth time. When drafts are accepted again, the first window of
    sequential commits over YIELD_CHANGE times the pool and restarts it: sequential is kept from
    there, not after the pool has turned over window by window."""
    from router.pipeline import YIELD_CHANGE

    assert 3.3 > YIELD_CHANGE * 1.2
    chooser = ModeChooser(_cfg(pipeline="auto"))
    times = {"sequential": 1.5, "ahead": 1.6, "plain": 1.0}
    hard, easy = 9 + 24 + 3 + 48, 9 + 24 + 3 + 48 + 600
    text = lambda i: 1.2 if hard <= i < easy else 3.3
    chosen = _chosen_with_text(chooser, easy + 400, text, times)
    assert chosen[hard - 1] == "sequential" and chosen[easy - 1] == "plain"
    after = _windows(chosen[easy:])
    first = next(k for k, (m, _) in enumerate(after) if m == "sequential")
    keeps = [m for m, rounds in after[first + 1:] if rounds > 3]
    assert keeps and set(keeps) == {"sequential"}, after

    varied = ModeChooser(_cfg(pipeline="auto"))   # the control: text within YIELD_CHANGE pools
    _chosen_with_text(varied, 9 + 24 + 3, lambda i: 2.5 if (i // 3) % 2 else 3.5, times)
    assert len(varied._state.yields["full"]) > 3


def test_once_drafts_are_accepted_a_shallow_windows_yield_sends_the_deeper_modes_to_be_measured_again():
    """At 16 running (one window is a whole pool), drafts first never accepted: every drafting
    kind commits a token a request-round, plain (four chained steps a round) four in rounds twice
    sequential's, so plain is kept. Then drafts are accepted: full trees commit 3.2 a
    request-round, short:2 2.4, short:1 1.8; sequential is then 1.6 times plain. After plain's
    keep the fastest speculating mode by the old rates is short:1 (the shortest rounds): its window
    commits 1.8 against full trees' stale 1.0, which a deeper kind cannot be (DEPTH_SLACK), so full
    trees and short:2 are measured again and sequential is kept, within a few windows of that
    keep, not FAR_EVERY keeps later."""
    n = 16
    chooser = ModeChooser(_cfg(pipeline="auto"))
    times = {"sequential": 1.0, "pingpong": 1.6, "short:1": 0.8, "short:2": 0.9, "plain": 2.0}
    accepted = {"sequential": 3.2, "pingpong": 3.2, "short:1": 1.8, "short:2": 2.4}
    change = 15 + 24
    chosen = []
    for i in range(change + 24 * 3 + 60):
        mode = chooser.choose(num_running=n, drafter_up=True)
        chosen.append(mode)
        per = 4.0 if mode == "plain" else (1.0 if i < change else accepted[mode])
        chooser.record(mode, tokens=round(per * n), seconds=times[mode], request_rounds=n)
    assert chosen[change - 1] == "plain"
    after = _windows(chosen[change:])
    assert after[0] == ("short:1", 3)
    assert after[1] == ("sequential", 3), after      # measured again at once
    assert chosen[-100:] == ["sequential"] * 100, after


def test_a_traffic_change_in_full_trees_sends_the_short_drafts_to_be_measured_again():
    """At 16 running, a window of full trees that commits over YIELD_CHANGE times what their pool
    held forgets the short drafts' pools too: they are measured again (one window each) before
    the next keep, instead of keeping the old text's rates."""
    from router.pipeline import YIELD_CHANGE

    n = 16
    chooser = ModeChooser(_cfg(pipeline="auto"))
    times = {"sequential": 1.0, "pingpong": 1.6, "short:1": 0.8, "short:2": 0.9, "plain": 0.5}
    for i in range(15):   # the first sweep, drafts never accepted
        mode = chooser.choose(num_running=n, drafter_up=True)
        chooser.record(mode, tokens=n, seconds=times[mode], request_rounds=n)
    assert set(chooser.rates) == set(times)
    chooser._state.start("explore", "sequential", 3)
    assert 3.0 > YIELD_CHANGE * 1.0
    for _ in range(3):    # drafts accepted from here
        chooser.record("sequential", tokens=3 * n, seconds=1.0, request_rounds=n)
    assert set(chooser.rates) == {"sequential", "pingpong", "plain"}
    assert chooser.choose(num_running=n, drafter_up=True) == "short:1"   # measured again, the first of them


def _attached_plain_run(declared: bool) -> list[str]:
    """64 running: plain rounds of 10 ms for 64 tokens, every eighth plain round sending the
    held-back catch-ups (40 ms more: 4,267 tokens/s in all, 6,400 without them; the first of
    plain's measuring window, which the window leaves out, is one of them); sequential
    rounds of 30 ms for 160 tokens (5,333 tokens/s); the short drafts and ping-pong slower.
    `declared`: the catch-ups' time is passed as upkeep (as router/loop.py does), else it is
    only part of the round's time."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=8))
    rounds = {"sequential": (160, 0.030), "pingpong": (160, 0.060), "short:1": (96, 0.020),
              "short:2": (128, 0.030), "plain": (64, 0.010)}
    chosen, plain_rounds = [], 0
    for _ in range(600):
        mode = chooser.choose(num_running=64, drafter_up=True)
        chosen.append(mode)
        tokens, seconds = rounds[mode]
        upkeep = 0.0
        if mode == "plain":
            plain_rounds += 1
            upkeep = 0.040 if plain_rounds % 8 == 1 else 0.0
        chooser.record(mode, tokens=tokens, seconds=seconds + upkeep, request_rounds=64,
                       upkeep=upkeep if declared else 0.0)
    return chosen


def test_plain_rounds_pay_for_the_catch_ups_they_hold_back():
    """Plain rounds of drafter-attached requests send the catch-ups they held back every
    BACKLOG_ROUNDS rounds. Plain's first window misses them and plain is kept; declared as
    upkeep, their time counts in the keep's rate although the slowest eighth of its rounds is
    left out, and sequential, faster than plain with them (5,333 against 4,267 tokens/s, past
    PLAIN_EDGE_LARGE), is kept after it. The control passes the same rounds without declaring
    it: the rounds that send them are the keep's slowest eighth, plain keeps measuring 6,400
    tokens/s and stays kept."""
    keeps = lambda chosen: {m for m, n in _windows(chosen[200:]) if n > 8}
    assert keeps(_attached_plain_run(declared=True)) == {"sequential"}
    assert keeps(_attached_plain_run(declared=False)) == {"plain"}


def _half_detached_run(declared: bool) -> list[str]:
    """64 running, half of them detached (admitted while plain was kept): a speculating round
    drafts for the other 32, each committing 3.5 tokens, while the detached ones commit one;
    sequential rounds of 18 ms (12,444 committed tokens/s had all 64 drafted, 7,778 as they are),
    plain rounds of 6.5 ms for 64 tokens (9,846). `declared`: the round passes what its drafted
    requests committed (as router/loop.py does)."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=8))
    rounds = {"sequential": 0.018, "pingpong": 0.030, "short:1": 0.014, "short:2": 0.016, "plain": 0.0065}
    yields = {"sequential": 3.5, "pingpong": 3.5, "short:1": 1.8, "short:2": 2.5}
    chosen = []
    for _ in range(600):
        mode = chooser.choose(num_running=64, drafter_up=True)
        chosen.append(mode)
        if mode == "plain":
            chooser.record(mode, tokens=64, seconds=rounds[mode], request_rounds=64)
            continue
        drafted = (round(32 * yields[mode]), 32)
        chooser.record(mode, tokens=drafted[0] + 32, seconds=rounds[mode], request_rounds=64,
                       drafted=drafted if declared else None)
    return chosen


def test_detached_requests_do_not_count_in_what_speculation_commits():
    """What a speculating mode commits per request-round is measured on the requests it drafted
    for: with half the batch detached, sequential's trees still commit 3.5 tokens a request-round,
    and sequential (12,444 tokens/s were all drafted, past PLAIN_EDGE_LARGE over plain's 9,846)
    is kept. Control: counted over all 64 requests, sequential measures 7,778 and plain is kept."""
    keeps = lambda chosen: {m for m, n in _windows(chosen[200:]) if n > 8}
    assert keeps(_half_detached_run(declared=True)) == {"sequential"}
    assert keeps(_half_detached_run(declared=False)) == {"plain"}


def _mostly_detached_run(declared: bool) -> list[str]:
    """64 running at a low acceptance: sequential rounds of 19 ms whose trees commit 2.3 tokens a
    request (7,747 committed tokens/s), plain rounds of 6.5 ms (9,846), so plain is kept. From
    round 300 on, 60 of the 64 are detached (plain kept them off the drafter): a sequential round
    then drafts for 4, costs 8 ms, and its 64 request-rounds a second times the 2.3 its drafted
    requests commit read 18,400. `declared`: the round passes how many were detached (as
    router/loop.py does)."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=8))
    chosen = []
    for k in range(900):
        mode = chooser.choose(num_running=64, drafter_up=True)
        chosen.append(mode)
        detached = 60 if k >= 300 else 0
        if mode == "plain":
            chooser.record(mode, tokens=64, seconds=0.0065, request_rounds=64, detached=detached)
            continue
        drafted = 64 - detached
        yields = {"sequential": 2.3, "pingpong": 2.3, "short:1": 1.5, "short:2": 1.9}
        seconds = {"sequential": 0.019, "pingpong": 0.030, "short:1": 0.013, "short:2": 0.016}[mode]
        seconds = seconds if not detached else 0.008
        got = round(drafted * yields[mode])
        chooser.record(mode, tokens=got + detached, seconds=seconds, request_rounds=64, drafted=(got, drafted),
                       detached=detached if declared else 0)
    return chosen


def test_rounds_with_many_detached_requests_do_not_time_speculation():
    """A speculating round where most requests are detached costs little more than a plain one:
    timed as its mode's speed, with what its drafted requests commit, it makes sequential look
    twice as fast as plain and sequential is kept. Declared (over DETACHED_SHARE of the round's
    requests detached), such rounds update what the drafted requests commit but not the mode's
    speed, and plain stays kept. Control: undeclared, sequential is kept after round 300."""
    keeps = lambda chosen: {m for m, n in _windows(chosen[400:]) if n > 8}   # noqa: E731
    assert keeps(_mostly_detached_run(declared=True)) == {"plain"}
    assert "sequential" in keeps(_mostly_detached_run(declared=False))


@pytest.mark.parametrize("pipeline", ["sequential", "pingpong", "ahead", "auto"])
def test_rounds_are_counted_by_the_mode_that_ran_them(pipeline):
    """RouterCounters.mode_rounds (GetServerStats, /metrics): every verify counted once, under the
    mode of its round (a ping-pong round verifies twice); a fixed pipeline runs only its own mode."""
    from tests.router.fakes import OracleVerifier, ScriptedDrafter
    from tests.router.test_router_fakes import PROMPTS, config, run, serve

    from spectandem.config import SamplingParams

    long = SamplingParams(max_tokens=200, ignore_eos=True)   # enough rounds for auto to measure several modes
    router, outs = run(serve(OracleVerifier(), ScriptedDrafter(), PROMPTS, long, cfg=config(pipeline=pipeline)))
    c = router.counters
    assert c.rounds > 0 and sum(c.mode_rounds.values()) == c.rounds, c.mode_rounds
    if pipeline != "auto":
        assert set(c.mode_rounds) == {pipeline}
    else:
        assert len(c.mode_rounds) > 1   # auto measured more than one mode
    # Without a drafter every round is plain decoding, whatever the pipeline.
    router, _ = run(serve(OracleVerifier(), None, PROMPTS, long, cfg=config(pipeline=pipeline, want_features=False)))
    assert router.counters.mode_rounds == {"plain": router.counters.rounds} and router.counters.rounds > 0


def _ahead_against_sequential(miss_seconds: float, hit_seconds: float = 0.9) -> list[str]:
    """One running request: sequential rounds commit 3.3 tokens in 1.0 s; ahead rounds commit
    the same (controlled acceptance) in `hit_seconds` where the drafter's cache hit and
    `miss_seconds` where it missed and the round drafted, one ahead round in eleven (so that some
    windows of eight rounds hold no miss, and every keep of 64 several)."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=8))
    chosen, ahead_rounds = [], 0
    for _ in range(3000):
        mode = chooser.choose(num_running=1, drafter_up=True)
        chosen.append(mode)
        seconds = {"sequential": 1.0, "plain": 0.5}.get(mode, hit_seconds)
        if mode == "ahead":
            ahead_rounds += 1
            seconds = miss_seconds if ahead_rounds % 11 == 0 else seconds
        chooser.record(mode, tokens=1 if mode == "plain" else 3.3, seconds=seconds)
    return chosen


def test_a_kept_mode_is_judged_with_its_slow_rounds_as_the_others_are():
    """Ahead's misses draft in the round (2.5 s against a hit's 0.9): its mean round is 1.045 s
    against sequential's 1.0, so sequential is kept most of the time; a window of ahead without a
    miss has it kept for one keep, whose rounds then show its misses. Leaving out the slowest
    eighth of a keep's rounds left out exactly the misses: ahead, once kept, measured 0.9 s and
    stayed kept. Control: hits of 0.8 s and misses of 1.3 s (a mean of 0.845 s, past AHEAD_EDGE)
    keep ahead most of the time."""
    def share(chosen, mode):
        later = chosen[500:]
        return later.count(mode) / len(later)

    assert share(_ahead_against_sequential(2.5), "sequential") > 0.75
    assert share(_ahead_against_sequential(1.3, hit_seconds=0.8), "ahead") > 0.75


def test_a_wave_of_arrivals_is_not_charged_to_the_window_it_lands_in():
    """The prompts a round admits are the same work in every mode: a window with enough rounds
    that admitted none is timed by those. Here plain's window takes a wave of arrivals (five slow
    rounds, each admitting); timed by all its rounds plain would measure at a sixth of
    sequential's rate and lose, timed by its two free rounds it is the faster and is kept."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=8))
    tokens, seconds = {"sequential": 3, "ahead": 3, "plain": 4}, {"sequential": 1.0, "ahead": 1.2, "plain": 0.8}
    plain_rounds = 0
    for _ in range(3 * 8):
        mode = chooser.choose(num_running=1, drafter_up=True)
        admitted = 0
        if mode == "plain":
            plain_rounds += 1
            admitted = 3 if plain_rounds in (2, 3, 5, 6, 7) else 0   # the first round is left out anyway
        chooser.record(mode, tokens=tokens[mode], seconds=seconds[mode] + (6.0 if admitted else 0.0),
                       admitted=admitted)
    assert chooser.rates_for(1)["plain"] == pytest.approx(4 / 0.8)
    assert chooser.choose(num_running=1, drafter_up=True) == "plain"


def test_a_window_that_arrivals_filled_runs_on_until_rounds_without_come():
    """A measuring window whose rounds nearly all admitted (the ends of a wave spread over its
    rounds) runs on, round by round, until it has two rounds that admitted none, and is timed by
    those; at most three times its length, then by every round. A keep never runs on."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=4))
    busy = iter([1, 1, 1, 1, 1, 0, 1, 0])   # the window's rounds, then two more until the second free one
    chosen = []
    for _ in range(8):
        mode = chooser.choose(num_running=1, drafter_up=True)
        chosen.append(mode)
        admitted = next(busy)
        chooser.record(mode, tokens=3, seconds=5.0 if admitted else 1.0, admitted=admitted)
    assert chosen == ["sequential"] * 8
    assert chooser.rates_for(1)["sequential"] == pytest.approx(3.0)
    assert chooser.choose(num_running=1, drafter_up=True) == "ahead"

    # Arrivals in all but one round to the end of its run-on: timed by every round (the first aside).
    capped = ModeChooser(_cfg(pipeline="auto", mode_window=4))
    chosen = []
    for i in range(4 + 12 + 1):
        mode = capped.choose(num_running=1, drafter_up=True)
        chosen.append(mode)
        admitted = 0 if i == 6 else 1
        capped.record(mode, tokens=3, seconds=5.0 if admitted else 1.0, admitted=admitted)
    assert chosen == ["sequential"] * 16 + ["ahead"]
    assert capped.rates_for(1)["sequential"] == pytest.approx(15 * 3 / (14 * 5.0 + 1.0))


def test_a_speed_timed_without_arrivals_is_not_replaced_by_one_timed_with_them():
    """A mode measured in a window with rounds that admitted none keeps that speed when its later
    windows have arrivals in every round: plain, measured at 4 / 0.8 tokens/s, then kept with
    every round admitting (6.8 s each), stays at 5.0 and stays kept; so does sequential, explored
    between keeps. A mode without a speed yet takes such a window's (the capped window of
    test_a_window_that_arrivals_filled_runs_on_until_rounds_without_come)."""
    chooser = ModeChooser(_cfg(pipeline="auto", mode_window=4))
    tokens, seconds = {"sequential": 3, "ahead": 3, "plain": 4}, {"sequential": 1.0, "ahead": 1.2, "plain": 0.8}
    seen, kept_busy, busy = [], [], False
    for _ in range(600):
        mode = chooser.choose(num_running=1, drafter_up=True)
        if chooser.phase == "keep" and mode == "plain":
            busy = True   # from plain's first keep on, every round of every window admits
        if busy and chooser.phase == "keep":
            kept_busy.append(mode)
        seen.append(mode)
        chooser.record(mode, tokens=tokens[mode], seconds=seconds[mode] + (6.0 if busy else 0.0),
                       admitted=1 if busy else 0)
    assert seen.count("plain") > 300 and seen.count("sequential") > 10   # explored between keeps
    rates = chooser.rates_for(1)
    assert rates["plain"] == pytest.approx(4 / 0.8)
    assert rates["sequential"] == pytest.approx(3 / 1.0)
    assert set(kept_busy) == {"plain"}


@pytest.mark.parametrize("tree_channel", [False, True], ids=["through-router", "tree-channel"])
def test_the_router_measures_speculation_on_the_drafted_requests_that_go_on(tree_channel):
    """What the router passes "auto" for a speculating round (fake engines, every draft of 4
    accepted): the tokens and request-rounds of the requests it drafted for that go on after it.
    Two requests, one of 22 tokens (its first from the prefill, then rounds of 5, the fifth cut
    to 1 by its end) and one of 40: each round drafts for both, the rounds before the short one's
    end count both (10 tokens), its last round counts the long one alone (5), and the long one's
    last round, cut to 4, counts none. The same where the trees go over the tree channel (the
    draft call then starts beside the verify)."""
    import asyncio

    from router.loop import Router
    from spectandem.config import SamplingParams
    from tests.router.fakes import OracleVerifier, ScriptedDrafter, Tokenizer, TreeBox
    from tests.router.test_router_fakes import collect, config, run

    async def main():
        box = TreeBox() if tree_channel else None
        router = Router(OracleVerifier(box), ScriptedDrafter(trees=box), Tokenizer(), config(tree_channel=tree_channel))
        records, record = [], router._modes.record

        def recorded(mode, tokens, seconds, request_rounds=1, upkeep=0.0, admitted=0, drafted=None, detached=0):
            records.append((mode, tokens, request_rounds, drafted))
            record(mode, tokens, seconds, request_rounds, upkeep, admitted, drafted, detached)
        router._modes.record = recorded
        router.start()
        try:
            reqs = [router.submit([5, 9, 2], SamplingParams(max_tokens=22, ignore_eos=True)),
                    router.submit([60, 2], SamplingParams(max_tokens=40, ignore_eos=True))]
            outs = await asyncio.gather(*(collect(r) for r in reqs))
        finally:
            await router.stop()
        return records, outs, router.counters

    records, outs, counters = run(main())
    assert (counters.posted_trees > 0) == tree_channel
    assert [len(tokens) for tokens, _, _ in outs] == [22, 40]
    assert all(mode == "sequential" for mode, *_ in records)
    # Both admitted together, their first tokens from the prefill: rounds of 5 tokens each.
    assert [(tokens, n, drafted) for _, tokens, n, drafted in records] == \
        [(10, 2, (10, 2))] * 4 + [(6, 2, (5, 1))] + [(5, 1, (5, 1))] * 2 + [(4, 1, (0, 0))]


def test_ahead_edge_comes_from_the_config():
    """RouterConfig.ahead_edge sets ahead's edge: ahead measuring 6% over sequential at one
    request is kept (after two winning windows in a row) with the in-process GPU edge of 3%, and
    not with the default 10% (the control); an edge under 1 is refused."""
    from router.pipeline import AHEAD_EDGE, AHEAD_EDGE_OWN_STREAM

    rates = {"sequential": 100.0, "ahead": 106.0, "plain": 50.0}
    rounds = 9 + 24 + 3 + 24
    own = _run(ModeChooser(_cfg(pipeline="auto", ahead_edge=AHEAD_EDGE_OWN_STREAM)), rates, rounds, num_running=1)
    assert own[9:33] == ["sequential"] * 24 and set(own[33:]) == {"ahead"}
    default = _run(ModeChooser(_cfg(pipeline="auto")), rates, rounds, num_running=1)
    assert _cfg().ahead_edge == AHEAD_EDGE
    assert {m for m, k in _windows(default[9:]) if k > 3} == {"sequential"}, _windows(default)   # keeps
    with pytest.raises(ValueError, match="ahead_edge must be >= 1.0"):
        _cfg(ahead_edge=0.95)
