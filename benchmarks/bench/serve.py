"""`spectandem bench serve`: a running server driven over its public API, measured as a user sees it.

    spectandem serve --backend local &                     # any spectandem server
    spectandem bench serve --num-prompts 64 --max-concurrency 8 --result-file serve.json
    spectandem bench serve --api openai --base-url http://localhost:8000 --address localhost:50051

Requests go out through the gRPC API (`spectandem.v1.Generation`, streaming, via the SDK) or the
OpenAI-compatible HTTP front (`POST /v1/completions`, streaming, `return_token_ids`). Arrivals:
all at once, or a Poisson process of `--request-rate` requests/s (seeded); at most
`--max-concurrency` in flight. Warm-up requests (`--num-warmups`, -1 = every measured prompt
once) go first at the same concurrency and are not counted.

Metrics, as `vllm bench serve` reports them: completed and failed requests, duration, request,
output and total token throughput; TTFT (to the first chunk that holds a token), TPOT (per
request, (e2e - ttft) / (output tokens - 1)), ITL (gaps between consecutive token chunks: under
speculation one chunk can hold several tokens) and E2E latency, each as mean, p50, p90, p99 in
ms; acceptance length (committed tokens per verify round, bonus included): per request from the
gRPC stream's final stats, or for the HTTP API from the server's GetServerStats counters before
and after the run when `--address` is given too (counting every client of that server then).
Those counters' differences (verify rounds per second, draft-ahead hits, ...) go in the JSON
whenever a gRPC address is known. To compare the router's pipeline modes, serve with each
`--pipeline` mode in turn and run the same command against it.

`run(config)` returns the dict that `--result-file` holds; the command prints it as a table.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from benchmarks.bench.datasets import DEFAULT_DATASET, DatasetError, load_prompts

APIS = ("grpc", "openai")
DEFAULT_ADDRESS = "localhost:50051"
DEFAULT_BASE_URL = "http://localhost:8000"
PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "tpot", "itl", "e2el")


class BenchServeError(Exception):
    """The run cannot take place: no server, a bad URL, no dataset. One line, exit code 1."""


@dataclass(frozen=True, kw_only=True)
class ServeBenchConfig:
    """One run of `spectandem bench serve`. `address`: the gRPC server (default localhost:50051
    with api "grpc"; with api "openai", optional: its stats give the acceptance length).
    `max_concurrency` None: no limit when `request_rate` is finite, else 1. `num_warmups` -1:
    every measured prompt once."""

    api: str = "grpc"
    address: str | None = None
    base_url: str = DEFAULT_BASE_URL
    api_key: str | None = None
    dataset: str = str(DEFAULT_DATASET)
    num_prompts: int = 64
    max_concurrency: int | None = None
    request_rate: float = math.inf
    max_tokens: int = 128
    ignore_eos: bool = False
    temperature: float = 0.0
    seed: int = 0
    num_warmups: int = 0
    save_outputs: bool = False
    label: str | None = None
    ready_timeout: float = 10.0
    request_timeout: float = 600.0
    progress: bool = True

    def __post_init__(self):
        if self.api not in APIS:
            raise ValueError(f"--api must be one of {', '.join(APIS)}, got {self.api!r}")
        for name, low in (("num_prompts", 1), ("max_tokens", 1), ("num_warmups", -1)):
            if getattr(self, name) < low:
                raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(self, name)}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if not self.request_rate > 0:
            raise ValueError(f"--request-rate must be > 0 requests/s (inf: all at once), got {self.request_rate}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"--temperature must be a finite number >= 0, got {self.temperature}")
        if not 0 <= self.seed < 2 ** 63:
            raise ValueError(f"--seed must be in [0, 2**63), got {self.seed}")
        for name in ("ready_timeout", "request_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be > 0 seconds, got {getattr(self, name)}")

    @property
    def concurrency(self) -> int | None:
        """Requests in flight at most (None: no limit)."""
        if self.max_concurrency is not None:
            return self.max_concurrency
        return None if math.isfinite(self.request_rate) else 1

    @property
    def grpc_address(self) -> str | None:
        return self.address or (DEFAULT_ADDRESS if self.api == "grpc" else None)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    prompt_index: int
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    chunks: int = 0                   # chunks that held a token
    prompt_tokens: int = 0
    output_ids: list[int] = field(default_factory=list)
    spec: dict | None = None          # the server's per-request speculation stats (gRPC)


# ------------------------------------------------------------------------------ requests

class _Timer:
    """Token-chunk arrival times of one request."""

    def __init__(self, result: RequestResult):
        self.result, self.t0 = result, time.perf_counter()
        self.last: float | None = None

    def tokens(self, ids: list[int]) -> None:
        if not ids:
            return
        now, r = time.perf_counter(), self.result
        if self.last is None:
            r.ttft = now - self.t0
        else:
            r.itl.append(now - self.last)
        self.last = now
        r.chunks += 1
        r.output_ids.extend(ids)

    def done(self) -> None:
        self.result.e2e = time.perf_counter() - self.t0
        self.result.ok = True


class _Grpc:
    """Requests over the gRPC API (the SDK's AsyncClient, no retries: a failure counts)."""

    def __init__(self, config: ServeBenchConfig):
        from spectandem.client import AsyncClient

        self.config, self.address = config, config.grpc_address
        self.client = AsyncClient(self.address, max_retries=0, api_key=config.api_key)

    async def start(self) -> str:
        from spectandem.client import SpectandemError

        try:
            await self.client.wait_for_ready(self.config.ready_timeout)
            info = await self.client.model_info(timeout=self.config.ready_timeout)
        except SpectandemError as exc:
            raise BenchServeError(f"cannot reach the gRPC server at {self.address}: {exc}") from None
        return info["target_model"]

    async def send(self, text: str, seed: int, result: RequestResult) -> None:
        from spectandem.config import SamplingParams

        c = self.config
        params = SamplingParams(max_tokens=c.max_tokens, temperature=c.temperature, seed=seed,
                                ignore_eos=c.ignore_eos)
        timer = _Timer(result)
        async for chunk in self.client.stream(text, params, timeout=c.request_timeout):
            timer.tokens(chunk.token_ids)
            if chunk.stats is not None:
                result.spec = chunk.stats
                result.prompt_tokens = chunk.stats["prompt_tokens"]
        timer.done()

    async def close(self) -> None:
        await self.client.close()


class _OpenAI:
    """Requests to the HTTP front's /v1/completions, streamed as server-sent events."""

    def __init__(self, config: ServeBenchConfig):
        import aiohttp

        self.config, self.base = config, _check_base_url(config.base_url)
        self.headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
        self.session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=config.request_timeout))
        self.model = None

    async def start(self) -> str:
        import aiohttp

        try:
            async with self.session.get(f"{self.base}/v1/models", headers=self.headers,
                                        timeout=aiohttp.ClientTimeout(total=self.config.ready_timeout)) as resp:
                body = await resp.text()
                if resp.status != 200:
                    raise BenchServeError(f"{self.base}/v1/models answered HTTP {resp.status}: {body[:200]}")
                self.model = json.loads(body)["data"][0]["id"]
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
            raise BenchServeError(f"cannot reach the HTTP server at {self.base}: {exc or type(exc).__name__}") from None
        except (ValueError, KeyError, IndexError, TypeError):
            raise BenchServeError(f"{self.base}/v1/models did not answer an OpenAI model list") from None
        return self.model

    async def send(self, text: str, seed: int, result: RequestResult) -> None:
        c = self.config
        body = {"model": self.model, "prompt": text, "max_tokens": c.max_tokens, "temperature": c.temperature,
                "seed": seed, "ignore_eos": c.ignore_eos, "stream": True, "return_token_ids": True,
                "stream_options": {"include_usage": True}}
        timer = _Timer(result)
        async with self.session.post(f"{self.base}/v1/completions", json=body, headers=self.headers) as resp:
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:300]}")
            finished = False
            async for raw in resp.content:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    raise RuntimeError(f"{event['error'].get('code')}: {event['error'].get('message')}")
                for ch in event.get("choices") or ():
                    timer.tokens(ch.get("token_ids") or [])
                    finished = finished or ch.get("finish_reason") is not None
                if event.get("usage"):
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
            if not finished:
                raise RuntimeError("the stream ended without a finish_reason")
        timer.done()

    async def close(self) -> None:
        await self.session.close()


