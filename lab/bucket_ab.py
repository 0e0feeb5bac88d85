"""A/B of the token-bucket ladder at its small end (issue 20): the packed forward's rows and the last layer's
[CLS] rows rounded up to steps of 16 (the ladder before 2026-12-06) against today's steps of 8 up to 64 tokens
and 1, 2, 4, 8 below. Small batches (a one-pair request at low load) are where the filler rows weigh; the
logits must not move (filler rows are never attended to or read).

  python lab/bucket_ab.py --model model/default [--threads 1] [--rounds 6]
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

import torch
from anchors import isa, isa_line, slug_of
from model_speed import consecutive_batches
from results import command_line, machine, publish

import model.engines.packed
import model.packing
from model.relevance import RelevanceModel

SIZES = (1, 2, 4, 8, 19)
TODAY = model.packing.token_bucket


def steps_of_16(n: int) -> int:
    """The ladder before: steps of 16 from the first bucket on."""
    granule = 16 if n <= 256 else 32 if n <= 1024 else 128 if n <= 4096 else 512
    return -(-n // granule) * granule


def use(ladder) -> None:
    model.packing.token_bucket = ladder
    model.engines.packed.token_bucket = ladder


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("model/default"))
    p.add_argument("--batches", type=int, default=24)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.batches, a.rounds = 2, 2
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model, dtype="auto")
    m.warm_up()
    data = consecutive_batches(m, SIZES, a.batches)
    ladders = {"steps of 16": steps_of_16, "today": TODAY}
    ms: dict[tuple[int, str], list[float]] = {(b, k): [] for b in SIZES for k in ladders}
    out: dict[tuple[int, str], torch.Tensor] = {}
    try:
        with torch.inference_mode():
            for f in ladders.values():  # build the kernels of either ladder's shapes first
                use(f)
                for b in SIZES:
                    for ids, seg in data[b]:
                        m.logits(ids, seg)
            for r in range(a.rounds):
                order = list(ladders.items()) if r % 2 == 0 else list(reversed(ladders.items()))
                for b in SIZES:
                    for k, f in order:
                        use(f)
                        t0 = time.perf_counter()
                        out[b, k] = torch.cat([m.logits(ids, seg) for ids, seg in data[b]])
                        ms[b, k].append(1e3 * (time.perf_counter() - t0) / len(data[b]))
    finally:
        use(TODAY)
    rows: dict[int, dict] = {}
    for b in SIZES:
        per = [o / n for o, n in zip(ms[b, "steps of 16"], ms[b, "today"])]
        rows[b] = {
            "before_ms": statistics.median(ms[b, "steps of 16"]),
            "today_ms": statistics.median(ms[b, "today"]),
            "speedup": statistics.median(per),
            "range": [min(per), max(per)],
            "max_abs_logit_diff": (out[b, "steps of 16"].float() - out[b, "today"].float()).abs().max().item(),
        }
    report: dict = {"isa_line": isa_line(isa()), "machine": machine(), "command": command_line(), "rows": rows}
    lines = [
        f"### Token buckets at the small end (`lab/bucket_ab.py`, {report['machine']['date']})",
        "",
        f"{m.dtype}, {a.threads} torch thread(s); {a.batches} batches of consecutive dev pairs per size, the two "
        f"ladders interleaved over {a.rounds} rounds (median ms per forward; speed-up = median of per-round ratios).",
        f"- ISA: {report['isa_line']}",
        f"- command: `{report['command']}`",
        "",
        "| batch | steps of 16, ms | today, ms | speed-up (range) | max abs logit diff |",
        "|---:|---:|---:|---:|---:|",
    ]
    for b, row in rows.items():
        lines.append(
            f"| {b} | {row['before_ms']:.2f} | {row['today_ms']:.2f} | {row['speedup']:.3f} "
            f"({row['range'][0]:.3f}–{row['range'][1]:.3f}) | {row['max_abs_logit_diff']:.1e} |"
        )
    text = "\n".join(lines)
    print(text)
    key = slug_of(isa()) + ("" if a.threads == 1 else f"-{a.threads}threads")
    publish("bucket_ab", key, report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
