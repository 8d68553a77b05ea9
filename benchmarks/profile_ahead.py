"""What one chain draft ahead (drafter/ahead_chains.py) costs on the 8B-shaped EAGLE-3 head, next
to the drafter's other calls, one request at `--context` committed tokens:

    catch_up    EagleProposer.catch_up of `--pairs` new pairs (a hit's deferred catch-up)
    chain       EagleProposer.propose, an argmax chain of --steps tokens (a miss's draft)
    ahead       EagleProposer.ahead_chains over a chain of --steps tokens, width --width
    replay      the ahead graph's replay alone (no inputs built, no copy back)
    head step   one eager head step (a forced-chain step outside any graph)

each the median of --repeats calls, synchronized; then the CUDA kernels of --profile replays of the
ahead graph (torch.profiler), the heaviest first.

    python benchmarks/profile_ahead.py [--context 320] [--steps 4] [--width 5] [--pairs 4]
    python benchmarks/profile_ahead.py --scale tiny      # a smoke test on the CPU
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from drafter.proposers import DraftRequest, EagleProposer
from benchmarks.bench.llama8b import SHAPES, llama8b_spec, random_eagle3_head, random_target
from spectandem.config import SamplingParams, SpecConfig


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def _median_ms(fn, device: str, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(1000 * (time.perf_counter() - t0))
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=320)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--width", type=int, default=5)
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--profile", type=int, default=10)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--scale", choices=("full", "tiny"), default="full")
    args = ap.parse_args()
    device, dtype = ("cuda", torch.bfloat16) if args.scale == "full" else ("cpu", torch.float32)
    model = random_target(llama8b_spec(args.scale), device, dtype, 0)
    head = random_eagle3_head(model, SHAPES[args.scale]["draft_vocab_size"], device, dtype, 0)
    cfg = SpecConfig(method="eagle3", num_steps=args.steps, topk=1, num_draft_tokens=args.steps + 1,
                     ahead_width=args.width)
    prop = EagleProposer(head, cfg, max_slots=2, max_len=args.context + 256, cuda_graphs=device == "cuda")
    g = torch.Generator().manual_seed(0)
    vocab = head.spec.vocab_size
    req = DraftRequest("r", torch.randint(0, vocab, (args.context,), generator=g).tolist(), SamplingParams(), 0, False)
    feats = lambda n: torch.randn(n, head.spec.feature_size, generator=g).to(device, dtype)
    prop.catch_up([req], [req.committed_len - 1], [feats(req.committed_len - 1)])
    extra = torch.randint(0, vocab, (args.pairs,), generator=g).tolist()
    pair_feats = feats(args.pairs)

    def catch_up():   # the same pairs each time: trimmed back, absorbed again
        prop.cache_len["r"] -= args.pairs
        prop.catch_up([req], [args.pairs], [pair_feats])

    req.token_ids.extend(extra)
    prop.catch_up([req], [args.pairs], [pair_feats])
    chain = prop.propose([req]).token_ids.tolist()
    rows = {
        "catch_up": _median_ms(catch_up, device, args.repeats),
        "chain": _median_ms(lambda: prop.propose([req]), device, args.repeats),
        "ahead": _median_ms(lambda: prop.ahead_chains([req], chain, args.width), device, args.repeats),
    }
    graphs = prop.ahead_graphs
    if graphs.graph:
        graph = next(iter(graphs._captured.values()))[2]
        rows["replay"] = _median_ms(graph.replay, device, args.repeats)
    slot = torch.tensor([prop.slots.of["r"]], device=device)
    base = prop.cache_len["r"]
    step = lambda: head.run(torch.tensor([[chain[0][0]]], device=device), prop.last_hidden["r"][None, None],
                            torch.tensor([[base]], device=device), prop.cache.batch(slot, torch.tensor([[base]], device=device), base + 1),
                            torch.ones(1, 1, base + 1, dtype=torch.bool, device=device),
                            torch.zeros(1, 1, dtype=torch.long, device=device))
    with torch.no_grad():
        rows["head step"] = _median_ms(lambda: head.logits(step()), device, args.repeats)
    print(f"context {args.context}, chain of {args.steps}, width {args.width}, {args.pairs} catch-up pairs")
    for k, v in rows.items():
        print(f"  {k:<10} {v:8.3f} ms")
    if graphs.graph and args.profile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.profile):
                graph.replay()
            _sync(device)
        print(f"\nCUDA kernels of {args.profile} replays of the ahead graph")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=args.top, max_name_column_width=60))


if __name__ == "__main__":
    main()
