"""Human-readable evaluation reports: a plain-text report and a confusion-matrix PNG.

Both take `results`, an ordered mapping from a system's name ("model", "baseline") to the dict of
`model.train.metrics.all_metrics`, so that several systems evaluated on the same file appear side by side.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

# Headline metrics in report order, and whether higher is better.
HEADLINE = {
    "accuracy": True,
    "macro_f1": True,
    "qwk": True,
    "ndcg@10": True,
    "rmse_level": False,
    "rmse_relevance": False,
}


def _table(header: Sequence[str], rows: Sequence[Sequence[str]], indent: str = "  ") -> list[str]:
    """Left-aligned first column, right-aligned others."""
    cols = list(zip(header, *rows))
    widths = [max(len(c) for c in col) for col in cols]
    lines = []
    for row in (header, *rows):
        cells = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def headline_lines(results: Mapping[str, dict]) -> list[str]:
    names = list(results)
    rows = []
    for key, higher in HEADLINE.items():
        if not all(key in m for m in results.values()):
            continue
        arrow = "higher is better" if higher else "lower is better"
        rows.append([key, *(f"{results[n][key]:.4f}" for n in names), arrow])
    return _table(["metric", *names, ""], rows)


def per_level_lines(metrics: dict, labels: Sequence[str]) -> list[str]:
    n = max(1, sum(r["support"] for r in metrics["per_level"]))
    rows = [
        [
            f"level {lab}",
            f"{r['precision']:.3f}",
            f"{r['recall']:.3f}",
            f"{r['f1']:.3f}",
            str(r["support"]),
            f"{r.get('predicted', 0) / n:.1%}",
        ]
        for lab, r in zip(labels, metrics["per_level"])
    ]
    return _table(["", "precision", "recall", "f1", "support", "predicted"], rows)


def negatives_lines(name: str, neg: dict) -> list[str]:
    return [
        f"{name}: {neg['n']} sampled negatives (titles judged only for other queries of the file): "
        f"graded level 1 {neg['level1_share']:.1%}, level 1-2 {neg['level12_share']:.1%}, "
        f"mean score {neg['mean_score']:.3f}, AUC judged vs negative {neg['auc']:.4f}"
    ]


def confusion_lines(metrics: dict, labels: Sequence[str]) -> list[str]:
    rows = [[f"true {lab}", *map(str, row)] for lab, row in zip(labels, metrics["confusion"])]
    return _table(["", *(f"pred {lab}" for lab in labels)], rows)


def text_report(
    results: Mapping[str, dict], labels: Sequence[str], data: str = "", negatives: Mapping[str, dict] | None = None
) -> str:
    """Headline metrics side by side, then per-level precision/recall/F1 and the confusion matrix of each,
    and how each system grades sampled negatives."""
    n = next(iter(results.values()))["n"]
    out = [f"Evaluation on {data} ({n} pairs)" if data else f"Evaluation on {n} pairs", ""]
    out += headline_lines(results)
    for name, m in results.items():
        out += ["", f"{name}: per level", *per_level_lines(m, labels)]
        out += ["", f"{name}: confusion (rows: true level, columns: predicted level)", *confusion_lines(m, labels)]
    for name, neg in (negatives or {}).items():
        out += ["", *negatives_lines(name, neg)]
    return "\n".join(out) + "\n"


def confusion_png(results: Mapping[str, dict], labels: Sequence[str], path: str | Path, title: str = "") -> Path:
    """One panel per system: counts written in each cell, shading = the row's fraction (recall per level)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    k = len(labels)
    names = list(results)
    side = 1.0 + 0.75 * k
    fig = Figure(figsize=(side * len(names) + 1.2, side + 0.6), layout="constrained")
    FigureCanvasAgg(fig)  # Agg, set on this figure only: no pyplot, no global backend state
    axes = fig.subplots(1, len(names), squeeze=False)[0]
    image = None
    for ax, name in zip(axes, names):
        m = results[name]
        counts = m["confusion"]
        shade = [[c / sum(row) if sum(row) else 0.0 for c in row] for row in counts]
        image = ax.imshow(shade, cmap="Blues", vmin=0.0, vmax=1.0)
        for i in range(k):
            for j in range(k):
                colour = "white" if shade[i][j] > 0.55 else "black"
                ax.text(j, i, str(counts[i][j]), ha="center", va="center", color=colour, fontsize=9)
        ax.set_xticks(range(k), labels)
        ax.set_yticks(range(k), labels)
        ax.set_xlabel("predicted level")
        ax.set_ylabel("true level")
        ax.set_title(f"{name}\nacc {m['accuracy']:.3f}  qwk {m['qwk']:.3f}  macro-F1 {m['macro_f1']:.3f}", fontsize=9)
    assert image is not None  # at least one panel: fig.subplots refuses zero columns
    fig.colorbar(image, ax=list(axes), shrink=0.8, label="fraction of the true level's row")
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def reliability_png(per_level: Sequence[dict], labels: Sequence[str], path: str | Path, title: str = "") -> Path:
    """The reliability diagram of `model.train.metrics.reliability`: one panel per level, predicted
    probability against observed frequency, each bin a dot sized by its pairs; the diagonal is calibration."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(2.6 * len(labels) + 0.6, 3.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(labels), squeeze=False)[0]
    for ax, label, lv in zip(axes, labels, per_level):
        xs = [b["predicted"] for b in lv["bins"]]
        ys = [b["observed"] for b in lv["bins"]]
        total = sum(b["n"] for b in lv["bins"]) or 1
        ax.plot([0, 1], [0, 1], color="0.7", linewidth=1)
        ax.plot(xs, ys, color="tab:blue", linewidth=1)
        ax.scatter(xs, ys, s=[8 + 400 * b["n"] / total for b in lv["bins"]], color="tab:blue", zorder=3)
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.set_xlabel(f"predicted p(level {label})")
        ax.set_title(f"level {label}: ECE {lv['ece']:.3f}", fontsize=9)
    axes[0].set_ylabel("observed frequency")
    if title:
        fig.suptitle(title, fontsize=10)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path
