"""The plot step: results.json in, one PNG per figure and summary.md out (no measuring here)."""

from __future__ import annotations

import json
import math
from pathlib import Path


def _draw(fig: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    f, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    names = list(fig["series"])
    if fig["kind"] == "bar":
        cats = sorted({x for s in fig["series"].values() for x in s["x"]}, key=str)
        width = 0.8 / max(1, len(names))
        for i, name in enumerate(names):
            s = fig["series"][name]
            pos = [cats.index(x) + i * width for x in s["x"]]
            low = [m - lo for m, lo in zip(s["median"], s["min"])]
            high = [hi - m for m, hi in zip(s["median"], s["max"])]
            ax.bar(pos, s["median"], width, yerr=[low, high], capsize=3, label=name)
        ax.set_xticks([c + width * (len(names) - 1) / 2 for c in range(len(cats))])
        ax.set_xticklabels(cats, rotation=15, ha="right", fontsize=8)
    else:
        for name in names:
            s = fig["series"][name]
            ax.plot(s["x"], s["median"], marker="o", label=name)
            ax.fill_between(s["x"], s["min"], s["max"], alpha=0.2)
        ax.set_xscale("log" if fig["logx"] else "linear")
        ax.set_yscale("log" if fig["logy"] else "linear")
    ax.set_title(fig["title"], fontsize=10)
    ax.set_xlabel(fig["xlabel"])
    ax.set_ylabel(fig["ylabel"])
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if fig.get("note"):
        f.text(0.01, 0.01, fig["note"], fontsize=7, color="gray")
    f.tight_layout()
    f.savefig(path)
    plt.close(f)


def _fmt(v: float) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "–"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}"


def _table(fig: dict) -> list[str]:
    names = list(fig["series"])
    xs = []
    for s in fig["series"].values():
        xs += [x for x in s["x"] if x not in xs]
    rows = [f"| {fig['xlabel']} | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for x in xs:
        cells = []
        for name in names:
            s = fig["series"][name]
            if x in s["x"]:
                k = s["x"].index(x)
                cells.append(f"{_fmt(s['median'][k])} ({_fmt(s['min'][k])}–{_fmt(s['max'][k])})")
            else:
                cells.append("–")
        rows.append(f"| {x if isinstance(x, str) else _fmt(x)} | " + " | ".join(cells) + " |")
    return rows


def plot(out: str | Path) -> list[Path]:
    """Draw every figure of out/results.json and write out/summary.md; returns the PNGs."""
    out = Path(out)
    results = json.loads((out / "results.json").read_text())
    lines = [
        f"# gpufeed bench — {results['machine']['summary']}",
        "",
        f"Command: `{results['command']}`. Cells: median (min–max) over repeats.",
        "",
    ]
    pngs = []
    for exp, entry in results["experiments"].items():
        lines += [f"## {exp}", ""]
        if entry.get("skipped") or entry.get("failed"):
            lines += [f"Skipped: {entry['skipped']}" if entry.get("skipped") else f"FAILED: {entry['failed']}", ""]
            continue
        for fig in entry["figures"]:
            path = out / f"{fig['name']}.png"
            _draw(fig, path)
            pngs.append(path)
            lines += [f"### {fig['title']} ({fig['ylabel']})", "", f"![{fig['name']}]({path.name})", ""]
            lines += _table(fig) + (["", fig["note"]] if fig.get("note") else []) + [""]
    (out / "summary.md").write_text("\n".join(lines))
    return pngs
