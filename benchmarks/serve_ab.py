"""Two `spectandem serve` configurations side by side on one machine, measured in alternation:
both servers start (each with its share of the GPU's memory), learn the prompts (controlled
acceptance), then `spectandem bench serve` runs go to A, B, A, B, ... at each concurrency, so
that the machine's drift falls on both arms alike. Requests are greedy: every run's outputs must
equal arm A's first run's at that concurrency (`exact`), whatever the arms change.

    python benchmarks/serve_ab.py --pair llama8b --workdir /tmp/w --rate 0.8 --concurrency 1,16 --repeats 3 \\
        --a "--backend local" --b "--backend local --draft-on-verdict" --out ab.json

`--a-tree DIR` serves arm A from another checkout (the base of a change), arm B from this one.
Each arm's serve arguments follow the pair's (`--target`, `--draft`, `--benchmark-acceptance-rate`,
`--gpu-memory-utilization` of `--memory-share`). Prints a row a run (output tokens/s, accept length,
ITL p50/p99, exact) and each arm's mean; `--out` holds every run's figures; exits 1 where a run's
outputs differ.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.serve_matrix import (ROOT, Server, bench_serve, learn_prompts, machine, outputs_of,  # noqa: E402
                                     write_llama8b_pair)
from router.serve import free_port  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair", choices=("llama8b", "demo"), default="llama8b")
    ap.add_argument("--workdir", default="/tmp/serve-ab", help="where the 8B-shaped pair is written (kept)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rate", type=float, default=0.8, help="controlled acceptance rate (llama8b pair)")
    ap.add_argument("--concurrency", default="1")
    ap.add_argument("--prompts-per-slot", type=int, default=8)
    ap.add_argument("--min-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3, help="measured runs of each arm at each concurrency")
    ap.add_argument("--a", required=True, help="arm A's serve arguments")
    ap.add_argument("--b", required=True, help="arm B's serve arguments")
    ap.add_argument("--a-tree", type=Path, default=ROOT,
                    help="a checkout of spectandem whose code serves arm A (default: this one): two trees of the "
                         "code A/B'd, e.g. `git worktree add /tmp/base BASE`")
    ap.add_argument("--memory-share", type=float, default=0.42, help="each server's --gpu-memory-utilization")
    ap.add_argument("--start-timeout", type=float, default=300)
    ap.add_argument("--out")
    args = ap.parse_args()

    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    base: list[str] = ["--device", args.device]
    if args.pair == "llama8b":
        work = Path(args.workdir)
        tdir, hdir, _, _ = write_llama8b_pair(work, "full", args.device, 0)
        base += ["--target", str(tdir), "--draft", str(hdir), "--benchmark-acceptance-rate", str(args.rate)]
    if args.device.startswith("cuda"):
        base += ["--gpu-memory-utilization", str(args.memory_share)]
    logs = Path(tempfile.mkdtemp(prefix="serve-ab-"))
    arms = {"A": shlex.split(args.a), "B": shlex.split(args.b)}
    servers, runs = {}, []
    try:
        for name, extra in arms.items():
            ports = ["--http-port", str(free_port()), "--metrics-port", str(free_port())]
            tree = args.a_tree if name == "A" else ROOT
            servers[name] = Server(base + ports + extra, logs / f"serve-{name}.log", args.start_timeout, tree)
            print(f"arm {name} up in {servers[name].start_s:.0f} s: {shlex.join(extra)} ({tree})", flush=True)
        n_learn = max(args.min_prompts, args.prompts_per_slot * max(concurrency))
        for name, server in servers.items():
            learn_prompts(server.port, max(concurrency), n_learn, args.max_tokens, None, logs, name)
        for c in concurrency:
            n = max(args.min_prompts, args.prompts_per_slot * c)
            for name, server in servers.items():   # auto's first windows at this batch size, unmeasured
                bench_serve(server.port, c, n, args.max_tokens, 0, None, logs / f"{name}-settle-c{c}.json")
            first = None
            for k in range(args.repeats):
                for name, server in servers.items():
                    res = bench_serve(server.port, c, n, args.max_tokens, c, None, logs / f"{name}-c{c}-{k}.json")
                    row = {"arm": name, "concurrency": c, "repeat": k,
                           "output_tokens_per_s": round(res["output_throughput"], 1),
                           "accept_length": res.get("acceptance_length"),
                           "itl_ms_p50": res.get("p50_itl_ms"), "itl_ms_p99": res.get("p99_itl_ms"),
                           "mode_rounds": (res.get("server_counters") or {}).get("mode_rounds"),
                           "early_tree_rounds": (res.get("server_counters") or {}).get("early_tree_rounds")}
                    outs = outputs_of(res)
                    first = outs if first is None else first
                    row["exact"] = len(outs) == n and outs == first
                    runs.append(row)
                    print(f"c={c} {name} #{k}: {row['output_tokens_per_s']:8.1f} tok/s, accept {row['accept_length']}, "
                          f"itl p50/p99 {row['itl_ms_p50']}/{row['itl_ms_p99']}, exact {row['exact']}, rounds "
                          f"{row['mode_rounds']} (early trees {row['early_tree_rounds']})", flush=True)
            means = {name: statistics.mean(r["output_tokens_per_s"] for r in runs
                                           if r["arm"] == name and r["concurrency"] == c) for name in arms}
            print(f"c={c} mean: A {means['A']:.1f}, B {means['B']:.1f} tok/s (B/A {means['B'] / means['A']:.3f})",
                  flush=True)
    finally:
        for server in servers.values():
            server.stop()
    if args.out:
        Path(args.out).write_text(json.dumps({"gpu": machine(args.device), "command": shlex.join(sys.argv),
                                              "arms": {"A": args.a, "B": args.b},
                                              "trees": {"A": str(args.a_tree), "B": str(ROOT)}, "runs": runs}, indent=1) + "\n")
    if not all(r["exact"] for r in runs):
        print("outputs differ between runs: not every run served the same greedy tokens", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
