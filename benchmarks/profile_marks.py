"""`benchmarks/profile_router.py --marks`: the few calls it times and how it reads their trace
(offsets from each verify launch, and the slowest intervals call by call)."""

from __future__ import annotations

from collections import defaultdict

# The few calls `--marks` times: light enough that a round keeps its shape.
MARKS = ("verifier.graphs:VerifyGraphs.run", "verifier.engine:VerifierEngine._accept",
         "verifier.engine:VerifierEngine.verify",
         "drafter.ahead_chains:ahead_inputs",
         "drafter.ahead_chains:AheadChainGraphs._run", "drafter.engine:DrafterEngine.draft", "drafter.engine:DrafterEngine.extend",
         "router.loop:Router._apply", "router.loop:Router._draft_ahead",
         "verifier.engine:VerifierEngine.commit", "verifier.runner:NativeRunner.verify", "drafter.proposers:EagleProposer.catch_up_propose",
         "drafter.graphs:chain_inputs", "drafter.graphs:ChainGraphs._run", "router.loop:Router._draft",
         "router.loop:Router._round",
         # a request's start and end (`edges`), and the verdict-to-launch host work
         "router.loop:Router._admit", "router.loop:Router._drafter_prefill",
         "verifier.engine:VerifierEngine.prefill", "drafter.engine:DrafterEngine.add_many",
         "verifier.graphs:host_tree_inputs",
         "spectandem.kv_cache:PagedKVCache.reserve", "router.loop:Router._release",
         "drafter.proposers:EagleProposer.catch_up", "drafter.proposers:catch_up_inputs",
         "drafter.proposers:catch_up_forward", "drafter.proposers:to_device_all",
         "verifier.engine:VerifierEngine._launch",
         # a draft ahead's results
         "drafter.proposers:outcome_trees", "drafter.controlled:ControlledProposer._planned_outcomes")


def round_marks(trace: list, anchor: str = "VerifyGraphs.run", slowest: int = 0) -> str:
    """Per verify launch (the end of `anchor`: the forward is queued) until the next one: the
    offset of the first start and the first end of every other timed call in that interval, as
    the median (p25-p75) over the intervals, in ms; the interval's own length last. Then the
    `slowest` longest intervals call by call (`_slowest`)."""
    launches = sorted(t1 for label, _, t1, _ in trace if label == anchor)
    offsets: dict[str, list] = defaultdict(list)
    for a, b in zip(launches, launches[1:]):
        seen = set()
        for label, t0, t1, _ in sorted(trace, key=lambda e: e[1]):
            for what, t in (("start", t0), ("end", t1)):
                key = f"{label} {what}"
                if a <= t < b and key not in seen and label != anchor:
                    seen.add(key)
                    offsets[key].append(1000 * (t - a))
        offsets["next launch"].append(1000 * (b - a))
    q = lambda xs, f: sorted(xs)[int(f * (len(xs) - 1))]
    rows = [f"   {'call':52s} {'rounds':>6s} {'median':>7s} {'p25':>7s} {'p75':>7s}"]
    for key, xs in sorted(offsets.items(), key=lambda kv: q(kv[1], 0.5)):
        rows.append(f"   {key:52s} {len(xs):6d} {q(xs, 0.5):7.3f} {q(xs, 0.25):7.3f} {q(xs, 0.75):7.3f}")
    return "\n".join(rows) + _slowest(trace, launches, anchor, slowest)


def edges(trace: list, anchor: str = "VerifyGraphs.run") -> str:
    """A batch's start and end call by call: every timed call that starts before the second
    verify launch, then every one that ends after the last launch, in ms from the batch's first
    timed call (thread's initial): the time before the rounds chain, and after."""
    if not trace:
        return "   (nothing timed)"
    launches = sorted(t1 for label, _, t1, _ in trace if label == anchor)
    t0 = min(e[1] for e in trace)
    head = launches[1] if len(launches) > 1 else float("inf")
    tail = launches[-1] if launches else float("-inf")
    out = [f"   launches at (ms): {', '.join(f'{1000 * (t - t0):.2f}' for t in launches[:3])} ... "
           f"{', '.join(f'{1000 * (t - t0):.2f}' for t in launches[-2:])}; the batch's last call ends at "
           f"{1000 * (max(e[2] for e in trace) - t0):.2f}"]
    for title, keep in (("start", lambda e: e[1] <= head), ("end", lambda e: e[2] >= tail)):
        out.append(f"   -- {title}")
        for label, a, b, thread in sorted(trace, key=lambda e: e[1]):
            if keep((label, a, b, thread)):
                out.append(f"      {1000 * (a - t0):8.3f} {1000 * (b - t0):8.3f}  {thread[:14]:14s} {label}")
    return "\n".join(out)


def _slowest(trace: list, launches: list, anchor: str, count: int) -> str:
    """The `count` longest intervals between verify launches, then the two nearest the median,
    each call's start and end in ms from the interval's launch, by start (thread's initial):
    where a slow round's time goes, and a typical one's."""
    ranked = sorted(zip(launches, launches[1:]), key=lambda ab: ab[0] - ab[1])
    mid = len(ranked) // 2
    spans = ranked[:count] + [s for s in ranked[max(count, mid - 1): mid + 1]]
    out = []
    for a, b in sorted(spans):
        out.append(f"\n   -- interval of {1000 * (b - a):.3f} ms")
        for label, t0, t1, thread in sorted(trace, key=lambda e: e[1]):
            if a <= t0 < b and label != anchor:
                out.append(f"      {1000 * (t0 - a):8.3f} {1000 * (t1 - a):8.3f}  {thread[:14]:14s} {label}")
    return "\n".join(out)
