"""Score jobs (/v1/jobs) beside live traffic, and a job alone against `qtrel score`.

Starts `qtrel serve` (the pair-score cache off, QTREL_CACHE_MB=0; torch inference, as `qtrel score`; a jobs
directory) and measures, on real Home Depot pairs made distinct (a repeated dev pair gets a numbered title,
so that neither the cache nor duplicate folding nor single flight saves any work):

  (a) a job alone against `qtrel score` on the same file (--compare-pairs), in rounds whose order alternates:
      `qtrel score`'s own pairs/s (model load excluded) and the job's rows over the seconds from the client
      seeing it in_progress to seeing it completed; the outputs compared byte for byte; target: job >= 0.9x.
  (b) 64 one-pair clients (--clients), each title distinct, at a fixed offered rate (--live-rate; default
      a share of `qtrel score`'s pairs/s, so that the live traffic leaves capacity to fill), without and with
      a job of --job-pairs (100k) running, in rounds whose order alternates: p50 and p99 (targets: within
      1.15x and 1.3x of the run without the job) and the job's share of the capacity they leave (target >=
      80%). With the job's own process (job_processes idle, the default on cpu: the job driver, which does all
      of the job's work, reading, tokenising, forwarding and writing) in CPU seconds, since an idle-priority
      process's wall time counts the time live work kept it waiting:
          left  = cores x seconds - live CPU seconds (server and clients in the run without the job, per
                  request, times the requests served with it)
          share = CPU seconds of the job driver / left
      On the live processes (--job-processes shared) in model-process seconds from the server's
      qtrel_inference_seconds (every forward, live or job), as before:
          left  = model processes x seconds - live forward seconds (without the job, per request, x requests)
          share = (forward seconds with the job - live forward seconds) / left
  Each phase reports the CPU seconds of the clients (this process), of the server (every process of it) and of
  the job driver; `extra_cpu_share` (both modes) is all the CPU spent beyond the live traffic's / left.

  python bench/jobs.py                  # the full measurement: < 8 min on 2 vCPUs (Zen 4, builtin:default)
  python bench/jobs.py --job-chunk-rows 500   # the live phase with a gentler job (batches of ~1024 tokens)
  python bench/jobs.py --job-processes shared # job batches on the live model processes (before: 3.2x live p50)
  python bench/jobs.py --quick          # a tiny random checkpoint, seconds per phase (tests/bench)
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from harness.clients import Http
from harness.data import tiny_checkpoint
from harness.machine import isa, isa_line
from harness.publish import DEV
from harness.server import cpu_seconds, free_port, metrics_of, own_cpu_seconds

FINISHED = ("completed", "failed", "cancelled")
DEV_CSV = DEV


# --- data ---------------------------------------------------------------------------------------
def distinct_pairs(n: int, tag: str) -> list[tuple[str, str]]:
    """`n` distinct pairs: the dev set's in order, repeated with `tag` and a number in the title."""
    with DEV_CSV.open(encoding="utf-8") as f:
        rows = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    out, seen = [], set()
    for i in range(n):
        q, t = rows[i % len(rows)]
        if (q, t) in seen or i >= len(rows):
            t = f"{t} {tag}{i}"
        seen.add((q, t))
        out.append((q, t))
    return out


