"""Bulk scoring speed: `qtrel score` (model.bulk.score.score_file) against RelevanceModel.predict on the same pairs.

Both run on one loaded model (the fast path of bench/model_speed.py: oneDNN-packed linears, no padding),
in the same process, interleaved (the order rotates per repeat), median of the repeats. predict is given
the pairs already in memory; score_file also reads the CSV, tokenises per chunk and writes the output,
so the ratio is what the file handling costs. The machine is shared, so the ratios mean more than the
pairs/s.

  python bench/bulk_speed.py                          # Home Depot dev, built-in default model, into docs/benchmarks.md
  python bench/bulk_speed.py --quick         # smoke run: a tiny checkpoint, into a scratch folder
"""

from __future__ import annotations

import argparse
import csv
import statistics
import tempfile
import time
from pathlib import Path

import torch
from harness.data import DEFAULT_MODEL, tiny_checkpoint
from harness.machine import default_title, isa
from harness.publish import DEV, command_line, machine, machine_lines, publish

from model.bulk.io import CsvSink, CsvSource, score_columns
from model.bulk.score import ScoreOptions, score_file, score_names, score_pairs
from model.relevance import RelevanceModel

OPTIONS = ScoreOptions(prefix="pred_", overwrite=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=DEFAULT_MODEL, help="checkpoint (default: built-in)")
    p.add_argument("--data", type=Path, default=DEV)
    p.add_argument("--pairs", type=int, default=0, help="first N pairs of the file (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 200 pairs, 1 repeat, scratch")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory(prefix="qtrel-bulk-") as tmp:
        if a.quick:
            a.model, a.pairs, a.repeats = tiny_checkpoint(Path(tmp) / "tiny"), 200, 1
        model = RelevanceModel.load(a.model)  # fast=True
        model.warm_up()
        src = Path(tmp) / "in.csv"
        with a.data.open(encoding="utf-8") as f:
            lines = f.readlines()
        src.write_text("".join(lines[: a.pairs + 1] if a.pairs else lines), encoding="utf-8")
        with src.open(encoding="utf-8", newline="") as f:
            pairs = [(r["query"], r["title"]) for r in csv.DictReader(f)]
        n = len(pairs)
        out = Path(tmp) / "out.csv"

        def bulk(chunk: int):
            return lambda: score_file(model, src, out, OPTIONS, chunk_rows=chunk, progress=False)

        def file_handling() -> None:  # read, check and write the rows with fixed scores: no tokeniser, no model
            source = CsvSource(src, "query", "title")
            sink = CsvSink(out, source, score_names(model.labels, "pred_"), False, 20000)
            for chunk in source.chunks(20000):
                sink.write(chunk, level[: len(chunk)], values[: len(chunk)])
            sink.close()

        level, values = score_columns(score_pairs(model, pairs), model.labels)
        out.unlink(missing_ok=True)
        systems = {"RelevanceModel.predict": lambda: model.predict(pairs), "qtrel score": bulk(20000),
                   "qtrel score --chunk-rows 1000": bulk(1000)}  # fmt: skip
        seconds: dict[str, list[float]] = {k: [] for k in systems}
        names = list(systems)
        for r in range(a.repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                t0 = time.perf_counter()
                systems[name]()
                seconds[name].append(time.perf_counter() - t0)
            print(f"repeat {r + 1}/{a.repeats}: " + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in seconds.items()))
        io = []
        for _ in range(3):
            out.unlink(missing_ok=True)
            t0 = time.perf_counter()
            file_handling()
            io.append(time.perf_counter() - t0)
        ref = model.predict(pairs)
        score_file(model, src, out, OPTIONS, progress=False)
        with out.open(encoding="utf-8", newline="") as f:
            diff = max(abs(float(row["pred_score"]) - e.expected) for row, e in zip(csv.DictReader(f), ref))
    pps = {k: n / statistics.median(v) for k, v in seconds.items()}
    best = {k: n / min(v) for k, v in seconds.items()}
    base, best_base = pps["RelevanceModel.predict"], best["RelevanceModel.predict"]
    io_pps = n / min(io)
    report = {"machine": machine(), "command": command_line(), "pairs": n, "threads": a.threads,
              "repeats": a.repeats, "model": str(a.model), "seconds": seconds, "pairs_per_s": pps,
              "ratio_vs_predict": {k: v / base for k, v in pps.items()}, "best_pairs_per_s": best,
              "best_ratio_vs_predict": {k: v / best_base for k, v in best.items()}, "file_handling_seconds": io,
              "file_handling_pairs_per_s": io_pps, "max_abs_score_diff": diff}  # fmt: skip
    report["title"] = default_title(isa())
    text = render(report)
    print("\n" + text)
    publish("bulk_speed", report, text, a.quick)
    return 0


def render(r: dict) -> str:
    pps, best = r["pairs_per_s"], r["best_pairs_per_s"]
    base, best_base = pps["RelevanceModel.predict"], best["RelevanceModel.predict"]
    io_pps, n = r["file_handling_pairs_per_s"], r["pairs"]
    lines_md = [
        f"### Bulk scoring: {r.get('title') or r['machine']['cpu']} (`bench/bulk_speed.py`)",
        "",
        f"`qtrel score` (model.bulk.score_file: read the CSV, tokenise per chunk, length-sorted batches of at most "
        f"8192 padded tokens, write the output) against `RelevanceModel.predict` on the same {n} pairs in memory, "
        f"one loaded model (fast path), {r['threads']} torch threads, interleaved (order rotated per repeat), median "
        f"and best of {r['repeats']} repeats. The machine is shared with other work: read the ratios, not the pairs/s.",
        "",
        *machine_lines(r["machine"], r["command"]),
        "",
        "| system | pairs/s (median) | x predict | pairs/s (best) | x predict |",
        "|---|---:|---:|---:|---:|",
        *(f"| {k} | {v:.0f} | {v / base:.2f} | {best[k]:.0f} | {best[k] / best_base:.2f} |" for k, v in pps.items()),
        "",
        f"File handling alone (read and check the CSV, write the rows with their scores; no tokeniser, no model): "
        f"{io_pps:.0f} pairs/s, i.e. {100 * best_base / io_pps:.1f}% of the time predict takes for the same pairs.",
        f"Largest difference of the expected level between the two: {r['max_abs_score_diff']:.1e} (chunks form "
        "other batches).",
        "",
        "On a busy machine the medians swing between repeats; the best-of columns and the file-handling line "
        "are the steadier reading.",
    ]
    return "\n".join(lines_md)


if __name__ == "__main__":
    raise SystemExit(main())
