"""Milliseconds per verifier prefill (`NativeRunner.prefill`, EAGLE-3 features captured) of the
8B-shaped bf16 target on the fast path (CUDA graphs, Triton attention), by batch and prompt
length: the eager forward against the graphed one (the prefill run as a verify of one chain per
prompt, verifier/runner.py `_prefill_graphed`), with a plain decode step and a 5-node chain
verify at batch 16 for scale. Each figure is the median of `--iters` calls, synchronized.

    python benchmarks/prefill_timing.py [--lengths 64,128,256] [--batches 1,2,4] [--iters 10] [--waves 16,64]
        [--profile-wave 64]

`--waves`: prompts of the lengths `bench serve`'s default dataset gives (the first W of
benchmarks/data/heldout-prompts.jsonl under the demo tokenizer, the 8B-shaped pair's), prefilled
at once as a wave of W requests arriving together does: in groups of one padded length
(`prefill_groups`, each graphed or eager), back to back in packed forwards (`_prefill_packed`),
and the path serve takes (`packed_prefill_plan`). `--profile-wave W`: the packed prefill of the first W
prompts once more under torch.profiler, its kernels by CUDA time.

Which path serve takes (the last column) is `NativeRunner._graphed_prefill_nodes`: graphed up to
GRAPHED_PREFILL_MAX tokens and GRAPHED_PREFILL_ROWS rows (batch bucket x padded length), past
GRAPHED_PREFILL_FREE_ROWS rows only where the padding is at most PREFILL_PAD_SHARE of the tokens.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def _timed(fn, iters: int) -> float:
    out = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(time.perf_counter() - t0)
    return 1000 * statistics.median(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", default="64,128,256", help="prompt tokens (default: %(default)s)")
    ap.add_argument("--batches", default="1,2,4", help="prompts per call (default: %(default)s)")
    ap.add_argument("--iters", type=int, default=10, help="calls timed per figure (default: %(default)s)")
    ap.add_argument("--waves", default="16,64",
                    help="prompts per wave of dataset prompts, 0 for none (default: %(default)s)")
    ap.add_argument("--profile-wave", type=int, default=0, metavar="W",
                    help="profile the packed prefill of the first W dataset prompts (default: none)")
    a = ap.parse_args()

    import verifier.runner as vr
    from benchmarks.bench.llama8b import llama8b_spec, random_target
    from spectandem.feature_layers import aux_layers_from_config

    spec = llama8b_spec("full")
    model = random_target(spec, "cuda", torch.bfloat16, 0)
    layers = aux_layers_from_config({}, spec.num_layers)
    lengths = [int(x) for x in a.lengths.split(",")]
    batches = [int(x) for x in a.batches.split(",")]
    waves = [int(x) for x in a.waves.split(",") if int(x)]
    max_slots = max([16, *batches, *waves])
    runner = vr.NativeRunner(model, layers, max_slots=max_slots, max_len=max(lengths + [256]) + 64, cuda_graphs=True,
                             triton_attention=True)
    g = torch.Generator().manual_seed(0)

    def prefill(b: int, n: int):
        prompts = [torch.randint(0, spec.vocab_size, (n,), generator=g).tolist() for _ in range(b)]
        slots = list(range(b))
        return lambda: (runner.prefill(slots, prompts), [runner.cache.free(s) for s in slots])

    print(f"{'batch':>5} {'tokens':>6} {'eager ms':>9} {'graphed ms':>10}  serve takes")
    saved = vr.GRAPHED_PREFILL_MAX, vr.GRAPHED_PREFILL_ROWS, vr.GRAPHED_PREFILL_FREE_ROWS
    for b in batches:
        for n in lengths:
            vr.GRAPHED_PREFILL_MAX = 0
            eager = _timed(prefill(b, n), a.iters)
            vr.GRAPHED_PREFILL_MAX = vr.GRAPHED_PREFILL_ROWS = vr.GRAPHED_PREFILL_FREE_ROWS = 1 << 20
            fn = prefill(b, n)
            fn()   # its graph captured
            graphed = _timed(fn, a.iters)
            vr.GRAPHED_PREFILL_MAX, vr.GRAPHED_PREFILL_ROWS, vr.GRAPHED_PREFILL_FREE_ROWS = saved
            path = "graphed" if runner._graphed_prefill_nodes([[0] * n] * b) else "eager"
            print(f"{b:5d} {n:6d} {eager:9.2f} {graphed:10.2f}  {path}", flush=True)

    slots = list(range(16))
    for s in slots:
        runner.cache.reserve(s, 200)
    for n in (1, 5):
        toks = torch.randint(0, spec.vocab_size, (16, n), generator=g)
        parents = torch.arange(-1, n - 1).expand(16, n)
        valid = torch.ones(16, n, dtype=torch.bool)
        step = lambda: runner.verify(slots, [128] * 16, toks, parents, valid)
        step()
        print(f"verify batch 16, {n}-node chain at 128 tokens: {_timed(step, a.iters):.2f} ms")
    for s in slots:
        runner.cache.free(s)
    if waves:
        _waves(runner, waves, a.iters)
    if a.profile_wave:
        _profile_wave(runner, a.profile_wave)
    return 0


def _wave_prompts(w: int) -> list[list[int]]:
    """The first `w` prompts of bench serve's default dataset under the demo tokenizer."""
    from benchmarks.bench.datasets import DEFAULT_DATASET, _demo_tokenizer, load_prompts

    tok = _demo_tokenizer()
    return [tok.encode(p.text).ids for p in load_prompts(DEFAULT_DATASET)[:w]]


