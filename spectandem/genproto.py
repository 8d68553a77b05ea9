"""Regenerates the Python stubs under spectandem/v1/ from proto/spectandem/v1/*.proto.

    python -m spectandem.genproto            # rewrite the stubs
    python -m spectandem.genproto --check    # exit 1 if the committed stubs differ (CI)
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
OUT_DIR = ROOT / "spectandem" / "v1"


def generate(out_root: Path) -> list[Path]:
    from grpc_tools import protoc

    sources = sorted((PROTO_DIR / "spectandem" / "v1").glob("*.proto"))
    args = ["protoc", f"-I{PROTO_DIR}", f"--python_out={out_root}", f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}"] + [str(s) for s in sources]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    out = out_root / "spectandem" / "v1"
    (out / "__init__.py").write_text('"""Generated from proto/spectandem/v1 by `python -m spectandem.genproto`; do not edit."""\n')
    return sorted(p for p in out.iterdir() if p.is_file())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = generate(Path(tmp))
        if args.check:
            committed = sorted(p.name for p in OUT_DIR.iterdir() if p.is_file() and p.suffix in (".py", ".pyi"))
            fresh = sorted(p.name for p in files)
            drift = [n for n in fresh if n not in committed or not filecmp.cmp(OUT_DIR / n, Path(tmp) / "spectandem" / "v1" / n, shallow=False)]
            drift += [n for n in committed if n not in fresh]
            if drift:
                print(f"generated stubs differ from proto/: {drift}; run python -m spectandem.genproto", file=sys.stderr)
                return 1
            return 0
        OUT_DIR.mkdir(parents=True, exist_ok=True)
        for f in files:
            (OUT_DIR / f.name).write_bytes(f.read_bytes())
    return 0


if __name__ == "__main__":
    sys.exit(main())
