"""Prometheus metrics of the router, named like vLLM's with the prefix `spectandem:`.

Two sources, one registry (a private `CollectorRegistry`, so nothing process-global leaks in):

- `RouterCollector` reads `Router.counters`, the queues and the engines' slot use *at scrape
  time*, so /metrics can never drift from what the router (and GetServerStats) reports.
    counters   spectandem:spec_decode_num_drafts, _num_draft_tokens, _num_accepted_tokens,
               _num_accepted_tokens_per_pos{position} (position 0 = the first draft token),
               spectandem:num_rounds, num_rounds_by_mode{mode} (the pipeline mode that ran them),
               num_preemptions, num_resumes, num_fallback_rounds (drafter unavailable),
               num_plain_rounds (speculation switched off), num_drafter_outages,
               num_stale_replies_dropped, num_draft_ahead_{hits,misses}, num_ready_trees, num_posted_trees,
               num_early_tree_rounds, num_detached_admissions, num_detached_running,
               num_mixed_prefills, num_prefills_with_verdicts,
               num_requests_{admitted,finished,failed,cancelled}
               (exposed with the `_total` suffix)
               spectandem:num_decode_ahead_taken, num_decode_ahead_forgotten (summed over the
               verifiers that decode ahead, read from their info: the plain decodes that took the
               chunk queued after the last call, and the queued chunks forgotten unused)
               spectandem:num_feature_channel_messages{path="ring"|"group"} (summed over the
               verifiers, read from their info: the feature channel's messages written into the
               payload ring, and those that went over the channel's group instead, the slower way)
    gauges     spectandem:num_requests_running, num_requests_waiting,
               spectandem:kv_cache_usage_perc{side="verifier"|"drafter"} (0..1)
- `RequestTimings`, a router listener, observes latencies from request events:
    histograms spectandem:time_to_first_token_seconds (submit -> first token),
               spectandem:time_per_output_token_seconds (per finished request: (end - first
               token) / (tokens - 1); a per-chunk interval would mislead, as one speculative
               round commits several tokens), spectandem:e2e_request_latency_seconds
               (submit -> finish, finished requests only)
    counters   spectandem:prompt_tokens, spectandem:generation_tokens

PromQL as for vLLM: acceptance rate = rate(..._num_accepted_tokens_total) /
rate(..._num_draft_tokens_total); mean acceptance length (bonus token included) = 1 +
rate(..._num_accepted_tokens_total) / rate(..._num_drafts_total).
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

log = logging.getLogger("spectandem.metrics")

PREFIX = "spectandem:"
INFO_TIMEOUT_S = 1.0   # an engine that does not answer within this is left out of one scrape

# vLLM's buckets, with finer low ends: the demo pair answers in milliseconds.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# (metric name without prefix, RouterCounters field, help)
ROUTER_COUNTERS = (
    ("spec_decode_num_drafts", "num_drafts", "Request-rounds verified with a draft"),
    ("spec_decode_num_draft_tokens", "draft_tokens", "Draft tokens verified"),
    ("spec_decode_num_accepted_tokens", "accepted_tokens", "Draft tokens accepted"),
    ("num_rounds", "rounds", "Verification rounds (one batched verify each)"),
    ("num_preemptions", "preemptions", "Requests preempted (their cache freed, to be resumed)"),
    ("num_resumes", "resumes", "Preempted requests resumed"),
    ("num_fallback_rounds", "fallback_rounds",
     "Request-rounds decoded without a draft because the drafter was unavailable"),
    ("num_plain_rounds", "plain_rounds",
     "Request-rounds decoded without a draft because speculation was switched off (auto chose plain, "
     "low acceptance, admitted without the drafter) or the request joined beside that round's draft"),
    ("num_drafter_outages", "drafter_outages", "Times the drafter became unavailable"),
    ("num_stale_replies_dropped", "stale_dropped", "Engine replies of an old epoch or length, dropped unapplied"),
    ("num_draft_ahead_hits", "draft_ahead_hits", "Trees drafted ahead (pipelined) that were used"),
    ("num_draft_ahead_misses", "draft_ahead_misses", "Trees drafted ahead (pipelined) that were discarded"),
    ("num_ready_trees", "ready_trees", "Trees drafted ahead that the router verified without a draft call"),
    ("num_posted_trees", "posted_trees",
     "Request-rounds whose trees went from the drafter to the verifier over the tree channel"),
    ("num_early_tree_rounds", "early_tree_rounds",
     "Rounds whose trees the drafter drafted on the last verdicts and sent early, verified without a draft call"),
    ("num_detached_admissions", "detached_admissions",
     "Requests admitted without the drafter while auto had settled on plain decoding"),
    ("num_detached_running", "detached_running",
     "Running requests that left the drafter when auto settled on plain decoding"),
    ("num_mixed_prefills", "mixed_prefills",
     "Requests sent with a round's verify to be prefilled in its step (the rest of a step's budget prefill apart)"),
    ("num_prefills_with_verdicts", "prefills_with_verdicts",
     "Requests prefilled in a verify step whose drafter prefill went with that verify's verdicts over the tree channel"),
    ("num_requests_admitted", "requests_admitted", "Requests admitted to the running batch"),
    ("num_requests_finished", "requests_finished", "Requests finished (stop or length)"),
    ("num_requests_failed", "requests_failed", "Requests ended by an error"),
    ("num_requests_cancelled", "requests_cancelled", "Requests cancelled by the client, a disconnect or a deadline"),
)


def decode_ahead_sums(infos) -> dict[str, int]:
    """The verifiers' decode-ahead counts (EngineInfo.decode_ahead) summed: {"taken", "forgotten"}."""
    sums = {"taken": 0, "forgotten": 0}
    for info in infos:
        for key in sums:
            sums[key] += int((getattr(info, "decode_ahead", None) or {}).get(key, 0))
    return sums