def write_csv(path: Path, pairs: list[tuple[str, str]]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(["query", "title"])
        w.writerows(pairs)
    return path


# --- the server ---------------------------------------------------------------------------------
class Serve:
    def __init__(self, model: str, work: Path, http_workers: str | None, job_processes: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = os.environ | {"QTREL_CACHE_MB": "0", "QTREL_INFERENCE": "torch", "QTREL_JOBS_DIR": str(work / "jobs")}
        env |= {"QTREL_JOB_MIN_FREE_BYTES": "0", "QTREL_LOG_LEVEL": "warning", "QTREL_JOB_PROCESSES": job_processes}
        cmd = [sys.executable, "-m", "service.cli", "serve", "--model", model, "--host", "127.0.0.1"]
        cmd += ["--port", str(self.port)] + (["--http-workers", http_workers] if http_workers else [])
        log = (work / "server.log").open("w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + float(os.environ.get("QTREL_BENCH_READY_S", 300))
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server exited: {(work / 'server.log').read_text()[-2000:]}")
            try:
                if httpx.get(self.url + "/health/ready", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit("the server never became ready")
        self.info = httpx.get(self.url + "/info", timeout=30).json()

    def cpu(self) -> float:
        return cpu_seconds(self.proc.pid)

    def job_cpu(self) -> dict[int, float]:
        """CPU seconds of the job driver, if one is up (none with job_processes shared)."""
        pids = (httpx.get(self.url + "/info", timeout=30).json().get("job_processes") or {}).get("pids", [])
        return {pid: own_cpu_seconds(pid) for pid in pids}

    def forward_seconds(self) -> float:
        return metrics_of(httpx.get(self.url + "/metrics", timeout=30).text).get("qtrel_inference_seconds_sum", 0.0)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)


def model_processes(info: dict) -> int:
    """The model processes serving the default model, as the layout chose them (`/info`)."""
    return int(info["worker"]["replicas"])


# --- (a) a job alone against qtrel score ---------------------------------------------------------
def qtrel_score(model: str, dtype: str, src: Path, out: Path) -> dict:
    out.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "service.cli", "score", str(src), "--out", str(out), "--model", model]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([*cmd, "--dtype", dtype, "--no-progress"], capture_output=True, text=True, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    return {"pairs_per_s": json.loads(done.stdout.strip().splitlines()[-1])["pairs_per_s"], "cpu_s": round(cpu, 1)}


def submit(c: httpx.Client, src: Path, **options: str) -> dict:
    r = c.post("/v1/jobs", content=src.read_bytes(), params={"filename": src.name, **options})
    if r.status_code != 200:
        raise SystemExit(f"job refused: {r.status_code} {r.text}")
    return r.json()


def job_alone(srv: Serve, src: Path) -> tuple[dict, bytes | None]:
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        job, cpu0 = submit(c, src), srv.cpu()
        t0 = None
        while job["status"] not in FINISHED:
            time.sleep(0.05)
            job = c.get(f"/v1/jobs/{job['id']}").json()
            if t0 is None and job["status"] != "queued":
                t0 = time.monotonic()
        seconds = time.monotonic() - (t0 or time.monotonic())
        out = c.get(f"/v1/jobs/{job['id']}/output").content if job["status"] == "completed" else None
        c.delete(f"/v1/jobs/{job['id']}")
    rate = job["request_counts"]["total"] / max(seconds, 1e-9)
    return {"pairs_per_s": round(rate, 1), "server_cpu_s": round(srv.cpu() - cpu0, 1), "status": job["status"]}, out


# --- (b) live clients with and without a job -----------------------------------------------------
async def live(url: str, pairs: list[tuple[str, str]], clients: int, rate: float, seconds: float) -> list[float]:
    """`clients` clients sending one distinct pair each at `rate` requests/s in all (each on its own
    schedule: a late answer sends the next at once); the latencies of the 200s."""
    lat: list[float] = []
    end = time.monotonic() + seconds
    gap = clients / rate
    bodies = iter(json.dumps({"query": q, "titles": [t]}).encode() for q, t in pairs)

    async def client(http: Http, k: int) -> None:
        due = time.monotonic() + gap * k / clients
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            if time.monotonic() >= end:
                return
            t0 = time.perf_counter()
            if await http.post(url + "/score", next(bodies)) == 200:
                lat.append(time.perf_counter() - t0)
            due += gap

    async with Http(clients) as http:
        await asyncio.gather(*(client(http, k) for k in range(clients)))
    return lat


def phase(srv: Serve, pairs: list, a: argparse.Namespace, rate: float) -> dict:
    f0, j0, s0, c0, t0 = srv.forward_seconds(), srv.job_cpu(), srv.cpu(), time.process_time(), time.monotonic()
    lat = asyncio.run(live(srv.url, pairs, a.clients, rate, a.seconds))
    wall = time.monotonic() - t0
    j1 = srv.job_cpu()  # processes started meanwhile count from 0
    lat.sort()
    return {
        "requests": len(lat),
        "requests_per_s": round(len(lat) / wall, 1),
        "p50_ms": round(1000 * statistics.median(lat), 1),
        "p99_ms": round(1000 * lat[int(0.99 * (len(lat) - 1))], 1),
        "wall_s": round(wall, 2),
        "forward_s": srv.forward_seconds() - f0,
        "client_cpu_s": round(time.process_time() - c0, 1),
        "server_cpu_s": round(srv.cpu() - s0, 1),
        "job_processes_cpu_s": round(sum(cpu - j0.get(pid, 0.0) for pid, cpu in j1.items()), 1),
        "job_processes": len(j1),
    }


def with_job(srv: Serve, src: Path, pairs: list, a: argparse.Namespace, rate: float) -> dict:
    """The live phase while a job of `src` runs: submitted first, the clients start once it is in progress."""
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        job = submit(c, src, chunk_rows=str(a.job_chunk_rows))
        while (job := c.get(f"/v1/jobs/{job['id']}").json())["status"] == "queued":
            time.sleep(0.05)
        got = phase(srv, pairs, a, rate)
        job = c.get(f"/v1/jobs/{job['id']}").json()
        got["job_status_after"] = job["status"]  # in_progress: the job ran through the whole phase
        c.post(f"/v1/jobs/{job['id']}/cancel")
        while (job := c.get(f"/v1/jobs/{job['id']}").json())["status"] not in FINISHED:
            time.sleep(0.1)
        c.delete(f"/v1/jobs/{job['id']}")
        while (c.get("/info").json().get("job_processes") or {}).get("running"):  # no job left: they end
            time.sleep(0.1)  # before the next phase, whose server CPU would lose theirs
    return got


def share(alone: dict, beside: dict, processes: int) -> dict:
    live_per_request = alone["forward_s"] / max(alone["requests"], 1)
    live_s = live_per_request * beside["requests"]
    left = processes * beside["wall_s"] - live_s
    job_s = beside["forward_s"] - live_s
    cores = len(os.sched_getaffinity(0))
    live_cpu = (alone["server_cpu_s"] + alone["client_cpu_s"]) / max(alone["requests"], 1) * beside["requests"]
    cpu_left = max(cores * beside["wall_s"] - live_cpu, 1e-9)
    spent = beside["server_cpu_s"] + beside["client_cpu_s"] - live_cpu
    own = beside["job_processes"] > 0  # the job's own model processes: their CPU (their wall time counts waits)
    return {
        "live_busy": round(alone["forward_s"] / (processes * alone["wall_s"]), 3),
        "live_cpu_busy": round(live_cpu / (cores * beside["wall_s"]), 3),
        "job_share_of_left": round(beside["job_processes_cpu_s"] / cpu_left if own else job_s / max(left, 1e-9), 3),
        "extra_cpu_share": round(spent / cpu_left, 3),
        "p50_ratio": round(beside["p50_ms"] / alone["p50_ms"], 3),
        "p99_ratio": round(beside["p99_ms"] / alone["p99_ms"], 3),
    }


# --- main ---------------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:default")
    p.add_argument("--job-pairs", type=int, default=100_000, help="the job that runs beside live traffic")
    p.add_argument("--job-chunk-rows", type=int, default=20000, help="the live phase's job: chunk_rows (its batches)")
    p.add_argument("--compare-pairs", type=int, default=30_000, help="the file of (a): qtrel score and the job")
    p.add_argument("--compare-rounds", type=int, default=2, help="0: none (give --live-rate)")
    p.add_argument("--seconds", type=float, default=20, help="each live phase")
    p.add_argument("--rounds", type=int, default=2, help="live rounds (each: without and with a job)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--live-rate", type=float, default=None, help="requests/s of all clients (default: --live-load)")
    p.add_argument("--live-load", type=float, default=0.3, help="the default live rate, x qtrel score's pairs/s")
    p.add_argument("--http-workers", default=None, help="qtrel serve --http-workers (default: its auto)")
    p.add_argument("--job-processes", default="auto", choices=["auto", "idle", "shared"], help="QTREL_JOB_PROCESSES")
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here too")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="qtrel-bench-jobs-"))
    if a.quick:
        a.model = str(tiny_checkpoint(work / "tiny"))
        a.job_pairs, a.compare_pairs, a.compare_rounds, a.seconds, a.rounds, a.clients = 3000, 600, 1, 2, 1, 8
    t_start = time.monotonic()
    job_file = write_csv(work / "job.csv", distinct_pairs(a.job_pairs, "#"))
    compare = write_csv(work / "compare.csv", distinct_pairs(a.compare_pairs, "#"))
    live_pairs = distinct_pairs(100_000 if not a.quick else 20_000, "~")[::-1]  # none of the job's own pairs
    i = isa()
    results: dict = {"machine": isa_line(i), "command": " ".join(sys.argv), "compare": [], "live": []}
    print(results["machine"], "| load average", Path("/proc/loadavg").read_text().split()[:3], flush=True)
    srv = Serve(a.model, work, a.http_workers, a.job_processes)
    try:
        dtype, processes = srv.info["dtype"], model_processes(srv.info)
        results["server"] = {"dtype": dtype, "model_processes": processes, "fronts": srv.info.get("fronts")}
        results["server"]["job_processes"] = srv.info.get("job_processes")
        ref = work / "ref.csv"
        for r in range(a.compare_rounds):
            order = ["score", "job"] if r % 2 == 0 else ["job", "score"]
            row: dict = {}
            for what in order:
                if what == "score":
                    row["qtrel_score"] = qtrel_score(a.model, dtype, compare, ref)
                else:
                    row["job"], out = job_alone(srv, compare)
            row["identical_output"] = out == ref.read_bytes()
            row["job_vs_score"] = round(row["job"]["pairs_per_s"] / row["qtrel_score"]["pairs_per_s"], 3)
            results["compare"].append(row)
            print(json.dumps(row), flush=True)
        rate = a.live_rate or a.live_load * statistics.median(
            r["qtrel_score"]["pairs_per_s"] for r in results["compare"]
        )
        results["live_rate"] = round(rate, 1)
        offset = 0
        for r in range(a.rounds):
            row = {}
            for what in ["alone", "with_job"] if r % 2 == 0 else ["with_job", "alone"]:
                chunk = live_pairs[offset:]
                offset += int(rate * a.seconds * 1.5) + a.clients
                row[what] = phase(srv, chunk, a, rate) if what == "alone" else with_job(srv, job_file, chunk, a, rate)
            row |= share(row["alone"], row["with_job"], processes)
            results["live"].append(row)
            print(json.dumps(row), flush=True)
    finally:
        srv.stop()
    results["summary"] = {
        "job_vs_score": statistics.median(r["job_vs_score"] for r in results["compare"])
        if results["compare"]
        else None,
        "identical_output": all(r["identical_output"] for r in results["compare"]),
        **{
            k: statistics.median(r[k] for r in results["live"])
            for k in ("p50_ratio", "p99_ratio", "job_share_of_left", "extra_cpu_share")
        },
        "load_average_after": Path("/proc/loadavg").read_text().split()[:3],
        "wall_s": round(time.monotonic() - t_start, 1),
    }
    print(json.dumps(results, indent=1))
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0 if results["summary"]["identical_output"] else 1


if __name__ == "__main__":
    sys.exit(main())
