"""Two versions of qtrel served on the same model under the same load, in interleaved rounds: a git revision
(`--base`, checked out into a temporary worktree) against the working tree, or the working tree under settings
(`--base-env QTREL_X=...`, repeatable) against it as it is. For changes to the HTTP process or the runtime,
whose effect is a few percent: single runs on this shared machine drift by ±10%.

Each round starts each version's `qtrel serve` in turn (default layout, score cache off, the order alternating
per round), drives it with 64 closed-loop one-pair aiohttp clients over distinct dev pairs (or, with
`--open-rate R`, Poisson arrivals at R requests/s, latency from each scheduled arrival), and takes pairs/s,
p50/p99 and the CPU of the HTTP process, of the model processes below it and of this client, per pair. The
result is the median of the per-round ratios, working tree ÷ base.

    python bench/code_ab.py --base HEAD~1 [--rounds 6] [--seconds 12]
    python bench/code_ab.py --base-env QTREL_FAST_LANE=false --open-rate 400
    python bench/code_ab.py --quick     # smoke run: the working tree against itself, a tiny checkpoint, 1 round
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness.clients import Http, closed_loop, open_loop
from harness.data import one_pair_bodies, read_dev, tiny_checkpoint
from harness.machine import isa, isa_line
from harness.publish import ROOT, machine, machine_lines
from harness.server import Server, free_port, own_cpu_seconds, qtrel_command, tree

from model.builtin import builtin_dir

OPEN_CAP = 512  # requests in flight at most in the open loop, as load.py's


def split_cpu(root: int) -> tuple[float, float]:
    """(the HTTP process's CPU seconds, those of every live process below it)."""
    return own_cpu_seconds(root), sum(own_cpu_seconds(pid) for pid, _ in tree(root)[1:])


async def window(
    base: str, root: int, bodies: list, clients: int, warmup: float, seconds: float, rate: float | None
) -> dict:
    async with Http(clients if rate is None else OPEN_CAP) as http:
        end = time.perf_counter() + warmup + seconds
        if rate is None:
            task = asyncio.ensure_future(closed_loop(http, base + "/score", bodies, clients, end))
        else:
            task = asyncio.ensure_future(open_loop(http, base + "/score", bodies, rate, end, OPEN_CAP))
        await asyncio.sleep(warmup)
        t0, c0, me0, b0 = time.perf_counter(), split_cpu(root), time.process_time(), await batches(base)
        records = await task
        wall, c1, me1 = time.perf_counter() - t0, split_cpu(root), time.process_time()
        b1 = await batches(base)
    lat = sorted(done - start for start, done, _, status in records if start >= t0 and status == 200)
    n = len(lat)
    return {
        "pairs_per_s": n / wall,
        "p50_ms": 1e3 * lat[n // 2],
        "p99_ms": 1e3 * lat[min(n - 1, int(n * 0.99))],
        "http_ms_per_pair": 1e3 * (c1[0] - c0[0]) / n,
        "model_ms_per_pair": 1e3 * (c1[1] - c0[1]) / n,
        "client_ms_per_pair": 1e3 * (me1 - me0) / n,
        "pairs_per_batch": (b1[1] - b0[1]) / max(1, b1[0] - b0[0]),  # the server's own, the warm-up's last included
    }


async def batches(base: str) -> tuple[float, float]:
    """The server's batches so far and the pairs in them (its qtrel_batch_pairs histogram)."""
    out = [0.0, 0.0]
    text = (await asyncio.to_thread(httpx.get, base + "/metrics", timeout=60)).text
    for line in text.splitlines():
        for i, name in enumerate(("qtrel_batch_pairs_count", "qtrel_batch_pairs_sum")):
            if line.startswith(name + "{") or line.startswith(name + " "):
                out[i] += float(line.rsplit(" ", 1)[1])
    return out[0], out[1]


def worktree(rev: str, into: Path) -> Path:
    """`rev` checked out at `into`, with its own C kernels built in place (their file moved between releases)."""
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "-f", str(into), rev], check=True)
    build = [sys.executable, "setup.py", "-q", "build_ext", "--inplace"]
    subprocess.run(build, cwd=into, check=True, capture_output=True)
    return into


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = p.add_mutually_exclusive_group()
    base.add_argument("--base", help="git revision to compare the working tree against")
    base.add_argument(
        "--base-env", action="append", metavar="KEY=VALUE", help="the base is the working tree with this setting"
    )
    p.add_argument("--open-rate", type=float, help="Poisson arrivals at this many requests/s instead of clients")
    p.add_argument("--model", default=str(builtin_dir("default")))
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--seconds", type=float, default=12.0)
    p.add_argument("--warmup", type=float, default=5.0)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--pairs", type=int, default=7206)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, 1 round of 1 s, 64 pairs")
    a = p.parse_args()
    if not (a.base or a.base_env or a.quick):
        p.error("one of --base or --base-env is required")
    a.base_env = a.base_env or []  # --quick alone: the working tree against itself
    bodies, _ = one_pair_bodies(read_dev(), 64 if a.quick else a.pairs)
    results: dict[str, list[dict]] = {"base": [], "tree": []}
    with tempfile.TemporaryDirectory() as tmp:
        if a.quick:
            a.rounds, a.seconds, a.warmup = 1, 1.0, 0.3
            a.model = str(tiny_checkpoint(Path(tmp) / "tiny"))
        base_dir = worktree(a.base, Path(tmp) / "base") if a.base else None
        try:
            if base_dir is not None:  # the base's packages first on the path; the tree is the installed one
                envs = {"base": {**os.environ, "PYTHONPATH": str(base_dir)}, "tree": dict(os.environ)}
            else:
                envs = {"base": {**os.environ, **dict(kv.split("=", 1) for kv in a.base_env)}, "tree": dict(os.environ)}
            for r in range(a.rounds):
                for name in ("base", "tree") if r % 2 == 0 else ("tree", "base"):
                    port = free_port()
                    url = f"http://127.0.0.1:{port}"
                    cmd = qtrel_command(Path(a.model), port)
                    with Server(cmd, url, "/health/ready", Path(tmp) / f"{name}.log", 300, envs[name]) as s:
                        m = asyncio.run(window(url, s.proc.pid, bodies, a.clients, a.warmup, a.seconds, a.open_rate))
                    results[name].append(m)
                    print(name, r, {k: round(v, 3) for k, v in m.items()}, flush=True)
        finally:
            if base_dir is not None:
                subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(base_dir)], check=False)
    what = f"--base {a.base}" if a.base else " ".join(f"--base-env {kv}" for kv in a.base_env)
    load = f" --open-rate {a.open_rate:g}" if a.open_rate else ""
    command = f"python bench/code_ab.py {what}{load} --rounds {a.rounds} --seconds {a.seconds:g}"
    print("\n".join([*machine_lines(machine(), command), f"- ISA: {isa_line(isa())}"]) + "\n")
    print("| measure | base (median) | working tree (median) | tree ÷ base, median of rounds (range) |")
    print("|---|---:|---:|---:|")
    for key in results["base"][0]:
        b = [m[key] for m in results["base"]]
        t = [m[key] for m in results["tree"]]
        ratios = [x / y for x, y in zip(t, b)]
        print(
            f"| {key} | {statistics.median(b):.3f} | {statistics.median(t):.3f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}–{max(ratios):.3f}) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
