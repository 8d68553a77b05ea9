"""The demo drafter's draft in one process, timed back to back and with its core left idle before
each draft, the way a split pair's engine waits while the other engine works: whether an idle core
computes the same call slower.

    taskset -c 1 python benchmarks/idle_core.py --idle-ms 10 --repeats 3

Each run generates `--prompts` held-out prompts one at a time (batch 1, greedy, the demo pair's
EAGLE-3 chain in this process, one torch thread) and reports the mean of DrafterEngine.draft and
of VerifierEngine.verify per call. Between each verify and the next draft the thread either goes
straight on ("back to back"), sleeps `--idle-ms` ("asleep"), spins that long ("spinning"), or
sleeps all but the last 2 ms and spins those ("asleep, then spinning"). The modes (`--modes`,
all by default) alternate within each repeat. With `--modes "back to back"`, runs beside a busy
loop on the other core against runs without tell whether the two cores contend.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402  (after the path: run as a script)

MODES = ("back to back", "asleep", "spinning", "asleep, then spinning")
SPIN_TAIL_S = 0.002


def _spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _idle(mode: str, seconds: float) -> None:
    if mode == "asleep":
        time.sleep(seconds)
    elif mode == "spinning":
        _spin(seconds)
    elif mode == "asleep, then spinning":
        time.sleep(max(0.0, seconds - SPIN_TAIL_S))
        _spin(min(seconds, SPIN_TAIL_S))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--idle-ms", type=float, default=10.0, help="the idle time before each draft (default: %(default)s)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), metavar="MODE",
                    help=f"the modes run, each one argument: {' | '.join(repr(m) for m in MODES)} (default: all)")
    args = ap.parse_args()
    modes = list(dict.fromkeys(args.modes))
    torch.set_num_threads(1)

    from benchmarks.bench.demo import _speculator
    from benchmarks.bench.records import PROMPTS
    from drafter.engine import DrafterEngine
    from spectandem.checkpoint import load_tokenizer
    from spectandem.config import SamplingParams
    from spectandem.demo import demo_paths
    from verifier.engine import VerifierEngine

    spec = _speculator("eagle3-chain", 1, "cpu", torch.float32)
    tokenizer = load_tokenizer(demo_paths("eagle3")[0])
    prompts = [tokenizer.encode(p).ids for p in PROMPTS[: args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    state = {"mode": MODES[0], "draft_s": [], "verify_s": []}
    draft, verify = DrafterEngine.draft, VerifierEngine.verify

    def timed_draft(self, *a, **k):
        t0 = time.perf_counter()
        try:
            return draft(self, *a, **k)
        finally:
            state["draft_s"].append(time.perf_counter() - t0)

    def idle_after_verify(self, *a, **k):
        t0 = time.perf_counter()
        out = verify(self, *a, **k)
        state["verify_s"].append(time.perf_counter() - t0)
        _idle(state["mode"], args.idle_ms / 1000)
        return out

    DrafterEngine.draft, VerifierEngine.verify = timed_draft, idle_after_verify

    def run(mode: str) -> tuple[float, float, int]:
        state["mode"], state["draft_s"], state["verify_s"] = mode, [], []
        for i, p in enumerate(prompts):
            spec.generate([p], [params], [f"idle-{i}"])
        mean = lambda xs: 1000 * sum(xs) / len(xs)   # noqa: E731
        return mean(state["draft_s"]), mean(state["verify_s"]), len(state["draft_s"])

    run(modes[0])   # warm-up
    print(f"the demo pair's draft and verify, ms a call, {args.idle_ms:g} ms idle before each draft where the mode idles")
    for rep in range(args.repeats):
        cells = []
        for mode in modes:
            d, v, n = run(mode)
            cells.append(f"{mode}: draft {d:.2f}, verify {v:.2f}")
        print(f"  repeat {rep + 1} ({n} drafts a run): " + "; ".join(cells))


if __name__ == "__main__":
    main()
