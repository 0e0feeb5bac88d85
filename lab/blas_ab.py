"""Is another BLAS faster on this CPU? (issue 20) On AVX2-only CPUs qtrel's float32 linears call MKL's sgemm
through torch (`model.engines.kernels.onednn_pays`); numpy's wheel bundles OpenBLAS, whose kernels differ per CPU.
This times both on MiniLM's linear shapes (the query/key/value projection fused, the attention output, the
FFN's two), one thread, the libraries alternating within each round, best of each round's repeats.

    python lab/blas_ab.py [--rows 256 1024] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

SHAPES = {"q/k/v fused": (384, 1152), "attention output": (384, 384), "FFN in": (384, 1536), "FFN out": (1536, 384)}


def best_seconds(f, repeats: int = 20) -> float:
    f()
    out = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        out = min(out, time.perf_counter() - t0)
    return out


def time_shape(rows: int, k: int, n: int, rounds: int) -> dict[str, list[float]]:
    """GFLOP/s of y = x W^T + b, (rows, k) by (n, k), per round and library."""
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    xn, wn, bn = x.numpy(), w.numpy(), b.numpy()
    out = np.empty((rows, n), np.float32)

    def openblas() -> None:
        np.matmul(xn, wn.T, out=out)
        np.add(out, bn, out=out)  # the bias, as nn.Linear adds it

    fs = {"mkl": lambda: torch.nn.functional.linear(x, w, b), "openblas": openblas}
    runs: dict[str, list[float]] = {lib: [] for lib in fs}
    for r in range(rounds):
        for lib in sorted(fs, reverse=r % 2 == 1):
            runs[lib].append(2 * rows * k * n / best_seconds(fs[lib]) / 1e9)
    return runs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, nargs="+", default=[256, 1024], help="packed tokens per linear")
    p.add_argument("--rounds", type=int, default=3)
    a = p.parse_args()
    torch.set_num_threads(1)
    cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    print(f"torch {torch.__version__} ({torch.backends.mkl.is_available() and 'MKL'}), "
          f"numpy {np.__version__} ({cfg.get('name')} {cfg.get('version')})")  # fmt: skip
    print("| rows | linear (in, out) | MKL via torch GFLOP/s | OpenBLAS via numpy GFLOP/s | OpenBLAS / MKL per round |")
    print("|---:|---|---:|---:|---|")
    for rows in a.rows:
        for name, (k, n) in SHAPES.items():
            runs = time_shape(rows, k, n, a.rounds)
            ratios = ", ".join(f"{o / m:.2f}" for m, o in zip(runs["mkl"], runs["openblas"]))
            print(f"| {rows} | {name} ({k}, {n}) | {statistics.median(runs['mkl']):.0f} | "
                  f"{statistics.median(runs['openblas']):.0f} | {ratios} |", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
