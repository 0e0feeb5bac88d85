"""Many batches on several cores, A/B in one run (issue 20): `encoded_logits` on forward workers of one
thread each (model.parallel, the default with several torch threads) against each batch split over every
thread (`workers = 1`, the layout before).

The same dev pairs, the same batches (the budget depends on the pairs only), float32 or the machine's
native precision, THREADS torch threads; the two layouts alternate within each round, the order flipped
per round, and the ratio is taken per round (this shared machine's speed swings by a third from one minute
to the next, the ratio within a round far less); median and range. Checks that both give the same logits.

    python lab/workers_ab.py [--pairs 3000] [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from load import read_dev
from results import DEV

from model.builtin import builtin_dir
from model.relevance import RelevanceModel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(builtin_dir("default")))
    p.add_argument("--pairs", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--dtype", default="auto")
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    pairs = [(r["query"], r["title"]) for r in read_dev()[: a.pairs]]
    m = RelevanceModel.load(a.model, dtype=a.dtype)
    enc = m.encode(pairs)
    pool = m.forward_workers()
    if pool is None:
        print(f"{a.threads} thread(s): one worker, nothing to compare")
        return 1
    layout = f"{pool.workers} x {pool.threads_each} thread(s)"
    print(f"{len(enc)} pairs of {DEV.name}, {m.dtype}, {m.cpu_kernels}; workers: {layout}")
    rate: dict[int, list[float]] = {1: [], 0: []}
    out: dict[int, torch.Tensor] = {}
    for w in rate:  # warm-up, and the logits to compare
        m.workers = w
        out[w] = m.encoded_logits(enc)
    for r in range(a.rounds):
        for w in (1, 0) if r % 2 else (0, 1):
            m.workers = w
            t0 = time.perf_counter()
            m.encoded_logits(enc)
            rate[w].append(len(enc) / (time.perf_counter() - t0))
        print(f"round {r + 1}: each batch on {a.threads} threads {rate[1][-1]:.0f} pairs/s, on workers "
              f"{rate[0][-1]:.0f}: {rate[0][-1] / rate[1][-1]:.2f}x", flush=True)  # fmt: skip
    ratios = [x / y for x, y in zip(rate[0], rate[1])]
    print(
        f"median pairs/s: each batch on every thread {statistics.median(rate[1]):.0f}, workers "
        f"{statistics.median(rate[0]):.0f}; per-round ratio {statistics.median(ratios):.2f}x "
        f"({min(ratios):.2f}-{max(ratios):.2f}); largest logit difference {(out[0] - out[1]).abs().max():.1e}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
