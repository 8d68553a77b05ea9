"""Command-line flags of the engine services (`spectandem verifier|drafter`, `python -m
verifier|drafter`), kept apart from the services so that parsing a command line loads no
model code, gRPC server or torch."""

from __future__ import annotations

import argparse

from spectandem.tls import add_server_tls_flags
from spectandem.config import DEFAULT_NUM_STEPS, DEFAULT_TREE_DRAFT_TOKENS
from spectandem.memory import DEFAULT_CPU_KV_CACHE_GIB


class HelpFormatter(argparse.HelpFormatter):
    """Every command's help: each option shows its default, unless its help already says it
    (`(default: ...)`) or there is none to show (None, an on/off switch, an empty list)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "%(default)" in text or "(default:" in text or not shows_default(action):
            return text
        return f"{text} (default: %(default)s)" if text else "default: %(default)s"


def shows_default(action: argparse.Action) -> bool:
    """Whether an option has a default to show: a value, for an option that takes one."""
    if action.default in (None, argparse.SUPPRESS) or action.nargs == 0 or not action.option_strings:
        return False
    return not (isinstance(action.default, (tuple, list)) and not action.default)


def model_dtype(args: argparse.Namespace):
    """`--dtype` as a torch dtype, checked against `--device`: float64 is for CPU reference runs
    (the GPU's kernels take float32, bfloat16 and float16)."""
    import torch

    from spectandem.config import check_dtype

    check_dtype(args.dtype, args.device)
    return getattr(torch, args.dtype)


DEVICE_HELP = "torch device of the engine(s): auto = cuda when a CUDA GPU is visible, else cpu; or cpu, cuda, cuda:N"
DTYPE_HELP = ("auto = bfloat16 on CUDA, float32 on the CPU; float64: CPU reference runs (their rounding almost never "
              "flips seeded draws)")
DTYPE_CHOICES = ["auto", "float32", "bfloat16", "float16", "float64"]


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """--device, --dtype (both `auto` by default: spectandem.config.resolve_model_flags) and the GPU fast paths."""
    p.add_argument("--device", default="auto", help=DEVICE_HELP)
    p.add_argument("--dtype", choices=DTYPE_CHOICES, default="auto", help=DTYPE_HELP)
    add_gpu_path_flags(p)


def add_gpu_path_flags(p: argparse.ArgumentParser) -> None:
    """The GPU fast paths (spectandem.config.GpuPaths: `resolve` fills in the defaults, `flags()`
    hands them to engine processes)."""
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                   help="replay CUDA graphs for verify steps, EAGLE catch-ups and argmax chains (CUDA only; "
                        "default: on on CUDA, off on the CPU)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="run eagerly, without CUDA graphs (vLLM's spelling of --no-cuda-graphs)")
    p.add_argument("--triton-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="the target's verify attends through the Triton paged tree attention, eager or with "
                        "CUDA graphs (CUDA + Triton; default: on on CUDA with Triton installed, off on the CPU and "
                        "with --batch-invariant)")
    p.add_argument("--decode-ahead", action=argparse.BooleanOptionalAction, default=None,
                   help="after a plain multi-step decode the verifier queues the next one on the device where the "
                        "router expects to ask for it, so that it runs while the router commits and streams the "
                        "last (in the manner of vLLM's async scheduling and SGLang's overlap scheduler; the same "
                        "tokens; default: on on CUDA, off on the CPU, where the host computes it and nothing overlaps)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="batch-invariant target kernels: bf16 speculation gives plain decoding's exact tokens "
                        "(CUDA + Triton; the target then runs without CUDA graphs; default: off)")


def add_memory_flags(p: argparse.ArgumentParser, engine: bool = True) -> None:
    """The GPU memory budget of the KV pools (spectandem/memory.py; EngineConfig's fields).
    `engine`: also the per-engine budget flags that serve hands its engine processes."""
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of the GPU's total memory the server may use; on CUDA, without --kv-blocks, "
                        "the KV pools take what weights, activations and CUDA graphs leave of it")
    p.add_argument("--cpu-kv-cache-gib", type=float, default=DEFAULT_CPU_KV_CACHE_GIB, metavar="GIB",
                   help="on the CPU, without --kv-blocks / --draft-kv-blocks, the GiB of each engine's KV pool "
                        "(at most every request at full context; a pool that cannot hold one request at --max-len "
                        "is refused) (default: %(default)s)")
    if engine:
        p.add_argument("--memory-budget-gib", type=float, default=None,
                       help="this engine's GPU memory budget in GiB, instead of --gpu-memory-utilization")
        p.add_argument("--memory-reserved-gib", type=float, default=0.0,
                       help="GiB of this GPU left to another engine, taken off --gpu-memory-utilization's share")


def _rate(text: str) -> float:
    try:
        rate = float(text)
    except ValueError:
        rate = float("nan")
    if not 0 <= rate <= 1:
        raise argparse.ArgumentTypeError(f"must be a number in [0, 1], got {text!r}")
    return rate


def add_benchmark_flag(p: argparse.ArgumentParser) -> None:
    """--benchmark-acceptance-rate (spectandem.config.SpecConfig.benchmark_acceptance_rate)."""
    p.add_argument("--benchmark-acceptance-rate", type=_rate, default=None, metavar="A",
                   help="FOR BENCHMARKS ONLY, never in production: the drafter drafts the outputs of greedy requests "
                        "it has seen before (send each prompt once greedily to warm up), each draft right with "
                        "probability A in [0, 1], while the real EAGLE head still runs; other requests and positions "
                        "get the head's drafts. Needs --method eagle or eagle3 and --topk 1")


def _int_at_least(text: str, low: int, what: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = low - 1
    if n < low:
        raise argparse.ArgumentTypeError(f"must be {what}, got {text!r}")
    return n


def non_negative_int(text: str) -> int:
    return _int_at_least(text, 0, "an integer >= 0")


def positive_int(text: str) -> int:
    return _int_at_least(text, 1, "a positive integer")


def cpu_core_list(text: str) -> list[int]:
    """--cpu-cores: comma-separated cores and ranges ("0", "0-3,8") -> the sorted core numbers."""
    cores: set[int] = set()
    try:
        for part in text.split(","):
            lo, dash, hi = part.strip().partition("-")
            first, last = int(lo), int(hi) if dash else int(lo)
            if first < 0 or last < first:
                raise ValueError
            cores.update(range(first, last + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be cores and ranges of cores like 0-3,8, got {text!r}") from None
    return sorted(cores)


def format_cores(cores) -> str:
    """Sorted core numbers as `cpu_core_list` reads them, ranges joined: [0, 1, 2, 5] -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cores):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


def add_threads_flag(p: argparse.ArgumentParser) -> None:
    """--threads and --cpu-cores of an engine process (`spectandem serve` passes its choices on)."""
    p.add_argument("--threads", type=positive_int, default=None, metavar="N",
                   help="torch CPU threads of this engine (default: torch's own: OMP_NUM_THREADS where set, "
                        "else one per core)")
    p.add_argument("--cpu-cores", type=cpu_core_list, default=None, metavar="LIST",
                   help="the CPU cores this engine process and every thread it starts run on, e.g. 0-3,8; each "
                        "must be one this process may run on (default: those it was started with)")


def add_verifier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=None, help="target checkpoint directory (default: the demo target)")
    p.add_argument("--draft", default=None,
                   help="the drafter's head directory, read for its feature layers (default: the demo's)")
    p.add_argument("--method", choices=["eagle", "eagle3", "draft-model", "ngram", "none"], default="eagle3",
                   help="the drafter's method: decides which target features are returned")
    p.add_argument("--feature-layers", default=None,
                   help='features the drafter reads: "none", "final" or comma-separated HF hidden-state indices '
                        "(default: from --method and --draft)")
    add_tree_flags(p)   # the drafter's: the tree widths whose verify graphs are captured at start
    add_device_flags(p)
    p.add_argument("--max-len", "--max-model-len", type=int, default=None,
                   help="context length (default: the target's; --max-model-len as in vLLM)")
    p.add_argument("--max-slots", type=int, default=8, help="requests held at once")
    p.add_argument("--kv-blocks", type=int, default=None, help="KV pool in blocks (default: every slot at full context)")
    p.add_argument("--block-size", type=int, default=16, help="cache entries per KV block")
    add_memory_flags(p)
    add_threads_flag(p)
    p.add_argument("--one-thread-up-to", type=non_negative_int, default=0, metavar="TOKENS",
                   help="on the CPU: forwards of at most TOKENS tokens (a verify's tree nodes and plain rows, a "
                        "prefill's prompt tokens) run on one torch thread, on --one-thread-cores where given, larger "
                        "ones on --threads (default: 0, every forward on --threads)")
    p.add_argument("--one-thread-cores", type=cpu_core_list, default=None, metavar="LIST",
                   help="with --one-thread-up-to, on the CPU: the cores the thread that runs those small forwards "
                        "is bound to while it runs them, e.g. the drafter's (default: the process's cores)")
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=50052, help="0 picks a free port (printed)")
    p.add_argument("--feature-channel", default=None, metavar="tcp://HOST:PORT",
                   help="send target features to the drafter over a direct NCCL (CUDA) or gloo (CPU) channel; this "
                        "verifier listens at HOST:PORT for it (the drafter gets the same address)")
    p.add_argument("--tree-channel", default=None, metavar="tcp://HOST:PORT",
                   help="take a round's draft trees from the drafter over a direct socket, where the router's "
                        "verify asks for them (this verifier listens at HOST:PORT; the drafter gets the same address)")
    add_server_tls_flags(p, "the Verifier service")


def add_drafter_args(p: argparse.ArgumentParser) -> None:
    add_model_flags(p)
    add_memory_flags(p)
    add_benchmark_flag(p)
    p.add_argument("--max-slots", type=int, default=8, help="requests held at once")
    add_threads_flag(p)
    p.add_argument("--host", default="0.0.0.0", help="address to listen on")
    p.add_argument("--port", type=int, default=50053, help="0 picks a free port (printed)")
    p.add_argument("--feature-channel", default=None, metavar="tcp://HOST:PORT",
                   help="take target features from the verifier's direct channel at this address (its "
                        "--feature-channel)")
    p.add_argument("--tree-channel", default=None, metavar="tcp://HOST:PORT",
                   help="send a round's draft trees to the verifier's socket at this address (its --tree-channel) "
                        "where the router's draft call asks for it")
    add_server_tls_flags(p, "the Drafter service")


def add_tree_flags(p: argparse.ArgumentParser) -> None:
    """The tree's shape: what the drafter drafts, and what a verifier warms its graphs up for."""
    p.add_argument("--num-steps", type=int, default=None,
                   help="tree depth (default: the draft tokens an EAGLE head's config.json states, as speculators' "
                        f"speculative_tokens, else {DEFAULT_NUM_STEPS})")
    p.add_argument("--topk", type=int, default=1, help="children expanded per node")
    p.add_argument("--num-draft-tokens", type=int, default=None,
                   help="verified nodes per round, root included (default: 2 with --fused, --num-steps + 1 with "
                        f"--topk 1, else {DEFAULT_TREE_DRAFT_TOKENS})")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    """Model and tree flags shared by every command that loads models."""
    p.add_argument("--target", default=None, help="target checkpoint directory (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft head / draft model directory (default: the demo's)")
    p.add_argument("--method", choices=["eagle", "eagle3", "draft-model", "ngram", "none"], default="eagle3",
                   help="how drafts are made: an EAGLE-1 or EAGLE-3 head, a small draft model, prompt-lookup "
                        "n-grams, or none (plain decoding)")
    add_tree_flags(p)
    p.add_argument("--fused", action="store_true", help="one draft token per round, verify+extend fused")
    p.add_argument("--draft-sampling-min-temperature", type=float, default=0.5,
                   help="below this temperature drafts are deterministic and verified without q")
    p.add_argument("--ahead-width", type=int, default=4,
                   help="draft ahead: outcomes of a round prepared while it is verified (0: never)")
    add_device_flags(p)
    p.add_argument("--max-len", "--max-model-len", type=int, default=None,
                   help="context length (default: the target's; --max-model-len as in vLLM)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="verifier KV pool in blocks (default: every slot at full context)")
    p.add_argument("--draft-kv-blocks", type=int, default=None,
                   help="drafter KV pool in blocks (default: every slot at full context)")
    p.add_argument("--block-size", type=int, default=16, help="cache entries per KV block (both sides)")


def spec_from_flags(args):
    """The model flags -> (SpecConfig, target dir, draft dir or None); the demo pair by default."""
    from spectandem.config import SpecConfig
    from spectandem.demo import demo_paths

    if args.method == "none":
        refuse_tree_flags(args)
    target, draft = args.target, args.draft
    if target is None:
        demo_target, demo_draft = demo_paths(args.method)
        target, draft = str(demo_target), (draft or (str(demo_draft) if demo_draft else None))
    elif draft is None and args.method in ("eagle", "eagle3", "draft-model"):
        raise ValueError(f"--method {args.method} with --target needs --draft")
    # Without --num-steps, the depth the head's config states (SpecConfig.for_draft); the engine
    # processes serve starts get the resolved tree on their command lines.
    cfg = SpecConfig(method=args.method, num_steps=args.num_steps, topk=args.topk,
                     num_draft_tokens=args.num_draft_tokens, fused=args.fused,
                     draft_sampling_min_temperature=args.draft_sampling_min_temperature,
                     ahead_width=args.ahead_width,
                     benchmark_acceptance_rate=getattr(args, "benchmark_acceptance_rate", None)).for_draft(draft)
    return cfg, target, draft


def refuse_tree_flags(args) -> None:
    """ValueError naming the draft flags given with --method none, which drafts nothing: a flag
    that would change nothing is refused rather than ignored."""
    given = [flag for flag, on in (("--draft", args.draft is not None), ("--num-steps", args.num_steps is not None),
                                   ("--topk", args.topk != 1), ("--num-draft-tokens", args.num_draft_tokens is not None),
                                   ("--fused", getattr(args, "fused", False))) if on]
    if given:
        raise ValueError(f"{', '.join(given)}: --method none decodes plainly, with no draft model or tree; "
                         f"drop {'it' if len(given) == 1 else 'them'} or choose a drafting --method")