def _packed_prefill(runner, prompts: list[list[int]]):
    """A call that prefills `prompts` in slots 0.. as `packed_runs` cuts them, one packed forward
    a run, then frees the slots."""
    import verifier.runner as vr

    slots = list(range(len(prompts)))

    def run_all():
        for run in vr.packed_runs([len(p) for p in prompts]):
            runner._prefill_packed([slots[i] for i in run], [prompts[i] for i in run])
        for s in slots:
            runner.cache.free(s)
    return run_all


def _profile_wave(runner, w: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    prompts = _wave_prompts(w)
    packed = _packed_prefill(runner, prompts)
    packed()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        packed()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: e.self_device_time_total, reverse=True)
    total = sum(e.self_device_time_total for e in events)
    print(f"packed prefill of {w} prompts ({sum(len(p) for p in prompts)} tokens) under the profiler: "
          f"{total / 1000:.2f} ms of CUDA time; its kernels by CUDA time:")
    for e in events[:12]:
        print(f"  {e.self_device_time_total / 1000:8.2f} ms {e.count:5d} calls  {e.key[:90]}")


def _waves(runner, waves: list[int], iters: int) -> None:
    import verifier.runner as vr
    print(f"{'wave':>5} {'tokens':>6} {'groups':>6} {'groups ms':>9} {'packed runs':>11} {'packed ms':>9}  serve takes")
    for w in waves:
        prompts = _wave_prompts(w)
        lens = [len(p) for p in prompts]
        slots = list(range(w))
        groups = vr.prefill_groups(lens, runner.graphs.batch_buckets)
        runs = vr.packed_prefill_plan(lens, groups, runner.graphs.batch_buckets, runner.cache.max_len)

        def call(fn):
            return lambda: (fn(), [runner.cache.free(s) for s in slots])

        plan = vr.packed_prefill_plan
        vr.packed_prefill_plan = lambda *args: None
        call(lambda: runner.prefill(slots, prompts))()   # the groups' graphs captured
        grouped = _timed(call(lambda: runner.prefill(slots, prompts)), iters)
        vr.packed_prefill_plan = plan
        packed = _packed_prefill(runner, prompts)
        packed()
        packed_ms = _timed(packed, iters)
        path = "packed" if runs else "groups"
        print(f"{w:5d} {sum(lens):6d} {len(groups):6d} {grouped:9.2f} {len(vr.packed_runs(lens)):11d} {packed_ms:9.2f}  {path}",
              flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