def feature_channel_sums(infos) -> dict[str, int]:
    """The verifiers' feature-channel messages by the way they went (EngineInfo.extra) summed:
    {"ring", "group"}."""
    sums = {"ring": 0, "group": 0}
    for info in infos:
        extra = getattr(info, "extra", None) or {}
        for key in sums:
            sums[key] += int(extra.get(f"feature_{key}_messages", 0))
    return sums


class RouterCollector:
    """Counters and gauges read from the router when scraped.

    `links` maps a side ("verifier", "drafter") to its engine links (one per replica; a side's
    usage sums over them). `positions` is the deepest draft position a round can accept
    (positions 0..positions-1 are always exposed, at 0 until reached). `default_slots` stands in
    for an engine that reports no slot limit (an in-process drafter sized like the router)."""

    def __init__(self, router, links: dict, positions: int = 0, default_slots: int = 0):
        self.router, self.links, self.positions, self.default_slots = router, links, positions, default_slots
        self._kv_usage: dict[str, float] = {}
        self._ahead: dict[str, int] = {"taken": 0, "forgotten": 0}
        self._channel: dict[str, int] = {"ring": 0, "group": 0}

    async def refresh(self) -> None:
        """Polls the engines' slot use and the verifiers' decode-ahead and feature-channel counts
        (async, so before the synchronous collect)."""
        usage, infos = {}, []
        for side, links in self.links.items():
            used = total = 0
            for link in links:
                try:
                    info = await asyncio.wait_for(link.info(), INFO_TIMEOUT_S)
                except Exception as exc:  # a down engine must not fail the scrape; it is left out
                    log.debug("metrics: %s info failed: %s", side, exc)
                    continue
                u, t = kv_usage(info, self.default_slots)
                used, total = used + u, total + t
                infos.append(info)
            if total > 0:
                usage[side] = used / total
        self._kv_usage, self._ahead = usage, decode_ahead_sums(infos)
        self._channel = feature_channel_sums(infos)

    def collect(self):
        c = self.router.counters
        for name, field, doc in ROUTER_COUNTERS:
            yield CounterMetricFamily(PREFIX + name, doc, value=getattr(c, field))
        per_pos = CounterMetricFamily(PREFIX + "spec_decode_num_accepted_tokens_per_pos",
                                      "Drafts accepted at least to this position (0 = the first draft token)",
                                      labels=["position"])
        accepted = list(c.accepted_per_pos)
        for i in range(max(self.positions, len(accepted))):
            per_pos.add_metric([str(i)], accepted[i] if i < len(accepted) else 0)
        yield per_pos
        by_mode = CounterMetricFamily(PREFIX + "num_rounds_by_mode",
                                      "Verification rounds by the pipeline mode that ran them", labels=["mode"])
        for mode, n in sorted(c.mode_rounds.items()):
            by_mode.add_metric([mode], n)
        yield by_mode
        yield CounterMetricFamily(PREFIX + "num_decode_ahead_taken",
                                  "Plain decodes whose tokens the verifier had queued after the last call (decode ahead)",
                                  value=self._ahead["taken"])
        yield CounterMetricFamily(PREFIX + "num_decode_ahead_forgotten",
                                  "Decodes the verifier queued ahead and forgot unused", value=self._ahead["forgotten"])
        channel = CounterMetricFamily(PREFIX + "num_feature_channel_messages",
                                      "The verifiers' feature-channel messages, by the way they went: into the payload "
                                      "ring, or over the channel's group (larger than a slot)",
                                      labels=["path"])
        for path, n in sorted(self._channel.items()):
            channel.add_metric([path], n)
        yield channel
        yield GaugeMetricFamily(PREFIX + "num_requests_running", "Requests in the running batch",
                                value=len(self.router.running))
        yield GaugeMetricFamily(PREFIX + "num_requests_waiting", "Requests waiting for admission",
                                value=len(self.router.waiting))
        kv = GaugeMetricFamily(PREFIX + "kv_cache_usage_perc",
                               "KV-cache usage per engine, 0..1 (cache blocks, else request slots)", labels=["side"])
        for side, frac in sorted(self._kv_usage.items()):
            kv.add_metric([side], frac)
        yield kv