def _check_base_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.query or parts.fragment:
        raise BenchServeError(f"--base-url: expected http(s)://HOST:PORT, got {url!r}")
    try:
        parts.port
    except ValueError:
        raise BenchServeError(f"--base-url: bad port in {url!r}") from None
    path = parts.path.rstrip("/")
    if path.endswith("/v1"):     # given as the OpenAI SDK's base_url
        path = path[:-3]
    return f"{parts.scheme}://{parts.netloc}{path}"


async def _server_stats(address: str, api_key: str | None, timeout: float):
    """GetServerStats of the gRPC server at `address`."""
    import grpc

    from spectandem.v1 import generation_pb2, generation_pb2_grpc

    async with grpc.aio.insecure_channel(address) as channel:
        try:
            return await generation_pb2_grpc.GenerationStub(channel).GetServerStats(
                generation_pb2.GetServerStatsRequest(), timeout=timeout,
                metadata=(("authorization", f"Bearer {api_key}"),) if api_key else None)
        except grpc.RpcError as exc:
            raise BenchServeError(f"cannot read the server stats at {address}: {exc.code().name}: "
                                  f"{exc.details()}") from None


# ------------------------------------------------------------------------------ the run

class _Progress:
    """completed/total and output tokens/s on one stderr line, redrawn in place."""

    def __init__(self, total: int, enabled: bool, what: str):
        self.total, self.enabled, self.what = total, enabled, what
        self.done = self.tokens = 0
        self.t0 = time.perf_counter()

    def update(self, r: RequestResult) -> None:
        self.done += 1
        self.tokens += len(r.output_ids)
        if self.enabled:
            rate = self.tokens / max(time.perf_counter() - self.t0, 1e-9)
            sys.stderr.write(f"\r{self.what} {self.done}/{self.total} requests, {rate:.1f} output tokens/s")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled:
            sys.stderr.write("\n")


