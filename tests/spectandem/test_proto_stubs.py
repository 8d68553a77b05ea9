"""The generated stubs under spectandem/v1 are exactly what proto/ generates (CI fails on drift),
and every field of the contract carries a comment."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_stubs_match_proto():
    out = subprocess.run([sys.executable, "-m", "spectandem.genproto", "--check"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_every_field_is_commented():
    for proto in sorted((ROOT / "proto" / "spectandem" / "v1").glob("*.proto")):
        lines = proto.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"\s*(optional |repeated )?[\w.]+ \w+ = \d+;", line):
                assert lines[i - 1].strip().startswith("//"), f"{proto.name}:{i + 1} has no comment: {line.strip()}"
