"""`qtrel heads`: run the head-mask experiments on a checkpoint and a labelled file; JSON + PNG each."""

from __future__ import annotations

import json
import random
from pathlib import Path

from model.data import Dataset, read_labelled
from model.relevance import RelevanceModel
from model.train import heads as H

EXPERIMENTS = ("random", "lower_vs_upper", "whole_layers", "single_heads", "term_matching")


def subset_by_query(ds: Dataset, limit: int, seed: int = 0) -> Dataset:
    """Whole queries, drawn at random, until `limit` pairs: NDCG stays meaningful on the subset."""
    if len(ds) <= limit:
        return ds
    by_q: dict[str, list] = {}
    for e in ds.examples:
        by_q.setdefault(e.query, []).append(e)
    queries = sorted(by_q)
    random.Random(seed).shuffle(queries)
    out: list = []
    for q in queries:
        if len(out) >= limit:
            break
        out += by_q[q]
    return Dataset(out, ds.path)


def run(
    model_dir: str,
    data: str,
    out_dir: str,
    limit: int = 1500,
    seeds: int = 3,
    experiments=EXPERIMENTS,
    progress: bool = True,
    threads: int = 0,
) -> dict:
    import torch

    if threads:
        torch.set_num_threads(threads)
    model = RelevanceModel.load(model_dir)
    ds = subset_by_query(read_labelled(data, model.labels), limit)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ev = H.HeadEvaluator(model, ds)
    L, NH = ev.layers, ev.heads
    s = tuple(range(seeds))
    sizes = {
        "random": 6 * seeds,
        "lower_vs_upper": 2 * (4 * seeds + 1),
        "whole_layers": L,
        "single_heads": L * NH,
        "term_matching": 5,
    }
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=sum(sizes[e] for e in experiments), unit="eval", dynamic_ncols=True)
    tick = bar.update if bar else None
    results = {"model": model_dir, "data": data, "pairs": len(ds), "layers": L, "heads": NH, "base": ev.base}
    for name in experiments:
        if name == "random":
            r = H.random_masking(ev, seeds=s, tick=tick)
        elif name == "lower_vs_upper":
            r = H.lower_vs_upper(ev, seeds=s, tick=tick)
        elif name == "whole_layers":
            r = H.whole_layers(ev, tick=tick)
        elif name == "single_heads":
            r = H.single_heads(ev, tick=tick)
        elif name == "term_matching":
            r = H.term_matching(ev, seeds=s, tick=tick)
        else:
            raise ValueError(f"unknown experiment {name!r} (choose from {EXPERIMENTS})")
        (out / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")
        plot(r, out / f"{name}.png")
        results[name] = r
    if bar:
        bar.close()
    (out / "summary.json").write_text(json.dumps(summary(results), indent=2) + "\n")
    return results


def summary(results: dict) -> dict:
    """The headline numbers of each experiment (relative change of accuracy and QWK)."""
    s: dict = {"pairs": results["pairs"], "base": results["base"]}
    key = ("accuracy", "qwk", "ndcg@10")
    if "random" in results:
        s["random"] = {
            p["fraction"]: {k: round(p["mean_relative_change"][k], 4) for k in key} for p in results["random"]["points"]
        }
    if "lower_vs_upper" in results:
        s["lower_vs_upper"] = {
            g: {p["fraction"]: {k: round(p["mean_relative_change"][k], 4) for k in key} for p in pts}
            for g, pts in results["lower_vs_upper"]["points"].items()
        }
    if "whole_layers" in results:
        s["whole_layers"] = {
            p["layer"]: {k: round(p["relative_change"][k], 4) for k in key} for p in results["whole_layers"]["points"]
        }
    if "single_heads" in results:
        grid = results["single_heads"]["relative_change"]["accuracy"]
        flat = sorted(((v, la, h) for la, row in enumerate(grid) for h, v in enumerate(row)))
        s["single_heads"] = {
            "worst": [(la, h, round(v, 4)) for v, la, h in flat[:5]],
            "best": [(la, h, round(v, 4)) for v, la, h in flat[-5:]],
        }
    if "term_matching" in results:
        s["term_matching"] = [
            {
                "k": p["k"],
                "top": {k: round(p["top"]["relative_change"][k], 4) for k in key},
                "random": {k: round(p["random"]["mean_relative_change"][k], 4) for k in key},
            }
            for p in results["term_matching"]["points"]
        ]
    return s


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    name = r["experiment"]
    metrics = ("accuracy", "qwk", "ndcg@10")
    if name == "random":
        xs = [p["fraction"] for p in r["points"]]
        for k in metrics:
            ax.errorbar(
                xs,
                [p["mean_relative_change"][k] * 100 for p in r["points"]],
                yerr=[p["std_relative_change"][k] * 100 for p in r["points"]],
                label=k,
                capsize=3,
                marker="o",
            )
        ax.set_xlabel("fraction of all heads masked at random")
    elif name == "lower_vs_upper":
        for g, style in (("lower", "-"), ("upper", "--")):
            pts = r["points"][g]
            for k in ("accuracy", "qwk"):
                ax.plot(
                    [p["fraction"] for p in pts],
                    [p["mean_relative_change"][k] * 100 for p in pts],
                    style,
                    marker="o",
                    label=f"{g} layers {r[g + '_layers']}: {k}",
                )
        ax.set_xlabel("fraction of the group's heads masked")
    elif name == "whole_layers":
        xs = [p["layer"] for p in r["points"]]
        w = 0.27
        for i, k in enumerate(metrics):
            ax.bar([x + (i - 1) * w for x in xs], [p["relative_change"][k] * 100 for p in r["points"]], w, label=k)
        ax.set_xlabel("layer whose heads are all masked")
        ax.set_xticks(xs)
    elif name == "single_heads":
        grid = r["relative_change"]["accuracy"]
        lim = max(1e-9, max(abs(v) for row in grid for v in row)) * 100
        im = ax.imshow([[v * 100 for v in row] for row in grid], cmap="RdBu", vmin=-lim, vmax=lim, aspect="auto")
        fig.colorbar(im, ax=ax, label="accuracy change (%)")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    elif name == "term_matching":
        ks = [p["k"] for p in r["points"]]
        for k in ("accuracy", "qwk"):
            ax.plot(
                ks,
                [p["top"]["relative_change"][k] * 100 for p in r["points"]],
                marker="o",
                label=f"top-k term-matching heads: {k}",
            )
            ax.plot(
                ks,
                [p["random"]["mean_relative_change"][k] * 100 for p in r["points"]],
                "--",
                marker="x",
                label=f"k random heads: {k}",
            )
        ax.set_xlabel("heads masked (k)")
    if name != "single_heads":
        ax.set_ylabel("change vs unmasked (%)")
        ax.axhline(0, color="grey", lw=0.8)
        ax.legend(fontsize=8)
    ax.set_title(f"head masking: {name.replace('_', ' ')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