async def _drive(api, jobs: list[tuple[int, str, int]], config: ServeBenchConfig, rng: random.Random | None,
                 progress: _Progress) -> list[RequestResult]:
    """Send jobs (prompt index, text, seed): arrivals by `rng`'s Poisson process (None: all at
    once), at most `config.concurrency` in flight; every request's result, failures included."""
    limit = config.concurrency
    gate = asyncio.Semaphore(limit) if limit else None

    async def one(index: int, text: str, seed: int) -> RequestResult:
        result = RequestResult(prompt_index=index)
        if gate is not None:
            await gate.acquire()
        try:
            await api.send(text, seed, result)
        except Exception as exc:   # counted and reported, never raised: the run goes on
            result.ok, result.error = False, f"{type(exc).__name__}: {exc}"
        finally:
            if gate is not None:
                gate.release()
        progress.update(result)
        return result

    tasks = []
    for i, job in enumerate(jobs):
        if rng is not None and i:
            await asyncio.sleep(rng.expovariate(config.request_rate))
        tasks.append(asyncio.create_task(one(*job)))
    return list(await asyncio.gather(*tasks))


def measured_prompts(dataset: str | Path, num_prompts: int, seed: int = 0) -> list[str]:
    """The texts a run with this dataset, --num-prompts and --seed measures, in the order it sends
    them (an engine-loop reference of the same prompts: benchmarks/serve_matrix.py)."""
    texts = [p.text for p in load_prompts(dataset, seed=seed)]
    return [t for _, t, _ in _jobs(ServeBenchConfig(num_prompts=num_prompts, seed=seed), texts)]


def _jobs(config: ServeBenchConfig, texts: list[str]) -> list[tuple[int, str, int]]:
    """The measured requests: num_prompts prompts in an order drawn from the seed (the dataset
    repeated when it is shorter), each with its own seed."""
    rng = random.Random(config.seed)
    order = list(range(len(texts)))
    rng.shuffle(order)
    picks = [order[i % len(order)] for i in range(config.num_prompts)]
    return [(p, texts[p], rng.getrandbits(63)) for p in picks]