def kv_usage(info, default_slots: int = 0) -> tuple[int, int]:
    """(used, total) KV capacity of an engine: cache blocks when its info reports a paged cache
    (`EngineInfo.kv`: num_blocks, used_blocks), else request slots."""
    kv = getattr(info, "kv", None) or {}  # engines of an older build report slots only
    if kv.get("num_blocks"):
        return int(kv.get("used_blocks", 0)), int(kv["num_blocks"])
    return info.used_slots, info.max_slots or default_slots


class RequestTimings:
    """A router listener: latency histograms and token counters from request events. Timestamps
    are monotonic and taken in the router's event loop (submit time: `ServedRequest.started`)."""

    def __init__(self, registry: CollectorRegistry):
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Submit to first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "Per finished request: (finish - first token) / (tokens - 1)",
                              buckets=TPOT_BUCKETS, registry=registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Submit to finish (finished requests)",
                             buckets=E2E_BUCKETS, registry=registry)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of admitted requests", registry=registry)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Tokens streamed to clients", registry=registry)
        # id(request) -> monotonic time of its first token; keyed by identity, as clients may
        # reuse request ids. Dropped at the request's terminal event.
        self._first: dict[int, float] = {}

    def __call__(self, event: str, req, data) -> None:
        now = time.monotonic()
        if event == "admitted":
            self.prompt_tokens.inc(len(req.prompt_ids))
        elif event == "tokens":
            self.generation_tokens.inc(data["count"])
            if data.get("first"):
                self._first[id(req)] = now
                self.ttft.observe(now - req.started)
        elif event == "finished":
            first = self._first.pop(id(req), None)
            self.e2e.observe(now - req.started)
            if first is not None and len(req.tokens) > 1:
                self.tpot.observe((now - first) / (len(req.tokens) - 1))
        elif event in ("failed", "cancelled"):
            self._first.pop(id(req), None)


class Metrics:
    """The router's metrics: a private registry holding the collector and the listener."""

    def __init__(self, router, links: dict, positions: int = 0, default_slots: int = 0):
        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = RouterCollector(router, links, positions, default_slots)
        self.registry.register(self.collector)
        self.timings = RequestTimings(self.registry)
        router.listeners.append(self.timings)

    async def render(self) -> bytes:
        await self.collector.refresh()
        return generate_latest(self.registry)

    async def handle(self, request: web.Request) -> web.Response:
        """aiohttp handler for GET /metrics."""
        return web.Response(body=await self.render(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_metrics_server(metrics: Metrics, host: str, port: int) -> tuple[web.AppRunner, int]:
    from router.ops import start_http

    app = web.Application()
    app.router.add_get("/metrics", metrics.handle)
    return await start_http(app, host, port)
