"""Where the embedded demo pair lives: models/demo in the source tree, or the copy installed
under <prefix>/share/spectandem/demo."""

from __future__ import annotations

import sys
from pathlib import Path

DEMO_DRAFTS = {"eagle3": "eagle3", "eagle": "eagle", "draft-model": "draft-lm"}


def demo_dir() -> Path:
    for candidate in (Path(__file__).resolve().parent.parent / "models" / "demo",
                      Path(sys.prefix) / "share" / "spectandem" / "demo"):
        if (candidate / "target" / "config.json").is_file():
            return candidate
    raise ValueError("the demo pair was not found (looked in models/demo next to the package and "
                     f"{Path(sys.prefix) / 'share/spectandem/demo'}); pass --target and --draft")


def demo_paths(method: str) -> tuple[Path, Path | None]:
    """(target dir, draft dir or None) of the demo pair for a method."""
    root = demo_dir()
    sub = DEMO_DRAFTS.get(method)
    return root / "target", (root / sub if sub else None)

