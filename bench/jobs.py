"""Score jobs (/v1/jobs) against `qtrel score`, and live traffic with and without a job running.

Starts `qtrel serve` (cache off: QTREL_CACHE_MB=0, torch inference, a jobs directory) and, in interleaved
rounds on the same file of real Home Depot pairs:
  (a) `qtrel score` on the file (its own pairs/s, model load excluded) and the same file as a job (rows over
      the seconds from in_progress to completed, as the client sees them); the outputs compared byte for byte;
  (b) 64 one-pair clients (closed loop) for --seconds without a job, then with a job running: p50, p99,
      requests/s, and the job's rows/s meanwhile.

  python bench/jobs.py --pairs 4000 --seconds 20 --rounds 2     # results printed as JSON and markdown
  python bench/jobs.py --quick --model DIR                       # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
from harness.publish import DEV

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_pairs(path: Path, n: int) -> list[tuple[str, str]]:
    with DEV.open(encoding="utf-8") as f:
        rows = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    rows = [rows[i % len(rows)] for i in range(n)]
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["query", "title"])
        w.writerows(rows)
    return rows


def qtrel_score(model: str, src: Path, out: Path) -> float:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "service.cli", "score", str(src), "--out", str(out), "--model", model]
    done = subprocess.run([*cmd, "--no-progress"], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])["pairs_per_s"]


def run_job(url: str, src: Path, cancel_after: float | None = None) -> tuple[dict, float, bytes | None]:
    """Submit, wait (or cancel after `cancel_after` s); (the last job state, rows/s while running, output)."""
    with httpx.Client(base_url=url, timeout=120) as c:
        job = c.post("/v1/jobs", content=src.read_bytes(), params={"filename": src.name}).json()
        t0 = rows0 = None
        end = time.monotonic() + (cancel_after or 1e9)
        while job["status"] not in ("completed", "failed", "cancelled"):
            time.sleep(0.05)
            job = c.get(f"/v1/jobs/{job['id']}").json()
            if t0 is None and job["status"] == "in_progress":
                t0, rows0 = time.monotonic(), job["progress"]["rows_done"]
            if cancel_after is not None and time.monotonic() > end:
                rows1, t1 = job["progress"]["rows_done"], time.monotonic()
                c.post(f"/v1/jobs/{job['id']}/cancel")
                return job, (rows1 - (rows0 or 0)) / (t1 - (t0 or t1) or 1), None
        t1 = time.monotonic()
        out = c.get(f"/v1/jobs/{job['id']}/output").content if job["status"] == "completed" else None
        c.delete(f"/v1/jobs/{job['id']}")
        return job, job["request_counts"]["total"] / (t1 - (t0 or t1) or 1), out


def in_background(holder: dict, url: str, src: Path, seconds: float) -> None:
    holder["job"] = run_job(url, src, cancel_after=seconds)


async def clients(url: str, pairs: list[tuple[str, str]], n: int, seconds: float) -> dict:
    lat: list[float] = []
    stop = time.monotonic() + seconds

    async def one(k: int) -> None:
        async with httpx.AsyncClient(base_url=url, timeout=60) as c:
            i = k
            while time.monotonic() < stop:
                q, t = pairs[i % len(pairs)]
                t0 = time.perf_counter()
                r = await c.post("/score", json={"query": q, "titles": [t]})
                if r.status_code == 200:
                    lat.append(time.perf_counter() - t0)
                i += n

    await asyncio.gather(*(one(k) for k in range(n)))
    lat.sort()
    return {
        "requests_per_s": round(len(lat) / seconds, 1),
        "p50_ms": round(1000 * statistics.median(lat), 2),
        "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 2),
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="builtin:default")
    p.add_argument("--pairs", type=int, default=4000)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    if a.quick:
        a.pairs, a.seconds, a.rounds, a.clients = 300, 2, 1, 8
    work = Path(tempfile.mkdtemp(prefix="qtrel-bench-jobs-"))
    src = work / "pairs.csv"
    pairs = write_pairs(src, a.pairs)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "QTREL_CACHE_MB": "0", "QTREL_INFERENCE": "torch", "QTREL_JOBS_DIR": str(work / "jobs")}
    env |= {"QTREL_JOB_MIN_FREE_BYTES": "0", "QTREL_LOG_LEVEL": "warning"}
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", a.model, "--host", "127.0.0.1", "--port", str(port)]
    server = subprocess.Popen(cmd, env=env, stdout=open(work / "server.log", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    results: dict = {"pairs": a.pairs, "rounds": [], "command": " ".join(sys.argv)}
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        info = httpx.get(url + "/info").json()
        results["server"] = {"dtype": info["dtype"], "attention": info["model"].get("attention")}
        for _ in range(a.rounds):
            score_rate = qtrel_score(a.model, src, work / "ref.csv")
            job, job_rate, out = run_job(url, src)
            same = out == (work / "ref.csv").read_bytes()
            alone = asyncio.run(clients(url, pairs, a.clients, a.seconds))
            big = work / "big.csv"
            write_pairs(big, max(a.pairs * 10, 20000))
            holder: dict = {}
            t = threading.Thread(target=in_background, args=(holder, url, big, a.seconds + 1))
            t.start()
            time.sleep(1)
            beside = asyncio.run(clients(url, pairs, a.clients, a.seconds))
            t.join()
            row = {
                "qtrel_score_pairs_per_s": score_rate,
                "job_pairs_per_s": round(job_rate, 1),
                "job_vs_score": round(job_rate / score_rate, 3),
                "identical_output": same,
                "live_alone": alone,
                "live_with_job": beside,
                "job_rows_per_s_beside_live": round(holder["job"][1], 1),
                "p50_ratio": round(beside["p50_ms"] / alone["p50_ms"], 3),
                "p99_ratio": round(beside["p99_ms"] / alone["p99_ms"], 3),
            }
            results["rounds"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
