"""Plain rounds of a continuous batch whose requests end at different points: the router in this
process over the target's verifier (no drafter), a closed loop of `--concurrency` requests, each
with max_tokens drawn from `--max-tokens` ("LO-HI"; one number: every request the same, so the
batch stays in step), greedy, eos ignored, prompts from the held-out corpus. Per run it reports
the verifier calls, those that decoded fewer steps than `--plain-steps`, those a decode ahead
served (verifier/engine.py), and tokens/s.

    python benchmarks/plain_rounds.py --concurrency 64 --requests 192 --max-tokens 96-160
    python benchmarks/plain_rounds.py --device cuda --target DIR --concurrency 64 --max-tokens 96-160

An in-process diagnostic of how plain rounds go when some request ends in most calls (README,
"Plain rounds"); served figures come from benchmarks/serve_matrix.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from router.links_local import LocalVerifierLink  # noqa: E402  (after the path: run as a script)


class CountingVerifier(LocalVerifierLink):
    """The in-process verifier link, recording each call's plain steps."""

    def __init__(self, engine):
        super().__init__(engine)
        self.steps: list[tuple[int, ...]] = []

    async def verify(self, draft, plain, want_features, on_launch=None):
        self.steps.append(tuple(p.steps for p in plain))
        return await super().verify(draft, plain, want_features, on_launch)


def max_tokens_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo, hi = int(lo), int(hi or lo)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"--max-tokens must be N or LO-HI with 1 <= LO <= HI, got {text!r}")
    return lo, hi


async def one_run(spec, prompts: list[list[int]], args, seed: int) -> dict:
    from router.loop import Router
    from router.requests import RouterConfig
    from spectandem.config import SamplingParams

    link = CountingVerifier(spec.verifier)
    router = Router(link, None, spec.tokenizer,
                    RouterConfig(max_len=args.max_len, eos_token_ids=spec.eos_token_ids, lookahead=1,
                                 want_features=False, plain_steps=args.plain_steps, max_running=args.concurrency))
    rng = random.Random(seed)
    lo, hi = args.max_tokens
    budgets = [rng.randint(lo, hi) for _ in range(args.requests)]
    slots = asyncio.Semaphore(args.concurrency)
    tokens = 0

    async def request(i: int) -> None:
        nonlocal tokens
        async with slots:
            req = router.submit(prompts[i % len(prompts)], SamplingParams(max_tokens=budgets[i], ignore_eos=True))
            while True:
                ev = await req.events.get()
                tokens += len(ev.token_ids)
                if ev.finish_reason:
                    return

    used = spec.verifier.ahead_used
    router.start()
    try:
        t0 = time.perf_counter()
        await asyncio.gather(*(request(i) for i in range(args.requests)))
        seconds = time.perf_counter() - t0
    finally:
        await router.stop()
    calls = [s for s in link.steps if s]
    return {"calls": len(calls), "short_calls": sum(max(s) < args.plain_steps for s in calls),
            "ahead_served": spec.verifier.ahead_used - used, "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", default=None, help="the target checkpoint (default: the demo target)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default=None, help="default: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--concurrency", type=int, default=16, help="requests running at once (default: 16)")
    p.add_argument("--requests", type=int, default=64, help="requests per run (default: 64)")
    p.add_argument("--max-tokens", type=max_tokens_range, default=(96, 160),
                   help="each request's max_tokens: N, or LO-HI drawn per request (default: 96-160)")
    p.add_argument("--plain-steps", type=int, default=4, help="serve's --plain-steps (default: 4)")
    p.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="the verifier decodes ahead (default: on CUDA, as serve)")
    p.add_argument("--max-len", type=int, default=1024, help="context length (default: 1024)")
    p.add_argument("--repeats", type=int, default=3, help="measured runs (default: 3)")
    p.add_argument("--out", default=None, help="write the runs as JSON here too")
    args = p.parse_args()
    if args.concurrency < 1 or args.requests < 1 or args.plain_steps < 1 or args.repeats < 1:
        p.error("--concurrency, --requests, --plain-steps and --repeats must be >= 1")

    from benchmarks.bench.datasets import DEFAULT_DATASET
    from benchmarks.bench.serve import measured_prompts
    from router.local import LocalSpeculator
    from spectandem.config import SpecConfig, is_cuda
    from spectandem.demo import demo_paths

    cuda = is_cuda(args.device)
    target = args.target or str(demo_paths("none")[0])
    spec = LocalSpeculator(target, None, SpecConfig(method="none"), max_slots=args.concurrency, max_len=args.max_len,
                           dtype=args.dtype or ("bfloat16" if cuda else "float32"), device=args.device,
                           cuda_graphs=cuda, triton_attention=cuda)
    ahead = cuda if args.decode_ahead is None else args.decode_ahead
    spec.verifier.decode_ahead = ahead and spec.verifier.runner.chains_decode
    prompts = [spec.tokenizer.encode(t).ids for t in measured_prompts(DEFAULT_DATASET, min(args.requests, 512))]
    asyncio.run(one_run(spec, prompts, args, seed=-1))   # warm-up: graphs, allocator
    runs = []
    for i in range(args.repeats):
        r = asyncio.run(one_run(spec, prompts, args, seed=i))
        runs.append(r)
        print(f"run {i + 1}: {r['tokens_per_s']} tok/s, {r['calls']} verifier calls, {r['short_calls']} with fewer "
              f"than {args.plain_steps} steps, {r['ahead_served']} served by a decode ahead", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"command": " ".join(sys.argv), "decode_ahead": spec.verifier.decode_ahead,
                                              "runs": runs}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