async def _run(config: ServeBenchConfig) -> dict:
    try:
        prompts = load_prompts(config.dataset, seed=config.seed)
    except DatasetError as exc:
        raise BenchServeError(str(exc)) from None
    api = _Grpc(config) if config.api == "grpc" else _OpenAI(config)
    try:
        model = await api.start()
        jobs = _jobs(config, [p.text for p in prompts])
        warmups = jobs if config.num_warmups == -1 else [jobs[i % len(jobs)] for i in range(config.num_warmups)]
        warm = []
        if warmups:
            bar = _Progress(len(warmups), config.progress, "warm-up")
            warm = await _drive(api, warmups, config, None, bar)
            bar.close()
        stats_address = config.grpc_address
        before = await _server_stats(stats_address, config.api_key, config.ready_timeout) if stats_address else None
        rng = random.Random(config.seed + 1) if math.isfinite(config.request_rate) else None
        bar = _Progress(len(jobs), config.progress, "bench")
        t0 = time.perf_counter()
        results = await _drive(api, jobs, config, rng, bar)
        duration = time.perf_counter() - t0
        bar.close()
        after = await _server_stats(stats_address, config.api_key, config.ready_timeout) if stats_address else None
    finally:
        await api.close()
    out = summarize(config, results, duration, model, prompts)
    out.update(_acceptance(config, results, before, after))
    out["server_counters"] = _counters(before, after, duration)
    warm_failed = [r for r in warm if not r.ok]
    out.update(warmups=len(warm), warmup_failed=len(warm_failed),
               warmup_first_error=warm_failed[0].error if warm_failed else None)
    out["requests"] = [_request_row(r, prompts, config.save_outputs) for r in results]
    return out


def _request_row(r: RequestResult, prompts, outputs: bool) -> dict:
    """One measured request in the JSON; with `outputs`, its prompt and output token ids too."""
    ms = (lambda v: None if v is None else round(v * 1000, 4))
    tpot = (r.e2e - r.ttft) / (len(r.output_ids) - 1) if r.ok and len(r.output_ids) > 1 else None
    row = {"prompt_index": r.prompt_index, "ok": r.ok, "error": r.error, "prompt_tokens": r.prompt_tokens,
           "output_tokens": len(r.output_ids), "chunks": r.chunks, "ttft_ms": ms(r.ttft), "tpot_ms": ms(tpot),
           "e2el_ms": ms(r.e2e), "itl_ms": [ms(g) for g in r.itl],
           "accept_length": r.spec["accept_length"] if r.spec else None}
    if outputs:
        row.update(source=prompts[r.prompt_index].source, prompt=prompts[r.prompt_index].text,
                   output_token_ids=r.output_ids)
    return row


def run(config: ServeBenchConfig) -> dict:
    """Run the benchmark; the result dict (what --result-file holds). Raises BenchServeError
    when it cannot start (no server, bad URL, no dataset)."""
    return asyncio.run(_run(config))


# ------------------------------------------------------------------------------ metrics

def _dist(values: list[float], name: str, scale: float = 1000.0, unit: str = "_ms") -> dict:
    import numpy as np

    out = {f"mean_{name}{unit}": None, **{f"p{p}_{name}{unit}": None for p in PERCENTILES}}
    if values:
        a = np.asarray(values, dtype=float) * scale
        out[f"mean_{name}{unit}"] = round(float(a.mean()), 4)
        for p in PERCENTILES:
            out[f"p{p}_{name}{unit}"] = round(float(np.percentile(a, p)), 4)
    return out


