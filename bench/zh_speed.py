"""builtin:zh beside the English default on the fast path: seconds a pair and multiply-adds a second.

builtin:zh is a 12-layer, 384-wide BERT (multilingual-e5-small); the default a 6-layer one of the same width.
Each scores its own language's pairs (QBQTC held-out pairs for zh, Home Depot dev pairs for the default), so
the pairs differ in length: the fair figure is the rate per FLOP, from each forward's shapes and the real
token counts of its packed pairs. The two alternate round by round (the host is shared: machine noise falls
on both alike); each figure is the median of the rounds. Tokenisation is not timed.

  python bench/zh_speed.py                # 200 pairs each, 7 rounds
  python bench/zh_speed.py --quick        # 32 pairs, 2 rounds
  python bench/zh_speed.py --en-model DIR # also DIR (e.g. e5-small fine-tuned on Home Depot) on the default's pairs
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from harness.publish import DATA, DEV

from model.builtin import builtin_dir
from model.relevance import RelevanceModel

ROOT = Path(__file__).resolve().parent.parent
QBQTC = DATA / "qbqtc" / "dev.json"
HOMEDEPOT = DEV


def flops(m: RelevanceModel, lengths: list[int]) -> float:
    """Multiply-adds x 2 of the encoder on packed pairs of these lengths (linears and attention)."""
    cfg = m.module.cfg
    h, f, layers = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    tokens = sum(lengths)
    linear = 2 * tokens * (4 * h * h + 2 * h * f)
    attention = sum(4 * t * t * h for t in lengths)
    return layers * (linear + attention)


def pairs_of(n: int) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    with open(QBQTC, encoding="utf-8") as fz:
        zh = [(r["query"], r["title"]) for r in (json.loads(x) for _, x in zip(range(n), fz))]
    with open(HOMEDEPOT, encoding="utf-8") as fe:
        en = [(r["query"], r["title"]) for _, r in zip(range(n), csv.DictReader(fe))]
    return zh, en


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--pairs", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--en-model", type=Path, help="another English checkpoint, timed on the default's pairs")
    a = ap.parse_args(argv)
    n, rounds = (32, 2) if a.quick else (a.pairs, a.rounds)
    torch.set_num_threads(a.threads)
    zh_pairs, en_pairs = pairs_of(n)
    models = {
        "zh": (RelevanceModel.load(builtin_dir("zh"), dtype=a.dtype), zh_pairs),
        "default": (RelevanceModel.load(builtin_dir("default"), dtype=a.dtype), en_pairs),
    }
    if a.en_model:
        models["en_model"] = (RelevanceModel.load(a.en_model, dtype=a.dtype), en_pairs)
    enc = {k: m.encode(p) for k, (m, p) in models.items()}
    for k, (m, _) in models.items():
        m.warm_up()
        m.encoded_logits(enc[k])
    times: dict[str, list[float]] = {k: [] for k in models}
    for r in range(rounds):
        for k in list(models)[:: 1 if r % 2 == 0 else -1]:
            t0 = time.perf_counter()
            models[k][0].encoded_logits(enc[k])
            times[k].append(time.perf_counter() - t0)
    out: dict[str, Any] = {}
    for k, (m, _) in models.items():
        s = statistics.median(times[k])
        out[k] = {
            "path": {k_: m.describe()[k_] for k_ in ("inference", "cpu_kernels", "attention_path", "dtype")},
            "pairs": n,
            "mean_tokens": round(sum(enc[k].lengths) / n, 1),
            "ms_per_pair": round(1000 * s / n, 3),
            "gflops_per_s": round(flops(m, enc[k].lengths) / s / 1e9, 2),
        }
    out["zh_per_flop_rate_vs_default"] = round(out["zh"]["gflops_per_s"] / out["default"]["gflops_per_s"], 3)
    out["zh_cost_per_pair_vs_default"] = round(out["zh"]["ms_per_pair"] / out["default"]["ms_per_pair"], 3)
    if a.en_model:
        out["en_model"]["dir"] = str(a.en_model)
        out["en_model_per_flop_rate_vs_default"] = round(
            out["en_model"]["gflops_per_s"] / out["default"]["gflops_per_s"], 3
        )
        out["en_model_cost_per_pair_vs_default"] = round(
            out["en_model"]["ms_per_pair"] / out["default"]["ms_per_pair"], 3
        )
    out["settings"] = {"threads": a.threads, "dtype": a.dtype, "rounds": rounds}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
