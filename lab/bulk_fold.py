"""Bulk scoring with duplicates folded: `qtrel score` (model.bulk.score_file, each distinct pair of a chunk
forwarded once) against the same command forwarding every row (score_pairs as it was before issue 22),
on real files: a search log built from the Home Depot dev queries (cache_replay.py's skewed trace: Zipf
over the queries, each request a query with its judged titles, a share of requests with a title twice,
flattened to one row per pair in request order), and the Home Depot dev file itself (few repeats).

One loaded model (dtype auto: bfloat16 on AVX512-BF16 CPUs, as `qtrel score`), interleaved, order rotated
per repeat, median and best of the repeats. The machine is shared: read the ratios, not the pairs/s.

  python lab/bulk_fold.py                  # into docs/benchmarks.md and docs/bench/bulk_fold.json
  python lab/bulk_fold.py --quick          # small, scratch output
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from cache_replay import candidates, repeated_share, skewed
from results import DEV, command_line, machine, machine_lines, output_paths, update_section, write_json

import model.bulk.score as bulk
from model.builtin import resolve_model
from model.bulk.io import Scores
from model.bulk.score import ScoreOptions, score_file, score_names

OPTIONS = ScoreOptions(prefix="pred_", overwrite=True)


def every_row(model, pairs, max_batch_tokens, prefix=""):
    """score_pairs before folding: every row forwarded, duplicates too."""
    good = [i for i, p in enumerate(pairs) if p is not None]
    values = np.full((len(pairs), 1 + len(model.labels)), np.nan, dtype=np.float32)
    level: list[str | None] = [None] * len(pairs)
    enc = model.encode([p for p in pairs if p is not None])
    s = model.score(model.encoded_logits(enc, max_batch_tokens))
    values[good, 0] = s.expected.numpy()
    values[good, 1:] = s.probs.numpy()
    for i, lv in zip(good, s.level.tolist()):
        level[i] = model.labels[lv]
    return Scores(score_names(model.labels, prefix), level, values, len(good))


def write_log(path: Path, requests: int, seed: int) -> None:
    trace = skewed(candidates(), requests, 1.2, 0.1, seed)
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["query", "title"])
        for q, titles in trace:
            w.writerows([q, t] for t in titles)
    print(f"search log: {sum(len(t) for _, t in trace)} rows, {repeated_share(trace):.1%} repeated")


def read(path: Path) -> list[dict]:
    with path.open(encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="builtin:default")
    p.add_argument("--requests", type=int, default=1200, help="requests in the search log")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.requests, a.repeats = 120, 1
    torch.set_num_threads(a.threads)
    from model.relevance import RelevanceModel

    model = RelevanceModel.load(resolve_model(a.model), dtype="auto")
    model.warm_up()
    report: dict = {"machine": machine(), "command": command_line(), "threads": a.threads, "repeats": a.repeats,
                    "dtype": model.dtype if hasattr(model, "dtype") else "auto", "files": {}}  # fmt: skip
    rows_md = []
    with tempfile.TemporaryDirectory(prefix="qtrel-fold-") as tmp:
        log = Path(tmp) / "search-log.csv"
        write_log(log, a.requests, a.seed)
        dev = Path(tmp) / "dev.csv"
        dev.write_text(DEV.read_text(encoding="utf-8") if not a.quick else "".join(DEV.open().readlines()[:800]))
        for name, src in (("search log (Zipf over Home Depot dev queries)", log), ("Home Depot dev.csv", dev)):
            rows = read(src)
            n, distinct = len(rows), len({(r["query"], r["title"]) for r in rows})
            outs = {"folded": Path(tmp) / "folded.csv", "every row": Path(tmp) / "every.csv"}
            seconds: dict[str, list[float]] = {k: [] for k in outs}
            for r in range(a.repeats):
                for mode in list(outs)[r % 2 :] + list(outs)[: r % 2]:
                    bulk.score_pairs = every_row if mode == "every row" else ORIGINAL  # type: ignore[assignment]
                    t0 = time.perf_counter()
                    score_file(model, src, outs[mode], OPTIONS, progress=False)
                    seconds[mode].append(time.perf_counter() - t0)
                print(f"{name} repeat {r + 1}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in seconds.items()))
            bulk.score_pairs = ORIGINAL  # type: ignore[assignment]
            folded, every = read(outs["folded"]), read(outs["every row"])
            diff = max(abs(float(x["pred_score"]) - float(y["pred_score"])) for x, y in zip(folded, every))
            disagree = {}
            for label, out in (("folded", folded), ("every row", every)):
                seen: dict[tuple[str, str], set[str]] = {}
                for x in out:
                    seen.setdefault((x["query"], x["title"]), set()).add(x["pred_score"])
                disagree[label] = sum(len(v) > 1 for v in seen.values())
            pps = {k: n / statistics.median(v) for k, v in seconds.items()}
            best = {k: n / min(v) for k, v in seconds.items()}
            report["files"][name] = {"rows": n, "distinct": distinct, "seconds": seconds, "pairs_per_s": pps,
                                     "best_pairs_per_s": best, "max_abs_score_diff": diff,
                                     "pairs_whose_duplicates_differ": disagree}  # fmt: skip
            rows_md.append(
                f"| {name} | {n} | {distinct} ({1 - distinct / n:.1%} repeats) | {pps['every row']:.0f} | "
                f"{pps['folded']:.0f} | {pps['folded'] / pps['every row']:.2f}x | "
                f"{best['folded'] / best['every row']:.2f}x | {diff:.3f} | "
                f"{disagree['every row']} / {disagree['folded']} |"
            )
    text = "\n".join(
        [
            "## Bulk scoring with duplicates folded (`lab/bulk_fold.py`)",
            "",
            "`qtrel score` forwards each distinct (query, title) pair of a chunk once and copies its row to the "
            "duplicates, against the same command forwarding every row (before issue 22). One loaded model, "
            f"dtype auto ({report['dtype']}), {a.threads} torch threads, default --chunk-rows 20000, the two "
            f"interleaved (order rotated per repeat), median of {a.repeats} repeats (and the ratio of the best).",
            "",
            *machine_lines(report["machine"], report["command"]),
            "",
            "| file | rows | distinct pairs | every row, pairs/s | folded, pairs/s | speed-up (median) | (best) | "
            "largest score difference | pairs whose duplicates got different scores: every row / folded |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows_md,
            "",
            "The score difference between the two runs is bfloat16's batch rounding (the folded run forms other "
            "batches); forwarding every row, the copies of one pair are scored in different batches and can get "
            "different scores, folded they cannot.",
        ]
    )
    print("\n" + text)
    md, js = output_paths("bulk_fold", a.quick)
    write_json(js, report)
    update_section(md, "bulk_fold", text)
    print(f"\nwrote {js} and the bulk_fold section of {md}")
    return 0


ORIGINAL = bulk.score_pairs

if __name__ == "__main__":
    raise SystemExit(main())
