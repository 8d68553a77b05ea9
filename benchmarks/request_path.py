"""The code one greedy request runs through: `spectandem serve --backend local` in this process
(the demo pair on the CPU), one warm-up request, then one greedy request through the SDK with a
profiler hook on every thread, counting the project's functions it called (router/, drafter/,
verifier/, spectandem/; the generated stubs left out), by file.

    python benchmarks/request_path.py [--pipeline sequential] [--max-tokens 16] [--list]

It reads nothing but the call events of that one request (from the SDK's call to its last
chunk): what a newcomer following the request would have to read.

`--main-path` counts instead the functions on the request's main path: the project functions on
the stack (of the thread, or of the router's asyncio task) each time one of the landmarks runs,
the landmarks being the servicer's `Generate`, the router's `_commit`, the in-process link's
hand-off of a call to its engine thread (`_LocalLink._run`), the target's `LlamaModel.forward`
and the draft head's `DraftHead.run`: the chain from the RPC to each forward and back to the
stream, leaving out helpers that run beside it.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PARTS = ("router", "drafter", "verifier", "spectandem")


def project_file(filename: str, parts: tuple[str, ...] = PARTS) -> str | None:
    """The path relative to the repository of a source file under one of `parts` (the generated
    stubs left out); None for anything else."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    if rel.parts[0] not in parts or rel.parts[:2] == ("spectandem", "v1"):
        return None
    return str(rel)


LANDMARKS = {("router/server.py", "GenerationServicer.Generate"), ("router/loop.py", "Router._commit"),
             ("router/local_base.py", "_LocalLink._run"), ("spectandem/modeling/llama.py", "LlamaModel.forward"),
             ("drafter/heads.py", "DraftHead.run")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pipeline", default="sequential", help="serve's --pipeline (default: %(default)s)")
    ap.add_argument("--max-tokens", type=int, default=16, help="tokens of the traced request (default: %(default)s)")
    ap.add_argument("--list", action="store_true", help="print every function, by file")
    ap.add_argument("--main-path", action="store_true", help="only the functions on the main path (see above)")
    a = ap.parse_args(argv)

    sys.path.insert(0, str(ROOT))
    from tests.router.conftest import Served
    from spectandem import Client, SamplingParams

    calls: dict[str, set[str]] = defaultdict(set)
    tracing = threading.Event()

    def hook(frame, event, arg):
        if event == "call" and tracing.is_set():
            path = project_file(frame.f_code.co_filename)
            if path is None:
                return
            if not a.main_path:
                calls[path].add(frame.f_code.co_qualname)
            elif (path, frame.f_code.co_qualname) in LANDMARKS:
                f = frame
                while f is not None:
                    p = project_file(f.f_code.co_filename)
                    if p is not None:
                        calls[p].add(f.f_code.co_qualname)
                    f = f.f_back

    # On every thread the server starts (its loop, the engines' workers, gRPC's pools) and on
    # this one; it records only while the traced request runs.
    threading.setprofile(hook)
    sys.setprofile(hook)
    served = Served(["--backend", "local", "--device", "cpu", "--pipeline", a.pipeline]).wait_ready()
    try:
        with Client(served.address, timeout=120) as client:
            client.generate("def warm_up(x):", SamplingParams(max_tokens=a.max_tokens))
            time.sleep(0.5)   # the warm-up's release, in the router's turn after its last chunk
            tracing.set()
            done = client.generate("def fibonacci(n):", SamplingParams(max_tokens=a.max_tokens))
            time.sleep(0.5)   # and this one's
            tracing.clear()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        served.close()
    total = sum(len(v) for v in calls.values())
    by_part = defaultdict(int)
    for path, fns in calls.items():
        by_part[path.split("/")[0]] += len(fns)
    what = "functions on its main path" if a.main_path else "project functions"
    print(f"one greedy request ({len(done.token_ids)} tokens, pipeline {a.pipeline}, backend local): "
          f"{total} {what} in {len(calls)} files")
    print("  by folder: " + ", ".join(f"{k} {v}" for k, v in sorted(by_part.items())))
    for path in sorted(calls, key=lambda p: (-len(calls[p]), p)):
        print(f"  {len(calls[path]):4d}  {path}" + (f": {', '.join(sorted(calls[path]))}" if a.list else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
