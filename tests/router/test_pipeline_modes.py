"""The pipeline-mode chooser (pure router logic): measures each mode over a window and keeps the
fastest; fixed modes are honoured; too few requests or no drafter mean sequential."""

from router.pipeline import ModeChooser, SpeculationSwitch
from router.requests import RouterConfig


def _cfg(**kw):
    return RouterConfig(max_len=256, eos_token_ids=(0,), lookahead=5, want_features=True, mode_window=3, **kw)


def _run(chooser, rates, rounds):
    chosen = []
    for _ in range(rounds):
        mode = chooser.choose(num_running=8, drafter_up=True)
        chosen.append(mode)
        chooser.record(mode, tokens=int(rates[mode] * 10), seconds=10.0)
    return chosen


def test_auto_measures_every_mode_then_keeps_the_fastest():
    for fastest in ("sequential", "pingpong", "plain"):
        rates = {"sequential": 100.0, "pingpong": 100.0, "plain": 100.0, fastest: 150.0}
        chosen = _run(ModeChooser(_cfg(pipeline="auto")), rates, 9 + 24)
        assert chosen[:9] == ["sequential"] * 3 + ["pingpong"] * 3 + ["plain"] * 3
        assert set(chosen[9:]) == {fastest}


def test_fixed_modes_and_small_batches():
    assert ModeChooser(_cfg(pipeline="sequential")).choose(8, True) == "sequential"
    assert ModeChooser(_cfg(pipeline="pingpong")).choose(8, True) == "pingpong"
    assert ModeChooser(_cfg(pipeline="pingpong")).choose(8, False) == "sequential"   # no drafter
    assert ModeChooser(_cfg(pipeline="auto")).choose(3, True) == "sequential"         # < 2 micro-batches of 2


def test_speculation_switch_turns_off_on_low_acceptance_only():
    switch = SpeculationSwitch(_cfg(adaptive_window=4, adaptive_off_rounds=10))
    for n in (3, 2, 4, 3):
        switch.observe(n, round_number=5)
    assert not switch.off(6)
    for _ in range(4):
        switch.observe(0, round_number=20)
    assert switch.off(21) and switch.off(29) and not switch.off(30)