def summarize(config: ServeBenchConfig, results: list[RequestResult], duration: float, model: str,
              prompts) -> dict:
    """The run's metrics, without the acceptance length."""
    ok = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    out_tokens = sum(len(r.output_ids) for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpot = [(r.e2e - r.ttft) / (len(r.output_ids) - 1) for r in ok if len(r.output_ids) > 1]
    chunks = sum(r.chunks for r in ok)
    settings = {k: (None if isinstance(v, float) and math.isinf(v) else v) for k, v in asdict(config).items()
                if k not in ("api_key", "progress")}
    return {
        "label": config.label, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "api": config.api,
        "endpoint": config.grpc_address if config.api == "grpc" else _check_base_url(config.base_url),
        "model": model, "dataset": config.dataset, "dataset_prompts": len(prompts),
        "settings": settings, "max_concurrency": config.concurrency,
        "request_rate": None if math.isinf(config.request_rate) else config.request_rate,
        "num_prompts": len(results), "completed": len(ok), "failed": len(failed),
        "first_error": failed[0].error if failed else None,
        "duration_s": round(duration, 4),
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": round(len(ok) / duration, 4),
        "output_throughput": round(out_tokens / duration, 4),
        "total_token_throughput": round((in_tokens + out_tokens) / duration, 4),
        **_dist([r.ttft for r in ok if r.ttft is not None], "ttft"),
        **_dist(tpot, "tpot"),
        **_dist([g for r in ok for g in r.itl], "itl"),
        **_dist([r.e2e for r in ok], "e2el"),
        "mean_tokens_per_chunk": round(out_tokens / chunks, 4) if chunks else None,
    }


COUNTERS = ("rounds", "num_drafts", "draft_tokens", "accepted_tokens", "fallback_rounds", "plain_rounds",
            "draft_ahead_hits", "draft_ahead_misses", "ready_trees", "posted_trees", "early_tree_rounds",
            "preemptions", "requests_finished", "requests_failed")


def _counters(before, after, duration: float) -> dict | None:
    """The server's counters over the measured part (GetServerStats after minus before; every
    client of the server counts), verify rounds per second and the draft-ahead hit share."""
    if before is None:
        return None
    out = {f: getattr(after, f) - getattr(before, f) for f in COUNTERS}
    modes = {m: n - before.mode_rounds.get(m, 0) for m, n in after.mode_rounds.items()}   # by pipeline mode
    out["mode_rounds"] = {m: n for m, n in sorted(modes.items()) if n}
    looked = out["draft_ahead_hits"] + out["draft_ahead_misses"]
    out["rounds_per_s"] = round(out["rounds"] / duration, 4)
    out["draft_ahead_hit_share"] = round(out["draft_ahead_hits"] / looked, 4) if looked else None
    return out


def _acceptance(config: ServeBenchConfig, results: list[RequestResult], before, after) -> dict:
    """Acceptance length (committed tokens per verify round, bonus included) and where it came
    from: the gRPC stream's per-request stats (gRPC API), else the server's counters over the run
    (HTTP API with --address). `server_acceptance_length`: those counters' figure whenever a gRPC
    address is known (every client of the server counts)."""
    out = {"acceptance_source": None, "acceptance_length": None, **_dist([], "acceptance_length", 1.0, ""),
           "server_acceptance_length": None}
    if before is not None:
        rounds = sum(getattr(after, f) - getattr(before, f) for f in ("num_drafts", "fallback_rounds", "plain_rounds"))
        accepted = after.accepted_tokens - before.accepted_tokens
        out["server_acceptance_length"] = round((accepted + rounds) / rounds, 4) if rounds > 0 else None
    if config.api == "grpc":
        spec = [r.spec for r in results if r.ok and r.spec and r.spec["num_rounds"]]
        if spec:
            rounds = sum(s["num_rounds"] for s in spec)
            out.update(acceptance_source="grpc-stream-stats",
                       acceptance_length=round((sum(s["accepted_tokens"] for s in spec) + rounds) / rounds, 4),
                       **_dist([s["accept_length"] for s in spec], "acceptance_length", 1.0, ""))
    elif out["server_acceptance_length"] is not None:
        out.update(acceptance_source=f"server-stats-delta ({config.grpc_address}; every client of the server)",
                   acceptance_length=out["server_acceptance_length"])
    return out


# ------------------------------------------------------------------------------ output

def format_table(res: dict) -> str:
    """A fixed-width table of one run's metrics (a value too long for its column extends the line)."""
    def num(v, fmt="{:.2f}"):
        return "n/a" if v is None else fmt.format(v) if isinstance(v, float) else str(v)

    def row(key: str, value) -> str:
        return f"{key + ':':<40}{value!s:>20}"

    def rule(title: str, fill: str) -> str:
        return f" {title} ".center(60, fill) if title else fill * 60

    stats = ("mean",) + tuple(f"p{p}" for p in PERCENTILES)
    lines = [rule("Serving Benchmark Result", "="),
             row("Label", res["label"] or ""), row("API", res["api"]), row("Endpoint", res["endpoint"]),
             row("Model", res["model"]),
             row("Maximum concurrency", res["max_concurrency"] or "unlimited"),
             row("Request rate (req/s)", num(res["request_rate"]) if res["request_rate"] else "inf"),
             row("Warm-up requests (not counted)", f"{res['warmups']} ({res['warmup_failed']} failed)"),
             row("Successful requests", res["completed"]), row("Failed requests", res["failed"]),
             row("Benchmark duration (s)", num(res["duration_s"])),
             row("Total input tokens", res["total_input_tokens"]),
             row("Total generated tokens", res["total_output_tokens"]),
             row("Request throughput (req/s)", num(res["request_throughput"])),
             row("Output token throughput (tok/s)", num(res["output_throughput"])),
             row("Total token throughput (tok/s)", num(res["total_token_throughput"]))]
    titles = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
              "itl": "Inter-token Latency (between chunks)", "e2el": "End-to-end Latency"}
    for name in LATENCIES:
        lines.append(rule(titles[name], "-"))
        lines += [row(f"{stat.capitalize()} {name.upper()} (ms)", num(res[f"{stat}_{name}_ms"])) for stat in stats]
    lines += [rule("Speculation", "-"), row("Tokens per chunk (mean)", num(res["mean_tokens_per_chunk"])),
              row("Acceptance length", num(res["acceptance_length"], "{:.3f}")),
              row("  from", res["acceptance_source"] or "unknown (HTTP API without --address)")]
    if res["mean_acceptance_length"] is not None:
        lines += [row(f"  per request, {stat}", num(res[f"{stat}_acceptance_length"], "{:.3f}")) for stat in stats]
    if res["api"] == "grpc":
        lines.append(row("Server counters' acceptance length", num(res["server_acceptance_length"], "{:.3f}")))
    lines.append(rule("", "="))
    return "\n".join(lines)


