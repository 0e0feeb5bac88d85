"""What should a forwarded batch cross the model process's pipe as: four plain lists (the former
BatchScores), the ScoredBatch as numpy columns, or a PairScore per pair? Times the pickle round trip
(multiprocessing's dumps, then loads) of one batch in a Result, and the server's side alone (loads, then
the PairScore rows the worker hands the engine). CPU microseconds per batch, median of 7 runs.

    PYTHONPATH=. python lab/pipe_columns.py [--pairs 50]
"""

from __future__ import annotations

import argparse
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.reduction import ForkingPickler

import torch

from model.levels import PairScore, ScoredBatch
from service.runtime.workers.backend import Result, _Message


@dataclass(frozen=True)
class BatchScores(_Message):  # the pipe's message before ScoredBatch crossed it
    logits: list
    probs: list
    level: list
    expected: list
    seconds: float


def cpu_us(f: Callable[[], object], n: int = 3000) -> float:
    runs = []
    for _ in range(7):
        t0 = time.process_time()
        for _ in range(n):
            f()
        runs.append((time.process_time() - t0) / n * 1e6)
    return sorted(runs)[3]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=50)
    a = p.parse_args()
    torch.manual_seed(0)
    logits = torch.randn(a.pairs, 5)
    probs = logits.softmax(-1)
    s = ScoredBatch(logits, probs, probs @ torch.arange(1, 6.0), probs.argmax(-1))
    lists = Result(BatchScores(s.logits.tolist(), s.probs.tolist(), s.level.tolist(), s.expected.tolist(), 0.01))
    columns = Result((s.map(lambda c: c.numpy()), 0.01))
    rows = Result((s.rows(), 0.01))
    for name, msg in {"four lists": lists, "numpy ScoredBatch": columns, "PairScore per pair": rows}.items():
        size = len(bytes(ForkingPickler.dumps(msg)))
        took = cpu_us(lambda m=msg: pickle.loads(bytes(ForkingPickler.dumps(m))))
        print(f"{name}: round trip {took:.1f} us, {size} bytes")
    old, new = bytes(ForkingPickler.dumps(lists)), bytes(ForkingPickler.dumps(columns))

    def old_side() -> list[PairScore]:
        b = pickle.loads(old).value
        return list(map(PairScore, b.logits, b.probs, b.level, b.expected))

    def new_side() -> list[PairScore]:
        return pickle.loads(new).value[0].rows()

    print(
        f"server side, loads + rows: four lists {cpu_us(old_side):.1f} us, numpy ScoredBatch {cpu_us(new_side):.1f} us"
    )


if __name__ == "__main__":
    main()
