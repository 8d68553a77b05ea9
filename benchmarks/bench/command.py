"""`spectandem bench`: speed of the engines on the machine at hand, one run, a table, JSON and a PNG.

Sections (`--sections`, all by default):
- demo: the trained demo pair (real acceptance), per method and mode: batch-1 latency (ms per
  output token, tokens/s, mean accept length) and throughput over batch sizes
  (benchmarks/bench/demo.py);
- hf: transformers' own greedy `generate` on the demo target at batch 1;
- assisted: transformers' assisted generation, `assistant_model` = the demo draft LM, batch 1;
- temperature: the demo EAGLE-3 chain at temperatures 0..2, with sampled drafts (rejection
  sampling with their probabilities) and with greedy drafts (target-only verification);
- llama8b: plain decoding of a Llama-3.1-8B-shaped bf16 target (random weights, no download)
  against the copy-bandwidth roofline (benchmarks/bench/llama8b.py);
- controlled: on that target, an EAGLE-3 head of matching shape whose drafts the target accepts
  at a controlled rate (drafter/controlled.py), batch 1 and over batch sizes; one
  verify forward of a 16-node tree against a one-token decode step; measured against ideal;
- hf8b: transformers' own greedy `generate` on that target, batch 1 (benchmarks/bench/hf8b.py);
- router8b: the router's pipeline modes ("plain", then --router8b-modes) over that target at the
  controlled acceptance rates and --router8b-batch-sizes: "auto" must never lose to plain; with
  the head on one device and, where two GPUs exist (--router8b-drafter-device), on its own; per
  row, round_over_verify: wall time over the verifier's busy time (benchmarks/bench/router8b.py);
- pipeline: the router over in-process links per pipeline mode, and with the drafter on its own
  GPU where there are two (benchmarks/bench/pipeline.py).
The llama8b sections need CUDA at full size; `--llama8b-scale tiny` runs a small copy anywhere.

Output: `--out DIR` (or a .json path) gets bench.json (run-level results and one record per
configuration: benchmarks/bench/records.py), bench.txt (the printed table) and bench.png
(benchmarks/bench/plot.py, with matplotlib; `--plot-from bench.json` draws it later elsewhere).
The default run takes about 4 minutes on an H200.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from benchmarks.bench.demo import DEMO_MODES, TEMPERATURES
from benchmarks.bench.records import sync
from spectandem.config import GpuPaths

SECTIONS = ("demo", "hf", "assisted", "llama8b", "hf8b", "controlled", "router8b", "temperature", "pipeline")


def copy_bandwidth(device: str) -> float:
    """The device's memory copy bandwidth in bytes/s, counting bytes read and written: a 1 GiB
    copy on a GPU, 256 MiB in host memory on a CPU (torch's own copy, its threads)."""
    import torch

    x = torch.ones(1 << (30 if device.startswith("cuda") else 28), dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 2 * x.numel() * 10 / (time.perf_counter() - t0)


def _numbers(text: str, kind, flag: str, low: float, high: float = float("inf")) -> tuple:
    try:
        values = tuple(kind(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ValueError(f"{flag}: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not low <= v <= high for v in values):
        raise ValueError(f"{flag}: need one or more values in [{low}, {high}], got {text!r}")
    return values


@dataclass(frozen=True, kw_only=True)
class BenchPlan:
    """What one run measures, checked before anything loads."""

    sections: tuple[str, ...]
    device: str
    modes: tuple[str, ...]
    batch_sizes: tuple[int, ...]
    temperatures: tuple[float, ...]
    acceptance_rates: tuple[float, ...]
    pipeline_modes: tuple[str, ...]
    pipeline_batch_sizes: tuple[int, ...]
    router8b_modes: tuple[str, ...]
    router8b_batch_sizes: tuple[int, ...]
    router8b_drafter_device: str | None      # the drafter-own-gpu rows' head device; None: no such rows
    gpu: GpuPaths = GpuPaths()       # the engines' paths in every section (the 8B plain row also runs eager)

    @staticmethod
    def from_args(args, device: str) -> "BenchPlan":
        sections = tuple(s for s in args.sections.split(",") if s)
        unknown = sorted(set(sections) - set(SECTIONS))
        if unknown or not sections:
            raise ValueError(f"--sections: unknown {unknown or sections}; choose from {', '.join(SECTIONS)}")
        modes = tuple(args.modes.split(","))
        bad = sorted(set(modes) - set(DEMO_MODES))
        if bad:
            raise ValueError(f"--modes: unknown {bad}; choose from {', '.join(DEMO_MODES)}")
        for flag in ("max_tokens", "prompts", "controlled_steps", "llama8b_steps", "llama8b_context",
                     "llama8b_prompt_len", "plain_steps"):
            if getattr(args, flag) < 1:
                raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
        needs_8b = sorted({"llama8b", "hf8b", "controlled", "router8b"} & set(sections))
        if needs_8b and args.llama8b_scale == "full" and not device.startswith("cuda"):
            raise ValueError(f"sections {', '.join(needs_8b)} at full size need a CUDA device (--device cuda); "
                             "--llama8b-scale tiny runs a small copy of them on any device")
        if args.cuda_graphs == "on" and not device.startswith("cuda"):
            raise ValueError("--cuda-graphs on needs a CUDA device")
        from spectandem.kernels import HAVE_TRITON

        # The fast path: CUDA graphs, plus the Triton paged tree attention where Triton is installed.
        graphs = device.startswith("cuda") and args.cuda_graphs != "off"
        gpu = GpuPaths(cuda_graphs=graphs, triton_attention=graphs and HAVE_TRITON)
        return BenchPlan(sections=sections, device=device, modes=modes, gpu=gpu,
                         batch_sizes=_numbers(args.batch_sizes, int, "--batch-sizes", 1),
                         temperatures=_numbers(args.temperatures, float, "--temperatures", 0.0),
                         acceptance_rates=_numbers(args.acceptance_rates, float, "--acceptance-rates", 0.0, 1.0),
                         pipeline_modes=tuple(m for m in args.pipeline_modes.split(",") if m),
                         pipeline_batch_sizes=_numbers(args.pipeline_batch_sizes, int, "--pipeline-batch-sizes", 1),
                         **_router8b_plan(args, device))


def _router8b_plan(args, device: str) -> dict:
    """The router8b fields of BenchPlan. --router8b-drafter-device: "none"; "auto" (the first
    CUDA device that is not the verifier's, where --device is CUDA and there are two, as the
    pipeline section places its drafter; else none); or a CUDA device other than the verifier's."""
    import torch

    from benchmarks.bench.router8b import check_modes

    modes = tuple(m for m in args.router8b_modes.split(",") if m)
    check_modes(list(modes), "--router8b-modes")
    if args.router8b_repeats < 1:
        raise ValueError(f"--router8b-repeats must be >= 1, got {args.router8b_repeats}")
    text, cuda = args.router8b_drafter_device, device.startswith("cuda")
    count = torch.cuda.device_count() if cuda else 0
    verifier = torch.device(device).index if cuda else None
    if cuda and verifier is None and count:
        verifier = torch.cuda.current_device()
    others = [f"cuda:{i}" for i in range(count) if i != verifier]
    if text not in ("auto", "none", *others):
        raise ValueError(f"--router8b-drafter-device: {text!r} is not a CUDA device other than the verifier's "
                         f"({device}); here: {', '.join(others) or 'none'} (or auto, none)")
    drafter = {"auto": others[0] if others else None, "none": None}.get(text, text)
    return dict(router8b_modes=modes, router8b_drafter_device=drafter,
                router8b_batch_sizes=_numbers(args.router8b_batch_sizes, int, "--router8b-batch-sizes", 1))


def add_bench(sub) -> None:
    p = sub.add_parser("bench", help="measure speed on this machine (table + JSON + PNG)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated: {', '.join(SECTIONS)}")
    p.add_argument("--modes", default=",".join(DEMO_MODES), help=f"demo modes: {', '.join(DEMO_MODES)}")
    p.add_argument("--batch-sizes", default="1,4,16,64", help="demo and controlled sweeps")
    p.add_argument("--max-tokens", type=int, default=128, help="generated tokens per request")
    p.add_argument("--prompts", type=int, default=3, help="prompts run one after the other for batch-1 rows")
    p.add_argument("--device", default=None, help="cuda when available, else cpu")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="demo pair dtype")
    p.add_argument("--seed", type=int, default=0, help="seed of the 8B sections' random weights, prompts and controlled acceptance")
    p.add_argument("--temperatures", default=",".join(str(t) for t in TEMPERATURES),
                   help="temperature section: comma-separated temperatures")
    p.add_argument("--llama8b-scale", choices=["full", "tiny"], default="full",
                   help="full: the 8B shapes (CUDA only); tiny: a small copy (any device); bf16 on CUDA, else fp32")
    p.add_argument("--llama8b-steps", type=int, default=64, help="plain decoding steps of the roofline row")
    p.add_argument("--llama8b-context", type=int, default=512, help="context of the roofline and verify-forward rows")
    p.add_argument("--llama8b-prompt-len", type=int, default=32, help="random prompt length of the controlled runs")
    p.add_argument("--acceptance-rates", default="0.6,0.8,0.9",
                   help="controlled and router8b sections: comma-separated acceptance rates of the controlled head")
    p.add_argument("--controlled-steps", type=int, default=4, help="drafts per chain in the controlled runs")
    p.add_argument("--pipeline-modes", default="plain,sequential,pingpong,ahead,auto",
                   help="router pipeline modes (those RouterConfig rejects are skipped)")
    p.add_argument("--pipeline-batch-sizes", default="4,16,64", help="pipeline section: comma-separated batch sizes")
    p.add_argument("--router8b-modes", default="sequential,auto",
                   help="router8b: modes besides plain, from sequential, ahead, pingpong, auto")
    p.add_argument("--router8b-batch-sizes", default="16,64", help="router8b: batch sizes")
    p.add_argument("--router8b-repeats", type=int, default=3,
                   help="router8b: timed batches per row; the row is the median one")
    p.add_argument("--plain-steps", type=int, default=4,
                   help="the routers' multi-step plain rounds (pipeline, router8b sections), as serve's --plain-steps")
    p.add_argument("--router8b-drafter-device", default="auto", metavar="{auto,none,cuda:N}",
                   help="router8b: also run the rows with the EAGLE-3 head on this GPU (placement drafter-own-gpu; "
                        "the one-device rows always run); auto: another GPU where --device is CUDA and there are two "
                        "or more (cuda:1 beside cuda:0), as the pipeline section does; none: one device only")
    p.add_argument("--cuda-graphs", choices=["auto", "on", "off"], default="auto",
                   help="the fast path: CUDA graphs and the Triton paged attention (auto: on CUDA); the 8B plain row is measured both ways")
    p.add_argument("--out", default="benchmarks/results/bench.json",
                   help="a directory (bench.json, .txt, .png in it) or a .json path (.txt, .png beside it)")
    p.add_argument("--plot", default=None, help="PNG path (default: beside the JSON)")
    p.add_argument("--plot-from", default=None, metavar="JSON",
                   help="only draw the PNG from an earlier run's JSON (measures nothing)")
    p.set_defaults(func=_bench)
    from benchmarks.bench.serve import add_serve_bench

    serve = p.add_subparsers(dest="bench_command", metavar="{serve}", title="subcommands",
                             description="serve: drive a running server over its public API (spectandem bench serve -h)")
    add_serve_bench(serve)
    defaults = vars(p.parse_args([]))   # this command's own options, which `bench serve` does not take
    serve.choices["serve"].set_defaults(bench_defaults=defaults)


def _llama8b(plan: BenchPlan, args, bandwidth: float) -> tuple[list[dict], dict | None]:
    """The llama8b and controlled sections on one target (built once)."""
    import torch

    from benchmarks.bench.llama8b import (ROOFLINE_CHAINS, SHAPES, ControlledRuns, bench_controlled, bench_plain_roofline,
                                          llama8b_spec, random_eagle3_head, random_target, verify_forward_times)

    device = plan.device
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    model = random_target(llama8b_spec(args.llama8b_scale), device, dtype, args.seed)
    records, verify = [], None
    if "llama8b" in plan.sections:
        records.append(bench_plain_roofline(model, device, args.llama8b_steps, args.llama8b_context, bandwidth))
        if plan.gpu.cuda_graphs:
            for chain in (0,) + ROOFLINE_CHAINS:
                records.append(bench_plain_roofline(model, device, args.llama8b_steps, args.llama8b_context,
                                                    bandwidth, gpu=plan.gpu, chain=chain))
    if "hf8b" in plan.sections:
        from benchmarks.bench.hf8b import bench_hf8b

        records.append(bench_hf8b(model, device, args.llama8b_prompt_len, args.max_tokens, args.seed))
    if {"controlled", "router8b"} & set(plan.sections):
        head = random_eagle3_head(model, SHAPES[args.llama8b_scale]["draft_vocab_size"], device, dtype, args.seed)
        verify = verify_forward_times(model, head.spec.aux_layers, device, args.llama8b_context,
                                      args.controlled_steps + 1, gpu=plan.gpu)
        slots = max(plan.batch_sizes + (plan.router8b_batch_sizes if "router8b" in plan.sections else ()))
        runs = ControlledRuns(model, head, device, slots, args.prompts, args.llama8b_prompt_len,
                              args.max_tokens, args.controlled_steps, args.seed, plan.gpu)
        if "controlled" in plan.sections:
            records += bench_controlled(runs, list(plan.acceptance_rates), list(plan.batch_sizes), verify)
        if "router8b" in plan.sections:
            from benchmarks.bench.router8b import bench_router8b

            records += bench_router8b(runs, list(plan.acceptance_rates), list(plan.router8b_modes),
                                      list(plan.router8b_batch_sizes), plan.router8b_drafter_device, args.plain_steps,
                                      verify, args.router8b_repeats)
    for r in records:
        r["scale"] = args.llama8b_scale
    return records, verify


def _measure(plan: BenchPlan, args, dtype, bandwidth: float) -> tuple[list[dict], dict]:
    """-> (records, run-level results: verify_forward, skipped_pipeline_modes)."""
    from benchmarks.bench import demo as bench_demo

    device, sections, records = plan.device, plan.sections, []
    info = {"verify_forward": None, "skipped_pipeline_modes": []}
    if "demo" in sections:
        records += bench_demo.bench_demo(list(plan.modes), list(plan.batch_sizes), args.prompts, args.max_tokens,
                                         device, dtype, plan.gpu)
    for name, assisted in (("hf", False), ("assisted", True)):
        if name in sections:
            records.append(bench_demo.bench_hf(args.prompts, args.max_tokens, device, dtype, assisted))
    if "temperature" in sections:
        records += bench_demo.bench_temperature(list(plan.temperatures), args.prompts, args.max_tokens, device,
                                                dtype, args.seed, plan.gpu)
    if {"llama8b", "hf8b", "controlled", "router8b"} & set(sections):
        more, info["verify_forward"] = _llama8b(plan, args, bandwidth)
        records += more
    if "pipeline" in sections:
        from benchmarks.bench.pipeline import bench_pipeline, split_modes

        modes, rejected = split_modes(list(plan.pipeline_modes))
        info["skipped_pipeline_modes"] = rejected
        if rejected:
            print(f"pipeline modes RouterConfig rejects, skipped: {', '.join(rejected)}")
        if modes:
            records += bench_pipeline(modes, list(plan.pipeline_batch_sizes), args.max_tokens, device, dtype,
                                      plan.gpu, args.plain_steps)
    return records, info


def _note(r: dict) -> str:
    notes = []
    if r.get("auto_mode"):
        notes.append(f"auto kept {r['auto_mode']}" + (f" ({r['detached_admissions']} admitted without the drafter)"
                                                       if r.get("detached_admissions") else ""))
    if r.get("roofline_fraction") is not None:
        notes.append(f"roofline {r['roofline_fraction']:.2f} of {r['roofline_ms']} ms")
    if r.get("temperature") is not None:
        notes.append(f"T={r['temperature']} {r['drafts']} drafts")
    if r.get("speedup") is not None:
        expect = f" (expect accept {r['expected_accept_length']})" if r.get("expected_accept_length") else ""
        notes.append(f"speedup {r['speedup']:.2f}x{expect}")
    if r.get("speedup_paired") is not None:
        notes.append(f"paired {r['speedup_paired']:.2f}x")
    if r.get("measured_over_ideal") is not None:
        notes.append(f"{r['measured_over_ideal']:.2f} of ideal {r['ideal_tokens_per_s']}/s")
    if r.get("decode_over_ideal") is not None:
        notes.append(f"decode {r['decode_over_ideal']:.2f} of ideal")
    if r.get("ahead_hits") or r.get("ahead_misses"):
        n = r["ahead_hits"] + r["ahead_misses"]
        notes.append(f"ahead hits {r['ahead_hits'] / n:.2f} (expect {r['expected_ahead_hit_rate']})")
    if len(r.get("tokens_per_s_runs") or ()) > 1:
        runs = r["tokens_per_s_runs"]
        notes.append(f"median of {len(runs)} ({min(runs):.0f}-{max(runs):.0f})")
    if r.get("matches_plain") is False:
        notes.append("OUTPUT DIFFERS FROM PLAIN")
    if r.get("rounds_per_s") is not None:
        notes.append(f"rounds/s {r['rounds_per_s']} {r.get('placement', '')}".rstrip())
    if r.get("round_over_verify") is not None:
        alone = r.get("over_verify_alone")
        notes.append(f"round/verify {r['round_over_verify']:.2f}" + (f" (alone {alone:.2f})" if alone else ""))
    if r.get("round_over_forward") is not None:
        notes.append(f"round {r['round_ms']} ms = {r['round_over_forward']:.2f}x forward")
    if r.get("target_forwards") is not None and r["method"] == "hf-assisted":
        notes.append(f"{r['target_forwards']} target forwards")
    return ", ".join(notes)


def format_table(results: dict) -> str:
    lines = [f"device {results['gpu']}, copy bandwidth {results['copy_bandwidth'] / 1e9:.1f} GB/s",
             f"{'section':<11} {'workload':<8} {'method':<21} {'mode':<17} {'batch':>5} {'a':>4} {'tokens/s':>9} "
             f"{'ms/token':>9} {'accept':>6}  notes"]
    for r in results["records"]:
        a = "" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:g}"
        lines.append(f"{r['section']:<11} {r['workload']:<8} {r['method']:<21} {r['mode']:<17} {r['batch_size']:>5} "
                     f"{a:>4} {r['tokens_per_s']:>9} {r['ms_per_token']:>9} {r['accept_length']:>6}  {_note(r)}")
    v = results.get("verify_forward")
    if v:
        lines.append(f"verify forward at context {v['context']}: decode {v['decode_ms']} ms, "
                     f"chain of {v['chain_nodes']} {v['chain_ms']} ms ({v['chain_over_decode']}x), "
                     f"16-node tree {v['tree16_ms']} ms ({v['tree16_over_decode']}x decode; "
                     f"target <= {v['target_tree16_over_decode']}x)")
    return "\n".join(lines)


def _paths(out: str, plot: str | None) -> tuple[Path, Path, Path]:
    """(JSON, table, PNG) paths for --out DIR or --out FILE.json."""
    out_path = Path(out)
    json_path = out_path if out_path.suffix == ".json" else out_path / "bench.json"
    return json_path, json_path.with_suffix(".txt"), Path(plot) if plot else json_path.with_suffix(".png")


def _bench(args) -> int:
    import torch
    import transformers

    from benchmarks.bench import plot as bench_plot

    if args.plot_from:
        if not bench_plot.have_matplotlib():
            raise ValueError("--plot-from needs matplotlib: pip install 'spectandem[bench]'")
        print(f"-> {bench_plot.draw_from(args.plot_from, args.plot)}")
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = BenchPlan.from_args(args, device)
    json_path, txt_path, png_path = _paths(args.out, args.plot)
    t0 = time.perf_counter()
    if {"router8b", "pipeline"} & set(plan.sections):   # the router and both engines in this process
        from router.local_base import DEFAULT_SWITCH_INTERVAL_S, shorten_switch_interval

        shorten_switch_interval(DEFAULT_SWITCH_INTERVAL_S)
    bandwidth = copy_bandwidth(device)
    records, info = _measure(plan, args, getattr(torch, args.dtype), bandwidth)
    gpu = torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu"
    results = {"gpu": gpu, "copy_bandwidth": bandwidth, "device": gpu, "copy_bandwidth_bytes_per_s": bandwidth,
               "cuda_graphs": plan.gpu.cuda_graphs, "dtype": args.dtype, "torch": torch.__version__,
               "transformers": transformers.__version__,
               "seconds": round(time.perf_counter() - t0, 1),
               "settings": {k: v for k, v in vars(args).items() if k not in ("func", "plot_from")},
               **info, "records": records}
    table = format_table(results)
    print(table)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(results, indent=2) + "\n")
    txt_path.write_text(table + "\n")
    print(f"-> {json_path}, {txt_path} ({results['seconds']} s)")
    if not bench_plot.plottable(results):
        print("no plot: no series over two or more batch sizes and no controlled speedups")
    elif not bench_plot.have_matplotlib():
        print(f"plot skipped: matplotlib is not installed (pip install 'spectandem[bench]'); draw it later with "
              f"spectandem bench --plot-from {json_path} --plot {png_path}")
    else:
        print(f"-> {bench_plot.draw(results, png_path)}")
    return 0
