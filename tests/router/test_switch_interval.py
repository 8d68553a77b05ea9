"""The interpreter's switch interval while the router and both engines share one process: set by
the entry points that run them so (serve --backend local, --switch-interval-ms), never by building
a link."""

import sys

import pytest

from router.links_local import LocalDrafterLink, LocalVerifierLink
from router.local_base import DEFAULT_SWITCH_INTERVAL_S, shorten_switch_interval
from router.serve import switch_interval_s
from spectandem.cli import build_parser


def test_links_leave_the_switch_interval():
    before = sys.getswitchinterval()
    LocalVerifierLink(object())
    LocalDrafterLink(object())
    assert sys.getswitchinterval() == before


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


def test_serve_switch_interval_flag():
    parse = build_parser().parse_args
    assert switch_interval_s(parse(["serve", "--backend", "local"])) == DEFAULT_SWITCH_INTERVAL_S
    assert switch_interval_s(parse(["serve", "--backend", "local", "--switch-interval-ms", "2"])) == pytest.approx(0.002)
    assert switch_interval_s(parse(["serve", "--backend", "local", "--switch-interval-ms", "0"])) == 0.0
    with pytest.raises(ValueError, match="--backend local"):
        switch_interval_s(parse(["serve", "--backend", "grpc", "--switch-interval-ms", "1"]))
    with pytest.raises(ValueError, match="--switch-interval-ms"):
        switch_interval_s(parse(["serve", "--backend", "local", "--switch-interval-ms", "-1"]))
    assert switch_interval_s(parse(["serve", "--backend", "grpc"])) == DEFAULT_SWITCH_INTERVAL_S   # unused there
    assert parse(["serve", "--log-level", "info"]).log_level == "INFO"
    with pytest.raises(SystemExit):
        parse(["serve", "--log-level", "loud"])
