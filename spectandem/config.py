"""Configuration: frozen, keyword-only dataclasses validated once, at construction."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, replace

METHODS = ("eagle", "eagle3", "draft-model", "ngram", "none")
# The tree's defaults where neither the caller nor the draft head's config say (SpecConfig).
DEFAULT_NUM_STEPS = 4
DEFAULT_TREE_DRAFT_TOKENS = 5   # with topk above 1


@dataclass(frozen=True, kw_only=True)
class SpecConfig:
    """How drafts are made. `num_steps`, `topk`, `num_draft_tokens` have SGLang's meaning:
    tree depth, children expanded per node, and verified tokens per request per round
    including the root (so at most `num_draft_tokens - 1` draft nodes).

    Not given (None), the depth is DEFAULT_NUM_STEPS until `for_draft` takes the one an EAGLE
    head's config.json states (as vLLM serves a speculators checkpoint; the engines' builders,
    EngineConfig and LocalSpeculator, call it), and the verified nodes follow the depth: SGLang's
    depth + 1 for chains (topk 1), 2 for `fused`, DEFAULT_TREE_DRAFT_TOKENS for wider trees."""

    method: str = "eagle3"
    num_steps: int | None = None
    topk: int = 1
    num_draft_tokens: int | None = None
    # Requests sampled below this temperature use deterministic drafts verified without
    # draft probabilities (target-only tree sampling); at or above it, drafts are sampled
    # and verified with their probabilities q by rejection sampling.
    draft_sampling_min_temperature: float = 0.5
    fused: bool = False              # one draft token per round, verify + extend in one step
    ngram_max: int = 4               # prompt-lookup n-gram sizes tried, longest first
    # Draft ahead: how many likely outcomes (accepted path, bonus token) of the round being
    # verified the drafter prepares the next tree for, when the router asks it to (0 = never).
    ahead_width: int = 4
    ngram_min: int = 1
    # Benchmarks only (drafter/controlled.py): the drafter drafts the outputs of greedy requests
    # seen before, each draft right with this probability; None (always outside benchmarks): off.
    benchmark_acceptance_rate: float | None = None
    # Which of (num_steps, num_draft_tokens) the caller gave: `for_draft` leaves those.
    given: tuple[bool, bool] = field(init=False, repr=False, compare=False, default=(True, True))

    def __post_init__(self):
        given = (self.num_steps is not None, self.num_draft_tokens is not None)
        object.__setattr__(self, "given", given)
        if not given[0]:
            object.__setattr__(self, "num_steps", DEFAULT_NUM_STEPS)
        if not given[1]:
            nodes = 2 if self.fused else (self.num_steps + 1 if self.topk == 1 else DEFAULT_TREE_DRAFT_TOKENS)
            object.__setattr__(self, "num_draft_tokens", nodes)
        if self.method not in METHODS:
            raise ValueError(f"method must be one of {', '.join(METHODS)}; got {self.method!r}")
        if self.num_steps < 1:
            raise ValueError(f"num_steps must be >= 1, got {self.num_steps}")
        if self.topk < 1:
            raise ValueError(f"topk must be >= 1, got {self.topk}")
        if self.num_draft_tokens < 2:
            raise ValueError(f"num_draft_tokens must be >= 2 (the root plus one draft), got {self.num_draft_tokens}")
        if self.fused and (self.num_draft_tokens != 2 or self.method not in ("eagle", "eagle3")):
            raise ValueError("fused mode needs an EAGLE method and num_draft_tokens == 2, got "
                             f"method={self.method!r}, num_draft_tokens={self.num_draft_tokens}")
        if isinstance(self.ahead_width, bool) or not isinstance(self.ahead_width, int) or self.ahead_width < 0:
            raise ValueError(f"ahead_width must be an integer >= 0, got {self.ahead_width!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, {self.ngram_max}")
        if not self.draft_sampling_min_temperature >= 0:
            raise ValueError(f"draft_sampling_min_temperature must be >= 0, got {self.draft_sampling_min_temperature}")
        if self.benchmark_acceptance_rate is not None:
            self._check_benchmark_rate()

    def for_draft(self, draft_dir) -> "SpecConfig":
        """This config with the depth the EAGLE head in `draft_dir` states in its config.json
        (spectandem/checkpoint.py `declared_draft_length`), where the caller gave none; the
        verified nodes follow it unless given. Itself where nothing changes."""
        if self.given[0] or draft_dir is None or self.method not in ("eagle", "eagle3"):
            return self
        from spectandem.checkpoint import declared_draft_length, read_config

        stated = declared_draft_length(read_config(draft_dir), f"{draft_dir}/config.json")
        if stated is None or stated == self.num_steps:
            return self
        return replace(self, num_steps=stated, num_draft_tokens=self.num_draft_tokens if self.given[1] else None)

    def _check_benchmark_rate(self) -> None:
        rate = self.benchmark_acceptance_rate
        if (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate)
                or not 0 <= rate <= 1):
            raise ValueError(f"benchmark_acceptance_rate must be a number in [0, 1], got {rate!r}")
        if self.method not in ("eagle", "eagle3"):
            raise ValueError(f"benchmark_acceptance_rate needs an EAGLE head (method eagle or eagle3), "
                             f"got method {self.method!r}")
        if self.topk != 1:
            raise ValueError(f"benchmark_acceptance_rate drafts chains: it needs topk 1, got topk {self.topk}")
        if self.fused:
            raise ValueError("benchmark_acceptance_rate does not work with fused mode (its graph drafts "
                             "with the head directly)")

    @property
    def max_draft_nodes(self) -> int:
        """Draft nodes per request per round (the tree without its root)."""
        if self.method == "none":
            return 0
        if self.topk == 1 or self.method == "ngram":
            return min(self.num_draft_tokens - 1, self.num_steps)
        return min(self.num_draft_tokens - 1, self.topk + (self.num_steps - 1) * self.topk ** 2)


def benchmark_warning(rate: float) -> str:
    """The line a drafter at a benchmark acceptance rate logs, and serve prints, at start-up."""
    return f"benchmark mode: drafts follow outputs seen before at acceptance rate {rate:g}; not for production"


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """Per-request generation parameters. temperature 0 is greedy."""

    max_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()       # stop strings (served requests; the output is cut before them)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop strings must be non-empty strings, got {self.stop!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)
                                      or not 0 <= self.seed < 2 ** 64):
            raise ValueError(f"seed must be an integer in [0, 2**64), got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def drafts_sampled(self, min_temperature: float) -> bool:
        """Whether this request's drafts are sampled (and verified with their probabilities q by
        rejection sampling) rather than deterministic (verified without q): a sampled request at
        or above `min_temperature` (SpecConfig.draft_sampling_min_temperature). The drafter
        drafts by it and the router relies on it (a request with deterministic drafts decodes
        the same tokens in a plain round)."""
        return not self.greedy and self.temperature >= max(min_temperature, 1e-12)

    def resolved_seed(self) -> int:
        """The seed to key this request's random numbers with (a fresh one when unset; never
        the global RNG)."""
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little")


@dataclass(frozen=True, kw_only=True)
class Platform:
    """What the `auto` defaults of the model flags depend on, probed once by an entry point
    (spectandem/devices.py probe_platform; for Ray, the cluster's GPUs): GPUs visible, whether
    Triton is installed, whether the target runs on the native runner (the one with the GPU
    fast paths)."""

    gpus: int = 0
    triton: bool = False
    native: bool = True


def is_cuda(device: str) -> bool:
    """Whether a torch device string names a CUDA device ("cuda", "cuda:N")."""
    return device == "cuda" or device.startswith("cuda:")


def resolve_device(device: str, gpus: int) -> str:
    """--device: "auto" is "cuda" when a GPU is visible, else "cpu"; anything else as given
    ("cuda" or "cuda:N" with no GPU is refused)."""
    if device == "auto":
        return "cuda" if gpus > 0 else "cpu"
    if is_cuda(device) and gpus < 1:
        raise ValueError(f"--device {device} needs a CUDA GPU; none is visible (use --device cpu or auto)")
    return device


def resolve_dtype(dtype: str, device: str) -> str:
    """--dtype: "auto" is bfloat16 on CUDA, float32 on the CPU; anything else as given."""
    if dtype == "auto":
        return "bfloat16" if is_cuda(device) else "float32"
    return dtype


@dataclass(frozen=True, kw_only=True)
class GpuPaths:
    """The engines' GPU fast paths (CUDA only; the engines refuse them on the CPU).

    cuda_graphs: the target's verify steps, EAGLE catch-ups and argmax chains replay CUDA graphs
    (verifier/graphs.py, drafter/graphs.py).
    batch_invariant: the target runs kernels whose per-row results do not depend on the batch
    or the tree (spectandem/kernels/batch_invariant.py), so bf16 speculation gives exactly the
    tokens of bf16 plain decoding. It runs eagerly: the target's graphs are off with it.
    triton_attention: the target's verify steps attend through the Triton paged tree attention
    (spectandem/kernels/attention.py) instead of gathering the span and masking it densely; eager
    or graphed. Not with batch_invariant, which attends through its own kernel.
    decode_ahead: after a plain multi-step decode the verifier queues the next one on the device
    where the router expects to ask for it (PlainItem.again), so that it runs while the router
    commits, streams and prepares its next turn (verifier/engine.py). On by default on CUDA; off
    by default on the CPU, where it gains nothing (the host computes it), but allowed there."""

    cuda_graphs: bool = False
    batch_invariant: bool = False
    triton_attention: bool = False
    decode_ahead: bool = False

    def __post_init__(self):
        if self.triton_attention and self.batch_invariant:
            raise ValueError("triton_attention and batch_invariant are two verify paths for the target; choose one")

    @staticmethod
    def from_args(args) -> "GpuPaths":
        """The paths as the flags give them (a flag left at None counts as off: see `resolve`)."""
        return GpuPaths(cuda_graphs=bool(getattr(args, "cuda_graphs", False)),
                        batch_invariant=bool(getattr(args, "batch_invariant", False)),
                        triton_attention=bool(getattr(args, "triton_attention", False)),
                        decode_ahead=bool(getattr(args, "decode_ahead", False)))

    @staticmethod
    def resolve(args, device: str, platform: Platform) -> "GpuPaths":
        """The paths for `device` (resolved) from the flags: --cuda-graphs and --triton-attention
        left unset (None) are on on CUDA for a native target (Triton attention also needs Triton,
        and is off with --batch-invariant), off otherwise; --enforce-eager turns CUDA graphs off.
        Asking for a path on the CPU, or for contradicting ones, is refused; --decode-ahead left
        unset is on on CUDA for a native target (whose runner chains decodes) and off otherwise,
        and may be asked for anywhere."""
        graphs, triton = getattr(args, "cuda_graphs", None), getattr(args, "triton_attention", None)
        invariant = bool(getattr(args, "batch_invariant", False))
        if getattr(args, "enforce_eager", False):
            if graphs:
                raise ValueError("--enforce-eager and --cuda-graphs contradict each other; give one")
            graphs = False
        if not is_cuda(device):
            asked = [flag for flag, on in (("--cuda-graphs", graphs), ("--triton-attention", triton),
                                           ("--batch-invariant", invariant)) if on]
            if asked:
                raise ValueError(f"{', '.join(asked)} need a CUDA device; got --device {device}")
        cuda = is_cuda(device) and platform.native
        if graphs is None:
            graphs = cuda
        if triton is None:
            triton = cuda and platform.triton and not invariant
        ahead = getattr(args, "decode_ahead", None)
        if ahead is None:
            ahead = cuda
        return GpuPaths(cuda_graphs=bool(graphs), batch_invariant=invariant, triton_attention=bool(triton),
                        decode_ahead=bool(ahead))

    def flags(self) -> list[str]:
        """Command-line flags that give an engine process the same paths, every one explicit."""
        return (["--cuda-graphs" if self.cuda_graphs else "--no-cuda-graphs",
                 "--triton-attention" if self.triton_attention else "--no-triton-attention"]
                + (["--batch-invariant"] if self.batch_invariant else [])
                + ["--decode-ahead" if self.decode_ahead else "--no-decode-ahead"])

    def describe(self, role: str = "verifier") -> str:
        """The paths `role` runs, in words ("CUDA graphs, Triton attention"; "eager")."""
        if role == "verifier":
            names = [name for name, on in (("CUDA graphs", self.runner_kwargs()["cuda_graphs"]),
                                           ("Triton attention", self.triton_attention),
                                           ("batch-invariant kernels", self.batch_invariant),
                                           ("decode ahead", self.decode_ahead)) if on]
        else:
            names = ["CUDA graphs"] if self.cuda_graphs else []
        return ", ".join(names) or "eager"

    def runner_kwargs(self) -> dict:
        return {"cuda_graphs": self.cuda_graphs and not self.batch_invariant, "batch_invariant": self.batch_invariant,
                "triton_attention": self.triton_attention}

    def proposer_kwargs(self) -> dict:
        return {"cuda_graphs": self.cuda_graphs}


def resolve_model_flags(args, platform: Platform):
    """A copy of parsed model flags with every `auto` and unset GPU path made explicit (--device,
    --dtype, --cuda-graphs, --triton-attention, --batch-invariant; --enforce-eager folded into
    --cuda-graphs), so that every engine, in this process or started from here, runs the same
    settings. Entry points call it once, with what they probed."""
    import copy

    device = resolve_device(args.device, platform.gpus)
    dtype = resolve_dtype(args.dtype, device)
    check_dtype(dtype, device)
    paths = GpuPaths.resolve(args, device, platform)
    out = copy.copy(args)
    out.device, out.dtype = device, dtype
    out.cuda_graphs, out.triton_attention, out.batch_invariant = (paths.cuda_graphs, paths.triton_attention,
                                                                  paths.batch_invariant)
    out.decode_ahead = paths.decode_ahead
    out.enforce_eager = False
    drafter_device = getattr(args, "drafter_device", None)
    if drafter_device not in (None, "auto"):
        out.drafter_device = resolve_device(drafter_device, platform.gpus)
        if is_cuda(out.drafter_device) != is_cuda(device):
            raise ValueError(f"--drafter-device {drafter_device} and --device {args.device} must both be CUDA or "
                             "both be the CPU (the GPU paths and dtype are resolved once for both)")
    return out


def engine_devices(device: str, gpus: int, backend: str, drafter_device: str = "auto") -> tuple[str, str]:
    """Where each engine runs -> (verifier device, drafter device), from a resolved --device,
    the GPUs visible and the backend. On the CPU both run there. With "cuda": two GPUs or more
    put the verifier on cuda:0 and the drafter on cuda:1, one GPU holds both (cuda:0). "cuda:N":
    both on that GPU. Ray assigns each actor its GPU (or a share of one: router/links_ray.py
    bundle_plan), which the actor sees as "cuda", so there "cuda:N" is refused. `drafter_device`
    (--backend local, grpc): "auto" as above, or the drafter's own device."""
    if backend not in ("local", "grpc", "ray"):
        raise ValueError(f"backend must be local, grpc or ray, got {backend!r}")
    if not is_cuda(device):
        verifier, drafter = device, device
    elif backend == "ray":
        if device != "cuda":
            raise ValueError(f"--backend ray places each actor on a GPU of its own choosing: give --device cuda "
                             f"(or auto), not {device}")
        verifier, drafter = "cuda", "cuda"
    elif device == "cuda":
        verifier, drafter = "cuda:0", ("cuda:1" if gpus >= 2 else "cuda:0")
    else:
        verifier, drafter = device, device
    if drafter_device != "auto":
        if backend == "ray":
            raise ValueError("--drafter-device is for --backend local and grpc; Ray places the drafter actor itself")
        drafter = drafter_device
    return verifier, drafter


DTYPES = ("float32", "bfloat16", "float16", "float64")


def check_dtype(dtype: str, device: str) -> None:
    """--dtype against --device: float64 is for CPU reference runs (the GPU's kernels take
    float32, bfloat16 and float16)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "float64" and device != "cpu":
        raise ValueError(f"--dtype float64 runs on --device cpu only (got --device {device}); "
                         "on a GPU use float32, bfloat16 or float16")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """What an engine is built from, by the one factory of each role (verifier/factory.py,
    drafter/factory.py) that the Ray actors, the gRPC services and the in-process backend all
    call. Built once from flags (`from_args`).

    target_dir: the target checkpoint (the drafter's EAGLE heads take its embeddings and lm_head;
    n-gram drafting may go without). draft_dir: the head or draft model. max_slots: requests held
    at once. max_len: context length (None: the target's). dtype: a torch dtype's name. kv_blocks /
    draft_kv_blocks: the verifier's / drafter's KV pool in blocks (None: on CUDA with
    gpu_memory_utilization given, sized from the memory budget, spectandem/memory.py; on the CPU
    with cpu_kv_cache_gib given, what that holds; else every slot at full context). block_size: cache
    entries per KV block (both). force_hf_target: the target runs on transformers even where a
    native implementation exists. gpu_memory_utilization: the fraction of the GPU's total memory
    the engine may use (None: no sizing; the command-line entry points give 0.9), less memory_reserved_gib (another engine's share of the same GPU);
    memory_budget_gib, where given, is the engine's budget instead (CUDA only).
    cpu_kv_cache_gib: on the CPU without kv_blocks / draft_kv_blocks, each engine's KV pool holds
    this many GiB (at most every slot at full context; None: every slot at full context)."""

    target_dir: str | None
    draft_dir: str | None = None
    spec: SpecConfig = SpecConfig()
    max_slots: int = 8
    max_len: int | None = None
    dtype: str = "float32"
    device: str = "cpu"
    kv_blocks: int | None = None
    draft_kv_blocks: int | None = None
    block_size: int = 16
    gpu: GpuPaths = GpuPaths()
    force_hf_target: bool = False
    gpu_memory_utilization: float | None = None
    memory_budget_gib: float | None = None
    memory_reserved_gib: float = 0.0
    cpu_kv_cache_gib: float | None = None

    def __post_init__(self):
        from spectandem.memory import check_cpu_kv_space, check_utilization

        object.__setattr__(self, "spec", self.spec.for_draft(self.draft_dir))   # the head's stated depth

        if self.cpu_kv_cache_gib is not None:
            check_cpu_kv_space(self.cpu_kv_cache_gib)

        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.gpu_memory_utilization is not None:
            check_utilization(self.gpu_memory_utilization)

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    @staticmethod
    def from_args(args, spec: SpecConfig, target_dir, draft_dir, max_slots: int) -> "EngineConfig":
        """The model flags (spectandem/service_args.py add_model_flags)
        of a parsed command line; `spec`, the directories and the slots as that command resolved them."""
        unresolved = [flag for flag, value in (("--device", args.device), ("--dtype", args.dtype)) if value == "auto"]
        if unresolved:
            raise ValueError(f"{', '.join(unresolved)} auto must be resolved first (resolve_model_flags)")
        check_dtype(args.dtype, args.device)
        return EngineConfig(target_dir=None if target_dir is None else str(target_dir),
                            draft_dir=None if draft_dir is None else str(draft_dir), spec=spec, max_slots=max_slots,
                            max_len=args.max_len, dtype=args.dtype, device=args.device,
                            kv_blocks=getattr(args, "kv_blocks", None),
                            draft_kv_blocks=getattr(args, "draft_kv_blocks", None), block_size=args.block_size,
                            gpu=GpuPaths.from_args(args),
                            gpu_memory_utilization=getattr(args, "gpu_memory_utilization", None),
                            memory_budget_gib=getattr(args, "memory_budget_gib", None),
                            memory_reserved_gib=getattr(args, "memory_reserved_gib", 0.0) or 0.0,
                            cpu_kv_cache_gib=getattr(args, "cpu_kv_cache_gib", None))
