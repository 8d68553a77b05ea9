"""The served-performance matrix: `spectandem serve` for each backend, driven by `spectandem bench
serve` through the public gRPC API, for plain decoding and speculation, with the engine loop of
the same models measured in the same run as the reference.

    python benchmarks/serve_matrix.py --out benchmarks/results/serve-h200.json           # one GPU
    python benchmarks/serve_matrix.py --pair demo --device cpu --concurrency 1 --out X  # the demo pair

`--pair llama8b` (default) writes a Llama-3.1-8B-shaped bf16 target with the demo tokenizer's
4,096-token vocabulary and an EAGLE-3 head of matching shape to `--workdir` (random structured
weights: benchmarks/bench/llama8b.py random_target), then serves it with `--method none` and with
the head at each controlled acceptance rate (`serve --benchmark-acceptance-rate A`: the real
head runs, its drafts are replaced by the target's own greedy tokens with probability A; the
output stays exactly the target's greedy output). `--pair demo` serves the trained demo pair
(`--method none` and `--method eagle3`, real acceptance). `--scale tiny` makes the 8B-shaped
pair small enough for a CPU (a check of the script, not a measurement).

Every server runs with serve's defaults apart from the model and the port. Where acceptance is
controlled, one pass over every prompt (longer than the measured ones) first lets the drafter
learn each prompt's greedy continuation, and a second, unmeasured, lets `--pipeline auto` see
drafts that are accepted before the measured runs. A speculating server then runs each
concurrency's prompts once unmeasured before measuring them: `--pipeline auto` measures its
candidate modes per batch size (router/pipeline.py), and a server that has served such a load
before has done so, where a first visit spends many of a short run's rounds on modes that lose.
Each bench run sends one wave of warm-up requests at its concurrency (not measured) and measures. Each record's `exact` says
whether every output equals the plain greedy output of the same prompt (the `--method none`
server of the same backend); null where the plain outputs at hand lack some of its prompts. A
server that does not come up within `--start-timeout` writes every thread's stack to its log
(serve's SIGUSR2) before it is stopped. The servers log at INFO (`--workdir`/logs/serve-*.log):
`--pipeline auto`'s choices, each with the rates it measured for every candidate mode.

Output: `--out` JSON, {"gpu", "command", "records": [...], "engine_reference": [...]}, and a table.

One matrix may take longer than one sitting allows (the device's per-command limit): `--append`
adds this invocation's records to those already in `--out` (a record of the same backend,
method, rate and concurrency is replaced; the engine reference is kept unless this invocation
measures one; `command` lists every invocation), and `--plain-outputs FILE` keeps each
backend's plain greedy outputs, so a speculating server measured in a later invocation is still
compared with them (`exact`).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from router.serve import free_port  # noqa: E402  (after the path: run as a script)

TRUTH_EXTRA = 16   # tokens the learning pass generates past the measured ones


def _numbers(text: str, kind) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


# --------------------------------------------------------------------------- the 8B-shaped pair

def write_llama8b_pair(workdir: Path, scale: str, device: str, seed: int):
    """Writes the 8B-shaped target (HF Llama format, the demo tokenizer) and an EAGLE-3 head to
    `workdir` (kept when already there for the same scale and seed) -> (target dir, head dir,
    the target model in memory, the head in memory) on `device`, bf16 on CUDA."""
    import dataclasses
    import shutil

    import torch
    from safetensors.torch import save_file

    from benchmarks.bench.llama8b import llama8b_spec, random_eagle3_head, random_target
    from drafter.loader import save_head
    from spectandem.demo import demo_paths

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    demo_target, _ = demo_paths("eagle3")
    spec = dataclasses.replace(llama8b_spec(scale), vocab_size=4096, eos_token_ids=(0,))
    target = random_target(spec, device, dtype, seed)
    draft_vocab = 2048
    head = random_eagle3_head(target, draft_vocab, device, dtype, seed)
    tdir, hdir = workdir / f"target-{scale}", workdir / f"eagle3-{scale}"
    marker = {"scale": scale, "seed": seed, "dtype": str(dtype)}
    if (workdir / "pair.json").exists() and json.loads((workdir / "pair.json").read_text()) == marker:
        return tdir, hdir, target, head
    tdir.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.detach().to("cpu", torch.bfloat16).contiguous() for k, v in target.state_dict().items()
               if k.endswith((".weight", ".bias"))}
    save_file(tensors, str(tdir / "model.safetensors"))
    r = spec.rope
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": spec.vocab_size,
        "hidden_size": spec.hidden_size, "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "hidden_act": "silu",
        "rms_norm_eps": spec.rms_norm_eps, "max_position_embeddings": spec.max_position_embeddings,
        "rope_theta": r.theta, "rope_scaling": {"rope_type": "llama3", "factor": r.factor,
                                                "low_freq_factor": r.low_freq_factor,
                                                "high_freq_factor": r.high_freq_factor,
                                                "original_max_position_embeddings": r.original_max_position},
        "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
        "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "torch_dtype": "bfloat16",
    }
    (tdir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (demo_target / name).exists():
            shutil.copy(demo_target / name, tdir / name)
    save_head(head, hdir)
    (workdir / "pair.json").write_text(json.dumps(marker))
    return tdir, hdir, target, head


def engine_reference_llama8b(target, head, device: str, rates: list[float], batch_sizes: list[int],
                             max_tokens: int, seed: int, drafter_device: str | None = None,
                             num_prompts: int = 0) -> list[dict]:
    """The engine loop (no router, no server) on the same models: plain decoding and each
    controlled rate at each batch size (benchmarks/bench/llama8b.py bench_controlled), the
    head on `drafter_device` where given. Batch 1 runs `num_prompts` prompts in turn (at least
    the largest batch's): as many as the served run at concurrency 1 measures, so that its
    accept length is an average over as many requests, not one prompt's draw."""
    from benchmarks.bench.llama8b import ControlledRuns, bench_controlled
    from spectandem.config import GpuPaths

    gpu = GpuPaths(cuda_graphs=True, triton_attention=True) if device.startswith("cuda") else GpuPaths()
    runs = ControlledRuns(target, head, device, max_slots=max(batch_sizes),
                          num_prompts=max(max(batch_sizes), num_prompts),
                          prompt_len=128, max_tokens=max_tokens, num_steps=4, seed=seed, gpu=gpu)
    if drafter_device:
        runs = runs.with_drafter_device(drafter_device)
    out = []
    for r in bench_controlled(runs, rates, batch_sizes, None):
        out.append({"method": "none" if r["method"] == "none" else "eagle3", "acceptance_rate": r["acceptance_rate"],
                    "batch_size": r["batch_size"], "tokens_per_s": r["tokens_per_s"],
                    "accept_length": r["accept_length"], "exact": r["matches_plain"]})
    return out


def engine_reference_demo(device: str, batch_sizes: list[int], max_tokens: int,
                          prompts_for: Callable[[int], list[str]]) -> list[dict]:
    """The demo pair's engine loop (router/local.py LocalSpeculator.generate): plain decoding and
    EAGLE-3 at each batch size b, greedy, `max_tokens` per request, over `prompts_for(b)` (the
    prompts the served run at concurrency b measures) in batches of b, after one warm-up batch."""
    from router.local import LocalSpeculator
    from spectandem.checkpoint import load_tokenizer
    from spectandem.config import EngineConfig, GpuPaths, SamplingParams, SpecConfig
    from spectandem.demo import demo_paths

    # On CUDA, serve's defaults: bfloat16, CUDA graphs and the Triton attention.
    gpu = dict(dtype="bfloat16", gpu=GpuPaths(cuda_graphs=True, triton_attention=True)) if "cuda" in device else {}
    out = []
    for method in ("none", "eagle3"):
        t, d = demo_paths(method)
        # Without tree fields, the tree serve drafts by default (the head's stated depth).
        spec = LocalSpeculator.from_config(EngineConfig(target_dir=str(t), draft_dir=str(d) if d else None,
                                                        spec=SpecConfig(method=method),
                                                        max_slots=max(batch_sizes),
                                                        max_len=2048, device=device, **gpu))
        tok = load_tokenizer(t)
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        for b in batch_sizes:
            ids = [tok.encode(p).ids for p in prompts_for(b)]
            groups = [ids[i: i + b] for i in range(0, len(ids), b)]
            groups = [g for g in groups if len(g) == b] or [ids[:b]]
            spec.generate(groups[0], [params] * b)   # warm-up
            t0 = time.perf_counter()
            done = [c for g in groups for c in spec.generate(g, [params] * b)]
            dt = time.perf_counter() - t0
            rounds = sum(c.stats.num_rounds for c in done)
            acc = sum(c.stats.accepted_tokens for c in done)
            out.append({"method": method, "acceptance_rate": None, "batch_size": b,
                        "tokens_per_s": round(sum(len(c.token_ids) for c in done) / dt, 1),
                        "accept_length": round((acc + rounds) / rounds, 3) if rounds else 1.0})
    return out


# --------------------------------------------------------------------------- serving

class Server:
    """`spectandem serve` in a process group of its own, until `stop`; run from `tree` (a checkout
    of spectandem: its code serves), this one by default."""

    def __init__(self, argv: list[str], log: Path, timeout: float, tree: Path = ROOT):
        self.port = free_port()
        self.argv = [sys.executable, "-m", "spectandem.cli", "serve", "--port", str(self.port), *argv]
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen(self.argv, stdout=self._out, stderr=subprocess.STDOUT, cwd=tree,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        t0 = time.monotonic()
        try:
            while "spectandem serving" not in log.read_text():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"serve exited with {self.proc.returncode}:\n{log.read_text()[-3000:]}")
                if time.monotonic() > deadline:
                    self._dump_stacks()
                    raise RuntimeError(f"serve did not come up in {timeout:.0f} s:\n{log.read_text()[-6000:]}")
                time.sleep(0.5)
        except BaseException as exc:
            # Not up: the server goes (its own session: nothing else would stop it) and, where this
            # process was told to end meanwhile (SIGTERM: SystemExit), its log's end is printed.
            self.stop()
            if not isinstance(exc, RuntimeError):
                print(f"[serve_matrix] serve was starting for {time.monotonic() - t0:.0f} s; its log ends:\n"
                      f"{log.read_text()[-3000:]}", file=sys.stderr, flush=True)
            raise
        self.start_s = time.monotonic() - t0

    def _dump_stacks(self) -> None:
        """Has a server that did not come up write every thread's stack to its log (serve's
        faulthandler on SIGUSR2), so that the log says where it was."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGUSR2)
            time.sleep(2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def bench_serve(port: int, concurrency: int, num_prompts: int, max_tokens: int, warmups: int, dataset: str | None,
                out: Path, during=None) -> dict:
    """One `spectandem bench serve` run over gRPC -> its JSON (outputs saved); `during()`, when
    given, is called while it runs."""
    argv = [sys.executable, "-m", "spectandem.cli", "bench", "serve", "--address", f"localhost:{port}",
            "--max-concurrency", str(concurrency), "--num-prompts", str(num_prompts), "--max-tokens",
            str(max_tokens), "--ignore-eos", "--num-warmups", str(warmups), "--save-outputs",
            "--result-file", str(out)] + (["--dataset", dataset] if dataset else [])
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            if during is not None:
                during()
            proc.wait(1800)
        finally:
            if proc.poll() is None:
                proc.kill()
        if proc.returncode != 0:
            log.seek(0)
            raise RuntimeError(f"bench serve failed ({proc.returncode}): {shlex.join(argv)}\n{log.read()[-3000:]}")
    return json.loads(out.read_text())


def learn_prompts(port: int, concurrency: int, num_prompts: int, max_tokens: int, dataset: str | None, logs: Path,
                  label: str) -> None:
    """A controlled-acceptance server's unmeasured passes over the prompts: the drafter learns each
    prompt's greedy output, a round's drafts past the end (TRUTH_EXTRA), then once more, so that
    what `auto` measured while nothing was learned yet (drafts never accepted) gives way to rounds
    whose drafts are."""
    bench_serve(port, concurrency, num_prompts, max_tokens + TRUTH_EXTRA, 0, dataset, logs / f"bench-{label}-truth.json")
    bench_serve(port, concurrency, num_prompts, max_tokens, 0, dataset, logs / f"bench-{label}-settle.json")


def outputs_of(result: dict) -> dict[int, list[int]]:
    """Prompt index -> output token ids of a bench serve result with saved outputs."""
    return {o["prompt_index"]: o["output_token_ids"] for o in result["requests"] if o.get("ok")}


def matches_plain(outs: dict[int, list[int]], plain: dict[int, list[int]]) -> bool | None:
    """Whether every output equals the plain greedy output of its prompt; None (unknown) where
    the plain outputs lack one of the prompts."""
    if not outs or any(i not in plain for i in outs):
        return None
    return all(plain[i] == ids for i, ids in outs.items())


def served_record(backend: str, method: str, rate, concurrency: int, result: dict, exact, serve_args: str = "") -> dict:
    return {"backend": backend, "method": method, "acceptance_rate": rate, "concurrency": concurrency,
            "output_tokens_per_s": round(result["output_throughput"], 1),
            "ttft_ms_p50": result["p50_ttft_ms"], "tpot_ms_p50": result["p50_tpot_ms"],
            "itl_ms_p50": result["p50_itl_ms"], "itl_ms_p99": result["p99_itl_ms"],
            "accept_length": result.get("acceptance_length"), "exact": exact,
            "completed": result.get("completed"), "failed": result.get("failed"), "serve_args": serve_args,
            # verify rounds by the pipeline mode that ran them (what `--pipeline auto` chose), and
            # request-rounds whose trees went drafter -> verifier over the tree channel
            "mode_rounds": (result.get("server_counters") or {}).get("mode_rounds"),
            "posted_trees": (result.get("server_counters") or {}).get("posted_trees")}


def run_matrix(args) -> dict:
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    concurrency = _numbers(args.concurrency, int)
    rates = _numbers(args.rates, float)
    if args.no_plain and args.plain_only:
        raise SystemExit("serve_matrix: --no-plain and --plain-only leave no server to run")
    if args.pair == "demo" and (args.no_plain or args.plain_only):
        raise SystemExit("serve_matrix: --no-plain and --plain-only are for --pair llama8b (the demo pair "
                         "always serves --method none and eagle3)")
    backends = [b for b in args.backends.split(",") if b]
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="spectandem-matrix-"))
    workdir.mkdir(parents=True, exist_ok=True)
    logs = workdir / "logs"
    logs.mkdir(exist_ok=True)
    say = lambda text: print(f"[serve_matrix] {text}", file=sys.stderr, flush=True)

    if args.pair == "llama8b":
        say(f"writing the {args.scale} 8B-shaped pair to {workdir}")
        tdir, hdir, target, head = write_llama8b_pair(workdir, args.scale, device, args.seed)
        reference = []
        if not args.skip_engine_reference:
            say("engine loop reference")
            reference = engine_reference_llama8b(target, head, device, rates, concurrency, args.max_tokens, args.seed,
                                                 args.drafter_device, max(args.min_prompts, args.prompts_per_slot))
        del target, head
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
        model, draft = ["--target", str(tdir)], ["--draft", str(hdir)]
        methods = ([] if args.no_plain else [("none", None)]) + ([] if args.plain_only else [("eagle3", a) for a in rates])
    else:
        from spectandem.demo import demo_paths

        t, d = demo_paths("eagle3")
        model, draft = ["--target", str(t)], ["--draft", str(d)]
        reference = []
        if not args.skip_engine_reference:
            from benchmarks.bench.datasets import DEFAULT_DATASET
            from benchmarks.bench.serve import measured_prompts

            say("engine loop reference")
            reference = engine_reference_demo(
                device, concurrency, args.max_tokens,
                lambda c: measured_prompts(args.dataset or DEFAULT_DATASET,
                                           max(args.min_prompts, args.prompts_per_slot * c)))
        methods = [("none", None), ("eagle3", None)]

    records, failures = [], []
    stored = _load_plain(args.plain_outputs)
    for backend in backends:
        plain: dict[int, list[int]] = dict(stored.get(backend, {}))
        for method, rate in methods:
            argv = (model + ([] if method == "none" else draft)
                    + ["--backend", backend, "--method", method, "--http-port", "0", "--metrics-port", "0",
                       "--log-level", "INFO"]
                    + (["--device", args.device] if args.device else []))
            if args.drafter_device and method != "none" and backend != "ray":   # Ray places its actors itself
                argv += ["--drafter-device", args.drafter_device]
            if rate is not None:
                argv += ["--benchmark-acceptance-rate", str(rate)]
            argv += shlex.split(args.serve_args) + ([] if method == "none" else shlex.split(args.spec_serve_args))
            label = f"{backend}-{method}" + (f"-a{rate}" if rate is not None else "")
            say(f"serve {label}")
            try:
                server = Server(argv, logs / f"serve-{label}.log", args.start_timeout)
            except RuntimeError as e:   # the other servers still run; the failure is recorded
                say(f"  failed to start: {str(e).splitlines()[0]}")
                failures.append({"backend": backend, "method": method, "acceptance_rate": rate,
                                 "error": str(e)[-2000:]})
                continue
            try:
                say(f"  up in {server.start_s:.0f} s")
                if rate is not None:
                    n = max(args.min_prompts, args.prompts_per_slot * max(concurrency))
                    try:
                        learn_prompts(server.port, max(concurrency), n, args.max_tokens, args.dataset, logs, label)
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        say(f"  the learning pass failed: {str(e).splitlines()[0]}")
                        failures.append({"backend": backend, "method": method, "acceptance_rate": rate,
                                         "error": str(e)[-2000:]})
                        continue
                for c in concurrency:
                    n = max(args.min_prompts, args.prompts_per_slot * c)
                    try:
                        if method != "none":   # auto's first measurements of this batch size, unmeasured
                            bench_serve(server.port, c, n, args.max_tokens, 0, args.dataset,
                                        logs / f"bench-{label}-settle-c{c}.json")
                        result = bench_serve(server.port, c, n, args.max_tokens, c, args.dataset,
                                             logs / f"bench-{label}-c{c}.json")
                    except (RuntimeError, subprocess.TimeoutExpired) as e:
                        say(f"  c={c} failed: {str(e).splitlines()[0]}")
                        failures.append({"backend": backend, "method": method, "acceptance_rate": rate,
                                         "concurrency": c, "error": str(e)[-2000:]})
                        continue
                    outs = outputs_of(result)
                    if method == "none":
                        plain.update(outs)
                        stored[backend] = plain
                        _save_plain(args.plain_outputs, stored)
                    exact = matches_plain(outs, plain)
                    rec = served_record(backend, method, rate, c, result, exact, args.serve_args)
                    records.append(rec)
                    if args.out:   # what is measured so far, should a later step fail
                        partial = {"partial": True, "gpu": None, "command": None, "records": records,
                                   "failures": failures, "engine_reference": reference}
                        if args.previous is not None:
                            partial = dict(appended(args.previous, partial), partial=True)
                        Path(args.out).write_text(json.dumps(partial, indent=1) + "\n")
                    say(f"  c={c}: {rec['output_tokens_per_s']:.1f} tok/s, accept {rec['accept_length']}, "
                        f"exact {exact}")
            finally:
                server.stop()
    return {"gpu": machine(device), "command": shlex.join([Path(sys.argv[0]).as_posix()] + sys.argv[1:]),
            "drafter_device": args.drafter_device, "pair": args.pair, "scale": args.scale if args.pair == "llama8b" else None,
            "max_tokens": args.max_tokens, "records": records, "failures": failures, "engine_reference": reference}


def machine(device: str) -> str:
    """The results' "gpu": the GPU's name (with their count where several), or the CPU's cores."""
    import torch

    if not device.startswith("cuda"):
        return f"cpu ({os.cpu_count()} cores)"
    name = torch.cuda.get_device_name(0)
    return f"{torch.cuda.device_count()} x {name}" if torch.cuda.device_count() > 1 else name


def _load_plain(path: str | None) -> dict[str, dict[int, list[int]]]:
    """--plain-outputs: backend -> prompt index -> plain greedy output ids ({} when absent)."""
    if not path or not Path(path).exists():
        return {}
    return {b: {int(i): ids for i, ids in outs.items()} for b, outs in json.loads(Path(path).read_text()).items()}


def _save_plain(path: str | None, stored: dict[str, dict[int, list[int]]]) -> None:
    if path:
        Path(path).write_text(json.dumps({b: {str(i): ids for i, ids in outs.items()} for b, outs in stored.items()}))


def appended(previous: dict, new: dict) -> dict:
    """`new`'s records added to `previous`'s (same backend, method, rate, concurrency: new wins),
    the engine reference of whichever measured one (new first), the failures of servers not run
    again plus `new`'s, every invocation's command."""
    key = lambda r: (r["backend"], r["method"], r["acceptance_rate"], r["concurrency"])
    fresh = {key(r) for r in new["records"]}
    merged = dict(new, gpu=new["gpu"] or previous.get("gpu"))
    merged.pop("partial", None)
    merged["records"] = [r for r in previous.get("records", []) if key(r) not in fresh] + new["records"]
    merged["engine_reference"] = new["engine_reference"] or previous.get("engine_reference", [])
    # A server this invocation ran again takes its earlier failures with it.
    server = lambda r: (r.get("backend"), r.get("method"), r.get("acceptance_rate"))
    rerun = {server(r) for r in new["records"] + new["failures"]}
    merged["failures"] = [f for f in previous.get("failures", []) if server(f) not in rerun] + new["failures"]
    merged["command"] = "\n".join(c for c in (previous.get("command"), new["command"]) if c)
    check_machine(previous, new["gpu"])
    return merged


def check_machine(previous: dict, gpu: str | None) -> None:
    """--append: refuses records of another machine than `previous`'s (None: not known yet)."""
    if previous.get("gpu") and gpu and previous["gpu"] != gpu:
        raise ValueError(f"--append: {previous['gpu']!r} measured the records in --out, this machine is {gpu!r}")


def table(results: dict) -> str:
    ref = {(r["method"], r["acceptance_rate"], r["batch_size"]): r["tokens_per_s"] for r in results["engine_reference"]}
    plain = {(r["backend"], r["concurrency"]): r["output_tokens_per_s"] for r in results["records"]
             if r["method"] == "none"}
    lines = [f"{'backend':8} {'method':7} {'a':>4} {'conc':>4} {'tok/s':>9} {'/engine':>7} {'/plain':>6} "
             f"{'ttft p50':>8} {'tpot p50':>8} {'itl p50':>7} {'itl p99':>7} {'accept':>6} exact"]
    for r in results["records"]:
        e = ref.get((r["method"], r["acceptance_rate"], r["concurrency"]))
        p = plain.get((r["backend"], r["concurrency"]))
        f = lambda x, spec: "-" if x is None else format(x, spec)
        lines.append(f"{r['backend']:8} {r['method']:7} {f(r['acceptance_rate'], '4.1f'):>4} {r['concurrency']:>4} "
                     f"{r['output_tokens_per_s']:9.1f} {f(e and r['output_tokens_per_s'] / e, '.2f'):>7} "
                     f"{f(p and r['output_tokens_per_s'] / p, '.2f'):>6} {f(r['ttft_ms_p50'], '8.1f'):>8} "
                     f"{f(r['tpot_ms_p50'], '8.2f'):>8} {f(r['itl_ms_p50'], '7.2f'):>7} {f(r['itl_ms_p99'], '7.2f'):>7} "
                     f"{f(r['accept_length'], '6.2f'):>6} {r['exact']}")
    if results["engine_reference"]:
        lines.append("engine loop: " + ", ".join(
            f"{m}{'' if a is None else f' a={a}'} b={b}: {t:.1f}" for (m, a, b), t in ref.items()))
    for x in results.get("failures", []):
        lines.append(f"FAILED {x['backend']} {x['method']} a={x['acceptance_rate']} c={x.get('concurrency', '-')}: "
                     f"{x['error'].splitlines()[0]}")
    return "\n".join(lines)


def _terminated(signum, frame):
    raise SystemExit(128 + signum)   # the running server is stopped on the way out (Server.stop)


def main() -> int:
    signal.signal(signal.SIGTERM, _terminated)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", choices=["llama8b", "demo"], default="llama8b", help="the models served (default: llama8b)")
    p.add_argument("--scale", choices=["full", "tiny"], default="full", help="llama8b: the 8B shapes or a tiny copy")
    p.add_argument("--backends", default="local,grpc,ray", help="comma-separated (default: local,grpc,ray)")
    p.add_argument("--rates", default="0.6,0.8,0.9", help="llama8b: controlled acceptance rates (default: 0.6,0.8,0.9)")
    p.add_argument("--concurrency", default="1,16,64", help="bench serve --max-concurrency values (default: 1,16,64)")
    p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (default: 128)")
    p.add_argument("--prompts-per-slot", type=int, default=4,
                   help="prompts per unit of concurrency (default: 4: the first wave's prefill and the last one's "
                        "drain are a quarter of a row's requests)")
    p.add_argument("--min-prompts", type=int, default=8, help="prompts per run at least (default: 8)")
    p.add_argument("--dataset", default=None, help="bench serve --dataset (default: bench serve's)")
    p.add_argument("--device", default=None, help="serve --device (default: serve's own default)")
    p.add_argument("--drafter-device", default=None,
                   help="the drafter's device in the engine loop and, for --backend local and grpc, serve's "
                        "--drafter-device (default: the verifier's in the engine loop, serve's choice in serve)")
    p.add_argument("--serve-args", default="", help="more serve flags, one string (default: none)")
    p.add_argument("--spec-serve-args", default="",
                   help="more serve flags for the speculating servers only (tree flags, which --method none "
                        "refuses), one string (default: none)")
    p.add_argument("--seed", type=int, default=0, help="the random weights' seed (default: 0)")
    p.add_argument("--workdir", default=None, help="where the pair and the logs go (default: a temporary folder)")
    p.add_argument("--start-timeout", type=float, default=600.0, help="seconds a server may take to start")
    p.add_argument("--no-plain", action="store_true", help="llama8b: the controlled rates only, no --method none server")
    p.add_argument("--plain-only", action="store_true",
                   help="llama8b: the --method none server only (the engine loop reference still runs each rate)")
    p.add_argument("--skip-engine-reference", action="store_true", help="serve only")
    p.add_argument("--append", action="store_true",
                   help="add to the records already in --out instead of replacing them (see above)")
    p.add_argument("--plain-outputs", default=None, metavar="FILE",
                   help="JSON of each backend's plain greedy outputs: written when plain runs, read otherwise "
                        "(default: none kept)")
    p.add_argument("--out", required=True, help="the JSON written")
    args = p.parse_args()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    args.previous = previous = (json.loads(Path(args.out).read_text()) if args.append and Path(args.out).exists()
                                else None)
    if previous is not None:   # before measuring: records of another machine are never merged
        import torch

        check_machine(previous, machine(args.device or ("cuda" if torch.cuda.is_available() else "cpu")))
    results = run_matrix(args)
    if previous is not None:
        results = appended(previous, results)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(table(results))
    return 1 if results["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
