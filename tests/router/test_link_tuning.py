"""The in-process links' timing choices: one frozen LocalLinkTuning given by whoever builds the
links (serve's --link-tuning), read from no environment, and no process-wide setting changed by
building a link."""

import sys

import pytest

from router.links_local import LocalDrafterLink, LocalLinkTuning, LocalVerifierLink
from router.local_base import shorten_switch_interval
from router.serve import link_tuning
from spectandem.cli import build_parser


def test_settings_change_only_the_named_fields():
    t = LocalLinkTuning.from_settings(["drafter_first_s=0", "launch-missed=off", "prepare_launch=1"])
    assert t == LocalLinkTuning(drafter_first_s=0.0, launch_missed=False)
    assert LocalLinkTuning.from_settings([]) == LocalLinkTuning()


@pytest.mark.parametrize("setting", ["nope=1", "drafter_first_s", "launch_missed=maybe", "launch_first_s=soon",
                                     "drafter_first_s=-1", "switch_interval_s=inf"])
def test_bad_settings_are_refused(setting):
    with pytest.raises(ValueError):
        LocalLinkTuning.from_settings([setting])


def test_links_take_the_tuning_and_leave_the_switch_interval():
    before = sys.getswitchinterval()
    engine = object()
    tuning = LocalLinkTuning(ahead_after_miss=False, prepare_launch=False, launch_missed_early=False)
    v = LocalVerifierLink(engine, chain=True, tuning=tuning)
    d = LocalDrafterLink(engine, tuning=tuning)
    assert sys.getswitchinterval() == before
    assert (v.chains, v.prepare_launch, v.launch_missed, v.launch_missed_early) == (True, False, True, False)
    # On the CPU the holds and the drafter's early pre-ahead are off whatever the tuning says.
    assert (v.drafter_first_s, d.launch_first_s, d.ahead_after_miss) == (0.0, 0.0, False)
    assert not LocalVerifierLink(engine).chains   # chaining by default only where a CUDA stream exists


def test_switch_interval_is_the_entry_points():
    before = sys.getswitchinterval()
    try:
        shorten_switch_interval(0.0)
        assert sys.getswitchinterval() == before
        shorten_switch_interval(before * 10)
        assert sys.getswitchinterval() == before
        shorten_switch_interval(before / 10)
        assert sys.getswitchinterval() == pytest.approx(before / 10)
    finally:
        sys.setswitchinterval(before)


def test_serve_link_tuning_flag():
    parse = build_parser().parse_args
    args = parse(["serve", "--backend", "local", "--link-tuning", "launch_first_s=0", "--link-tuning",
                  "chained_verify=0"])
    assert link_tuning(args) == LocalLinkTuning(launch_first_s=0.0, chained_verify=False)
    with pytest.raises(ValueError, match="--backend local"):
        link_tuning(parse(["serve", "--backend", "grpc", "--link-tuning", "launch_first_s=0"]))
    assert parse(["serve", "--log-level", "info"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parse(["serve", "--log-level", "loud"])
