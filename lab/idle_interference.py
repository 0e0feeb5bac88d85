"""How much a process at the OS's idle priority still slows live traffic on this machine, with no job at all:
the live phase of bench/jobs.py (64 one-pair clients at a fixed rate, distinct titles, cache off, the built-in
model) alone, beside two SCHED_IDLE processes that spin on the ALU, and beside two that stream memory (a 64 MB
copy, over and over), in alternating order. Whatever the idle processes cost live traffic here is what the
scheduler cannot take back (shared caches, memory bandwidth, SMT siblings on the host), the floor under a
score job's cost to live traffic (docs/jobs.md).

  python lab/idle_interference.py --rounds 2 --seconds 20 --rate 190
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
from jobs import Serve, distinct_pairs, live  # noqa: E402


def hog(kind: str) -> None:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    if kind == "alu":
        x = 0
        while True:
            x = (x * 1103515245 + 12345) & 0xFFFFFFFF
    import numpy as np

    a, b = np.ones(8 * 2**20), np.empty(8 * 2**20)  # 64 MB each: far past the L3
    while True:
        np.copyto(b, a)


def phase(url: str, pairs: list, rate: float, seconds: float, kind: str) -> dict:
    ctx = get_context("fork")
    procs = [ctx.Process(target=hog, args=(kind,), daemon=True) for _ in range(2)] if kind != "none" else []
    for p in procs:
        p.start()
    time.sleep(0.5)
    try:
        lat = sorted(asyncio.run(live(url, pairs, 64, rate, seconds)))
    finally:
        for p in procs:
            p.kill()
            p.join()
    return {"hog": kind, "requests": len(lat), "p50_ms": round(1000 * statistics.median(lat), 1),
            "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1), "load": os.getloadavg()[0]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rate", type=float, default=190)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        srv = Serve("builtin:default", Path(tmp), None, "auto")
        try:
            pairs = distinct_pairs(200_000, "idle")
            asyncio.run(live(srv.url, pairs[-5000:], 64, a.rate, 3))  # warm
            rows, kinds = [], ["none", "alu", "mem"]
            for r in range(a.rounds):
                for kind in kinds if r % 2 == 0 else kinds[::-1]:
                    rows.append(phase(srv.url, pairs[len(rows) * 10_000 :], a.rate, a.seconds, kind) | {"round": r})
                    print(json.dumps(rows[-1]), flush=True)
        finally:
            srv.stop()
    base = {r["round"]: r for r in rows if r["hog"] == "none"}
    for r in rows:
        if r["hog"] != "none":
            b = base[r["round"]]
            p50, p99 = r["p50_ms"] / b["p50_ms"], r["p99_ms"] / b["p99_ms"]
            print(f"round {r['round']} {r['hog']}: p50 {p50:.2f}x, p99 {p99:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
