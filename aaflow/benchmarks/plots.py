"""One plotting helper for every benchmark: a PNG next to the benchmark's JSON (matplotlib, Agg).

    write_plot("results/scaling.json", [
        {"title": "prefill tokens", "xlabel": "agents", "ylabel": "tokens",
         "series": {"text": {1: 4100, 4: 16400}, "auto": {1: 4100, 4: 4400}}, "logy": True},
        {"title": "latency", "kind": "bar", "series": {"text": {"chain": 9.1}, "auto": {"chain": 5.2}}},
    ])  # -> results/scaling.png

A panel's `series` maps a label to {x: y}. Numeric x gives lines with markers ("kind": "line",
the default); anything else, or "kind": "bar", gives grouped bars over the union of the x keys in
first-seen order. Missing or None values are skipped. Optional per panel: xlabel, ylabel, logx,
logy, and `hlines` ({label: y}) for reference values such as a paper's figure.
"""

from __future__ import annotations

from pathlib import Path


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _line(ax, series: dict) -> None:
    for label, points in series.items():
        xy = sorted((float(x), y) for x, y in points.items() if y is not None)
        if xy:
            ax.plot([p[0] for p in xy], [p[1] for p in xy], marker="o", label=str(label))


def _bars(ax, series: dict) -> None:
    cats: list = []
    for points in series.values():
        cats += [x for x in points if x not in cats]
    width = 0.8 / max(1, len(series))
    for i, (label, points) in enumerate(series.items()):
        xs = [j + i * width for j, c in enumerate(cats) if points.get(c) is not None]
        ys = [points[c] for c in cats if points.get(c) is not None]
        ax.bar(xs, ys, width=width, label=str(label))
    ax.set_xticks([j + width * (len(series) - 1) / 2 for j in range(len(cats))])
    ax.set_xticklabels([str(c) for c in cats], rotation=30 if len(cats) > 4 else 0, ha="right" if len(cats) > 4 else "center")


def write_plot(json_path: str | Path, panels: list[dict], suptitle: str | None = None) -> Path:
    """Draw `panels` side by side and save them as the PNG next to `json_path`; returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(json_path).with_suffix(".png")
    out.parent.mkdir(parents=True, exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels):
        series = panel.get("series", {})
        xs = [x for points in series.values() for x in points]
        if panel.get("kind", "line") == "bar" or not all(_is_number(x) for x in xs):
            _bars(ax, series)
        else:
            _line(ax, series)
            if panel.get("logx"):
                ax.set_xscale("log", base=2)
                ticks = sorted({float(x) for x in xs})
                ax.set_xticks(ticks)
                ax.set_xticklabels([f"{t:g}" for t in ticks])
        if panel.get("logy"):
            ax.set_yscale("log")
        for label, y in (panel.get("hlines") or {}).items():
            ax.axhline(y, linestyle="--", color="gray", linewidth=1)
            ax.annotate(str(label), (0.01, y), xycoords=("axes fraction", "data"), fontsize=8, color="gray",
                        va="bottom")
        ax.set_title(panel.get("title", ""))
        ax.set_xlabel(panel.get("xlabel", ""))
        ax.set_ylabel(panel.get("ylabel", ""))
        ax.grid(True, alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    if suptitle:
        fig.suptitle(suptitle)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    try:
        from aaflow.benchmarks.common import log

        log(f"wrote {out}")
    except ImportError:  # pragma: no cover - common needs torch; plotting does not
        pass
    return out