def draw(res: dict, path: Path) -> Path:
    """Histograms of TTFT, TPOT, ITL and E2E latency over the run's completed requests (from the
    result dict's per-request rows; needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, name in zip(axes.flat, LATENCIES):
        rows = [r for r in res["requests"] if r["ok"]]
        values = [g for r in rows for g in r["itl_ms"]] if name == "itl" else \
            [r[f"{name}_ms"] for r in rows if r[f"{name}_ms"] is not None]
        ax.hist(values, bins=min(40, max(5, len(values) // 2)) if values else 1)
        ax.set_title(f"{name.upper()} (ms)")
        ax.set_xlabel("ms")
        ax.set_ylabel("count")
    fig.suptitle(f"spectandem bench serve: {res['api']} {res['endpoint']}" + (f" — {res['label']}" if res["label"] else ""))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ command line

def _flag(p, name: str, **kw) -> None:
    """An option whose value lands in `serve_<name>`, apart from `spectandem bench`'s own options."""
    if kw.get("action") is None and "choices" not in kw:
        kw.setdefault("metavar", name[2:].replace("-", "_").upper())
    p.add_argument(name, dest="serve_" + name[2:].replace("-", "_"), **kw)


def add_serve_bench(sub) -> None:
    """`spectandem bench serve`, a subcommand of `spectandem bench`."""
    import argparse

    from spectandem.service_args import HelpFormatter

    class Formatter(argparse.RawDescriptionHelpFormatter, HelpFormatter):
        """The module docstring as written; each option's default shown."""

    p = sub.add_parser("serve", help="drive a running server over its public API (as vllm bench serve)",
                       description=__doc__, formatter_class=Formatter)
    _flag(p, "--api", choices=APIS, default="grpc", help="the API requests go through")
    _flag(p, "--address", default=None, metavar="HOST:PORT",
          help=f"the gRPC server (default: {DEFAULT_ADDRESS} with --api grpc; with --api openai, none: when "
               "given, its GetServerStats counters before and after the run give the acceptance length)")
    _flag(p, "--base-url", default=DEFAULT_BASE_URL, metavar="http://HOST:PORT",
          help="the OpenAI-compatible HTTP server (--api openai): streams POST /v1/completions")
    _flag(p, "--api-key", default=None, help="bearer token for a server run with --api-key "
                                            "(default: $SPECTANDEM_API_KEY)")
    _flag(p, "--dataset", default=None, metavar="PATH",
          help='a JSONL file of {"prompt": ...} lines, or a corpus file (.txt, .txt.xz) whose held-out '
               "documents give the prompts (benchmarks/bench/datasets.py) (default: the shipped "
               "benchmarks/data/heldout-prompts.jsonl)")
    _flag(p, "--num-prompts", type=int, default=64, help="measured requests")
    _flag(p, "--max-concurrency", type=int, default=None,
          help="requests in flight at most (default: no limit with --request-rate, else 1)")
    _flag(p, "--request-rate", type=float, default=math.inf,
          help="requests per second, Poisson arrivals seeded by --seed; inf: all at once (within the concurrency cap)")
    _flag(p, "--max-tokens", type=int, default=128, help="max_tokens of every request")
    _flag(p, "--ignore-eos", action="store_true", help="generate max-tokens tokens past the end-of-sequence token")
    _flag(p, "--temperature", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    _flag(p, "--seed", type=int, default=0,
          help="seed of the prompt order, arrival times and the requests' own seeds (one derived per request)")
    _flag(p, "--num-warmups", type=int, default=0,
          help="requests sent and awaited before measuring, from the measured prompts, at the same concurrency; "
               "-1: every measured prompt once")
    _flag(p, "--ready-timeout", type=float, default=10.0, help="seconds to wait for the server to answer at start")
    _flag(p, "--request-timeout", type=float, default=600.0, help="deadline of each request in seconds")
    _flag(p, "--result-file", default=None, metavar="PATH", help="write the results as JSON here")
    _flag(p, "--plot", default=None, metavar="PATH", help="draw latency histograms to this PNG (needs matplotlib)")
    _flag(p, "--save-outputs", action="store_true",
          help="store each request's prompt and output token ids in the JSON")
    _flag(p, "--label", default=None, help="free text stored in the JSON and printed with the table")
    _flag(p, "--no-progress", action="store_true", help="no progress line on stderr")
    p.set_defaults(func=bench_serve)


def config_from_args(args) -> ServeBenchConfig:
    import os

    s = {k[len("serve_"):]: v for k, v in vars(args).items() if k.startswith("serve_")}
    return ServeBenchConfig(
        api=s["api"], address=s["address"], base_url=s["base_url"],
        api_key=s["api_key"] or os.environ.get("SPECTANDEM_API_KEY"), dataset=s["dataset"] or str(DEFAULT_DATASET),
        num_prompts=s["num_prompts"], max_concurrency=s["max_concurrency"], request_rate=s["request_rate"],
        max_tokens=s["max_tokens"], ignore_eos=s["ignore_eos"], temperature=s["temperature"], seed=s["seed"],
        num_warmups=s["num_warmups"], save_outputs=s["save_outputs"], label=s["label"],
        ready_timeout=s["ready_timeout"], request_timeout=s["request_timeout"], progress=not s["no_progress"])


def bench_serve(args) -> int:
    """The command: run, print the table, write the JSON and PNG. Exit code 1 when the run cannot
    start or any request (warm-ups included) failed (the first error printed)."""
    from benchmarks.bench.plot import have_matplotlib

    given = sorted(k for k, v in getattr(args, "bench_defaults", {}).items()
                   if k not in ("func", "bench_command") and getattr(args, k) != v)
    if given:
        raise ValueError(f"--{given[0].replace('_', '-')} is an option of `spectandem bench`, not of "
                         "`spectandem bench serve` (its options go after `serve`)")
    config = config_from_args(args)
    try:
        res = run(config)
    except BenchServeError as exc:
        print(f"spectandem: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(res))
    if args.serve_result_file:
        path = Path(args.serve_result_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(res, indent=2) + "\n")
        print(f"-> {path}")
    if args.serve_plot:
        if have_matplotlib():
            print(f"-> {draw(res, Path(args.serve_plot))}")
        else:
            print("plot skipped: matplotlib is not installed (pip install 'spectandem[bench]')")
    if res["warmup_failed"]:
        print(f"spectandem: error: {res['warmup_failed']} of {res['warmups']} warm-up requests failed; the first: "
              f"{res['warmup_first_error']}", file=sys.stderr)
    if res["failed"]:
        print(f"spectandem: error: {res['failed']} of {res['num_prompts']} requests failed; the first: "
              f"{res['first_error']}", file=sys.stderr)
    return 1 if res["failed"] or res["warmup_failed"] else 0
