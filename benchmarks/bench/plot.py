"""The PNG of `spectandem bench`: tokens/s by batch size (one panel per section, one line per
method and mode) and, for the controlled workload, speedup over plain decoding by acceptance
rate (one line per batch size). Drawn from the JSON alone, so `--plot-from` can redraw a run
made elsewhere. matplotlib is optional (`pip install spectandem[bench]`)."""

from __future__ import annotations

import json
from pathlib import Path


def have_matplotlib() -> bool:
    import importlib.util

    return importlib.util.find_spec("matplotlib") is not None


def series_label(r: dict) -> str:
    """What tells one line of a panel (a section) from another."""
    parts = [r["method"], r["mode"]]
    if r.get("acceptance_rate") is not None:
        parts.append(f"a={r['acceptance_rate']}")
    if r.get("placement") not in (None, "one-device"):
        parts.append(r["placement"])
    return " ".join(parts)


def _sweeps(records: list[dict]) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """{panel title: {label: [(batch size, tokens/s)]}} for series measured at two or more batch sizes."""
    out: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for r in records:
        if r.get("temperature") is None:
            panel = f"{r['section']} ({r['workload']}): tokens/s"
            out.setdefault(panel, {}).setdefault(series_label(r), []).append((r["batch_size"], r["tokens_per_s"]))
    return {w: {k: sorted(v) for k, v in s.items() if len({b for b, _ in v}) > 1} for w, s in out.items()
            if any(len({b for b, _ in v}) > 1 for v in s.values())}


def _speedups(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("speedup") is not None and r.get("acceptance_rate") is not None]


def plottable(results: dict) -> bool:
    """Whether the results hold a series over batch sizes or controlled speedups."""
    return bool(_sweeps(results["records"]) or _speedups(results["records"]))


def draw(results: dict, path: str | Path) -> Path:
    """Writes the PNG for a results dict (the JSON `spectandem bench` writes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    if not plottable(results):
        raise ValueError("nothing to plot: no series over two or more batch sizes and no controlled speedups")
    records = results["records"]
    sweeps = _sweeps(records)
    speed = _speedups(records)
    panels = len(sweeps) + bool(speed)
    cols = min(panels, 2)
    rows = -(-panels // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(8 * cols, 5.5 * rows), squeeze=False)
    axes = list(axes.flat)
    for ax in axes[panels:]:
        ax.set_visible(False)
    styles = ["-", "--", ":", "-."]   # the colour cycle has 10 colours; panels may have more lines
    for ax, (title, series) in zip(axes, sweeps.items()):
        for i, (label, points) in enumerate(sorted(series.items())):
            ax.plot([b for b, _ in points], [t for _, t in points], marker="o", ls=styles[i // 10 % 4], label=label)
        ax.set(xscale="log", yscale="log", xlabel="batch size", ylabel="tokens/s", title=title)
        ax.set_xticks(sorted({b for points in series.values() for b, _ in points}))
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_formatter(ScalarFormatter())
            axis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.legend(fontsize=7)
        ax.grid(True, which="both", alpha=0.3)
    if speed:
        ax = axes[panels - 1]
        for b in sorted({r["batch_size"] for r in speed}):
            pts = sorted((r["acceptance_rate"], r["speedup"]) for r in speed if r["batch_size"] == b)
            ax.plot([a for a, _ in pts], [s for _, s in pts], marker="o", label=f"batch {b}")
        ideal = sorted((r["acceptance_rate"], r["ideal_tokens_per_s"] / r["tokens_per_s"] * r["speedup"])
                       for r in speed if r["batch_size"] == 1 and r.get("ideal_tokens_per_s"))
        if ideal:
            ax.plot([a for a, _ in ideal], [s for _, s in ideal], "k--", label="batch 1 ideal (verify forward only)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set(xlabel="acceptance rate", ylabel="speedup over plain decoding", title="controlled acceptance")
        ax.legend(fontsize=7)
        ax.grid(True, alpha=0.3)
    fig.suptitle(f"spectandem bench on {results.get('gpu', results.get('device', '?'))}")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_from(json_path: str | Path, png_path: str | Path | None) -> Path:
    """`spectandem bench --plot-from results.json [--plot out.png]`."""
    json_path = Path(json_path)
    return draw(json.loads(json_path.read_text()), png_path or json_path.with_suffix(".png"))
