"""What a user reads from the command line: every option's help shows its default, `--version`,
and user errors as one line on stderr (exit code 2 or 1), never a traceback."""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from spectandem.cli import build_parser
from spectandem.service_args import shows_default

ROOT = Path(__file__).resolve().parents[2]


def _parsers():
    """(name, parser) of `spectandem` and each of its subcommands, and of python -m verifier|drafter."""
    from spectandem.service_args import HelpFormatter, add_drafter_args, add_verifier_args

    def walk(name, parser):   # subcommands of subcommands too (`spectandem bench serve`)
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    yield from walk(f"{name} {sub}", p)

    yield from walk("spectandem", build_parser())
    for name, add in (("verifier", add_verifier_args), ("drafter", add_drafter_args)):
        p = argparse.ArgumentParser(prog=f"python -m {name}", formatter_class=HelpFormatter)
        add(p)
        yield f"python -m {name}", p


def _shown(default) -> str:
    return ",".join(map(str, default)) if isinstance(default, (tuple, list)) else str(default)


@pytest.mark.parametrize("name,parser", list(_parsers()), ids=lambda x: x if isinstance(x, str) else "")
def test_every_option_shows_its_default(name, parser):
    formatter = parser._get_formatter()
    missing = []
    for action in parser._actions:
        if not action.help and action.option_strings and action.help is not argparse.SUPPRESS:
            missing.append(f"{'/'.join(action.option_strings)}: no help")
            continue
        if not shows_default(action):
            continue
        text = formatter._expand_help(action)
        if "default" not in text or (_shown(action.default) not in text and str(action.default) not in text):
            missing.append(f"{'/'.join(action.option_strings)} (default {action.default!r}): {text!r}")
    assert not missing, f"{name}: options without help or whose help does not show the default:\n" + "\n".join(missing)
    parser.format_help()   # every help string formats


def test_the_package_main_modules_use_the_formatter():
    for role in ("verifier", "drafter"):
        out = subprocess.run([sys.executable, "-m", role, "--help"], cwd=ROOT, capture_output=True, text=True,
                             timeout=120)
        assert out.returncode == 0, out.stderr
        assert "(default: 8)" in " ".join(out.stdout.split()), out.stdout   # --max-slots


def _cli(*argv, timeout=180):
    return subprocess.run([sys.executable, "-m", "spectandem.cli", *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def test_version():
    from importlib.metadata import version

    out = _cli("--version")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"spectandem {version('spectandem')}"


def _one_line_error(out, *needles):
    assert out.returncode in (1, 2), (out.returncode, out.stdout, out.stderr)
    assert "Traceback" not in out.stderr, out.stderr
    lines = [line for line in out.stderr.splitlines() if "error" in line.lower()]
    assert len(lines) == 1, out.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_missing_checkpoint_is_one_line(tmp_path):
    out = _cli("generate", "hi", "--method", "none", "--target", str(tmp_path / "nowhere"))
    _one_line_error(out, "nowhere", "not a directory")
    out = _cli("generate", "hi", "--method", "none", "--target", str(tmp_path))   # a directory without config.json
    _one_line_error(out, "config.json")


def test_folder_for_a_file_is_one_line(tmp_path):
    out = _cli("serve", "--method", "none", "--backend", "local", "--port", "0", "--tls-cert", str(tmp_path),
               "--tls-key", str(tmp_path))
    _one_line_error(out, str(tmp_path))


@pytest.mark.parametrize("flag", ["--port", "--http-port", "--metrics-port"])
def test_port_in_use_is_one_line(flag):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["serve", "--method", "none", "--backend", "local", "--host", "127.0.0.1", "--port", "0",
                "--max-len", "128"]
        argv[argv.index("--port") if flag == "--port" else len(argv):] = []
        out = _cli(*argv, *([] if flag == "--port" else ["--port", "0"]), flag, str(port))
    _one_line_error(out, str(port))


def _serve_start_stderr(*flags: str) -> str:
    """Starts `spectandem serve --backend local` (its ports free ones), waits until it serves,
    stops it with Ctrl-C -> what it wrote to stderr."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "spectandem.cli", "serve", "--backend", "local", "--port", "0",
                             "--http-port", "0", "--metrics-port", "0", "--max-len", "128", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ready = proc.stdout.readline()
        assert ready.startswith("spectandem serving"), ready
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            _, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            # Still up two minutes after Ctrl-C: every thread's stack (serve's SIGUSR2 handler)
            # goes with the failure.
            proc.send_signal(signal.SIGUSR2)
            time.sleep(2)
            proc.kill()
            _, err = proc.communicate()
            raise AssertionError(f"serve did not stop within 120 s of SIGINT; its stderr:\n{err[-20000:]}") from None
    return err


def test_serve_reports_its_start():
    """serve says what it is doing while it starts (stderr), then where it serves (stdout)."""
    err = _serve_start_stderr("--method", "none")
    from spectandem.demo import demo_paths

    assert f"spectandem serve: loading target {demo_paths('none')[0]} in this process" in err, err


def test_serve_prints_both_kv_capacities():
    """On the CPU too: one start-up line with each side's KV pool (the verifier's: every slot at
    full context, 2 x blocks_for(129, 16) = 18 blocks); and the tree it drafts."""
    import re

    err = _serve_start_stderr("--method", "eagle3", "--max-running", "2")
    line = re.search(r"spectandem serve: verifier KV cache: 288 tokens \(18 blocks of 16\), "
                     r"drafter KV cache: (\d+) tokens \((\d+) blocks of 16\)\n", err)
    assert line is not None, err
    assert int(line[1]) == 16 * int(line[2]) and int(line[2]) >= 18
    # The demo EAGLE-3 head's config states 5 draft tokens a round: serve drafts that deep unless told.
    assert "(tree depth 5, topk 1, 6 nodes verified a round)" in err, err
