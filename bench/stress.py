"""Bounded stress scenarios against a real `qtrel serve` process on loopback (issue 12): fuzzed input,
overload, SIGTERM under load, slow and vanishing clients. Each scenario starts its own server on the
built-in model (or --model), runs for seconds, prints one JSON line of counts and writes them to
--out (default /tmp/qtrel-stress.json). docs/reliability.md quotes the figures and these commands.

  python bench/stress.py overload --seconds 20
  python bench/stress.py sigterm
  python bench/stress.py slow --seconds 20
  python bench/stress.py fuzz --examples 200      # schemathesis against the live OpenAPI schema
  python bench/stress.py killstorm                # bench/storm.py: model processes SIGKILLed under load
  python bench/stress.py soak --seconds 1800      # bench/storm.py: 30 minutes of mixed traffic
  python bench/stress.py reload --reloads 10      # bench/reload.py: two models, swapped 10 times under load
  python bench/stress.py shadow --seconds 30      # bench/reload.py: live latency without and with a shadow

Every scenario takes --http-workers N (the server's front processes) and --repeat K (K runs, a new server
each), e.g. `sigterm --repeat 5 --http-workers 2`; `killstorm --kill fronts` SIGKILLs front processes.
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import aiohttp
import httpx
from goodput import goodput
from harness.data import tiny_checkpoint
from harness.live import Server, pct, statuses, title
from harness.publish import quick_dir
from reload import add_arguments as add_reload_arguments
from reload import reload, shadow
from storm import add_arguments, killstorm, soak


# --- overload -------------------------------------------------------------------------------------
async def overload(a) -> dict:
    srv = Server(a.model, "--max-queue-pairs", str(a.queue_pairs), "--max-pairs-per-request", "50")
    try:
        srv.wait_ready()
        rng = random.Random(0)
        statuses: dict[int, int] = {}
        accepted: list[float] = []
        retry_after_missing = 0
        peak_in_flight = 0.0
        stop = time.monotonic() + a.seconds

        async def client(c: httpx.AsyncClient):
            nonlocal retry_after_missing
            while time.monotonic() < stop:
                body = {"query": title(rng), "titles": [title(rng) for _ in range(50)]}
                t0 = time.perf_counter()
                r = await c.post(srv.url + "/score", json=body)
                statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
                if r.status_code == 200:
                    accepted.append(time.perf_counter() - t0)
                elif r.status_code == 429:
                    retry_after_missing += "retry-after" not in r.headers
                    await asyncio.sleep(0.05)  # a client that backs off a little, not per Retry-After

        async def watch():
            nonlocal peak_in_flight
            async with httpx.AsyncClient(timeout=5) as c:
                while time.monotonic() < stop:
                    for line in (await c.get(srv.url + "/metrics")).text.splitlines():
                        if line.startswith("qtrel_pairs_in_flight "):
                            peak_in_flight = max(peak_in_flight, float(line.split()[1]))
                    await asyncio.sleep(0.2)

        limits = httpx.Limits(max_connections=a.clients)
        async with httpx.AsyncClient(timeout=60, limits=limits) as c:
            await asyncio.gather(watch(), *(client(c) for _ in range(a.clients)))
        await asyncio.sleep(0.5)
        return {
            "scenario": "overload",
            "seconds": a.seconds,
            "clients": a.clients,
            "pairs_per_request": 50,
            "max_queue_pairs": a.queue_pairs,
            "statuses": statuses,
            "refused_share": round(statuses.get(429, 0) / max(1, sum(statuses.values())), 3),
            "429_without_retry_after": retry_after_missing,
            "accepted_p50_ms": pct(accepted, 0.5),
            "accepted_p99_ms": pct(accepted, 0.99),
            "accepted_pairs_per_s": round(len(accepted) * 50 / a.seconds, 1),
            "peak_pairs_in_flight": peak_in_flight,
            "in_flight_after": srv.metric("qtrel_pairs_in_flight"),
        }
    finally:
        srv.stop()


# --- SIGTERM under load -------------------------------------------------------------------------
async def sigterm(a) -> dict:
    srv = Server(a.model, "--drain-timeout-s", str(a.drain), "--request-timeout-ms", "120000")
    try:
        srv.wait_ready()
        rng = random.Random(1)
        results: list[tuple[float, int | str]] = []  # (sent at, status or transport error) of each request
        signalled = asyncio.Event()

        async def client(c: httpx.AsyncClient):
            while not signalled.is_set():
                body = {"query": title(rng), "titles": [title(rng) for _ in range(50)]}
                sent = time.monotonic()
                try:
                    r = await c.post(srv.url + "/score", json=body)
                    results.append((sent, r.status_code))
                except httpx.TransportError as e:
                    results.append((sent, type(e).__name__))

        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=a.clients)) as c:
            tasks = [asyncio.create_task(client(c)) for _ in range(a.clients)]
            await asyncio.sleep(a.load_s)
            before = len(results)
            t0 = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            signalled.set()  # a client whose request was sent before the signal must have it answered
            ready_after: int | str | None = None
            async with httpx.AsyncClient(timeout=1) as probe:
                try:
                    r = await probe.get(srv.url + "/health/ready")
                    ready_after = r.status_code
                except httpx.TransportError as e:
                    ready_after = type(e).__name__  # the listener closed: no new work either way
            ready_s = time.monotonic() - t0
            await asyncio.gather(*tasks)
        rc = await asyncio.to_thread(srv.proc.wait, a.drain + 15)
        exit_s = time.monotonic() - t0
        # Sent before the signal: admitted work must be answered 200. Not drain losses: a 429 (admission: the queue was
        # full), a 503 (one process: it reached the routes after the drain began, refused by design), a refused
        # connect (never reached the server). Sent after the signal: may meet the closed listener, counted apart.
        late = [x for t, x in results[before:] if t < t0]
        lost = [x for x in late if x not in (200, 429, 503, "ConnectError")]
        return {
            "scenario": "sigterm",
            "clients": a.clients,
            "pairs_per_request": 50,
            "drain_timeout_s": a.drain,
            "requests_before_signal": before,
            "in_flight_at_signal": len(late),
            "answered_200": late.count(200),
            "refused": {"429": late.count(429), "503_draining": late.count(503), "connect": late.count("ConnectError")},
            "lost": len(lost),
            "lost_detail": lost,
            "sent_after_signal": dict(Counter(str(x) for t, x in results[before:] if t >= t0)),
            "readiness_right_after": ready_after,
            "readiness_checked_after_ms": round(ready_s * 1000, 1),
            "exit_code": rc,
            "exit_after_s": round(exit_s, 2),
            "surviving_processes": srv.survivors(),
        }
    finally:
        srv.stop()


# --- slow and vanishing clients -----------------------------------------------------------------
async def slowloris(port: int, open_conns: list, stop: float, body_len: int = 4000):
    """Headers at once, then a body a byte a second (never finished within the window)."""
    try:
        r, w = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return
    open_conns.append(w)
    w.write(
        f"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {body_len}\r\n\r\n".encode()
    )
    sent = 0
    try:
        while time.monotonic() < stop and sent < body_len:
            w.write(b" ")
            await w.drain()
            sent += 1
            await asyncio.sleep(1.0)
    except (ConnectionError, OSError):
        open_conns.remove(w)
        return


SERVER_SERIES = (
    "qtrel_inference_seconds_",
    "qtrel_batch_pairs_",
    "qtrel_batch_tokens_",
    "qtrel_tokenize_seconds_",
    "qtrel_queue_seconds_",
    "qtrel_dropped_pairs_total",
    "qtrel_rejected_total",
    "qtrel_admission_refused_total",
    "qtrel_pairs_total",
)


def scrape(srv: Server) -> dict[str, float]:
    """The server's own counters (histogram sums and counts, no buckets) that explain where model time went."""
    out: dict[str, float] = {}
    for line in httpx.get(srv.url + "/metrics", timeout=60).text.splitlines():  # a loaded host answers late
        if line.startswith("#") or "_bucket{" in line or not line.startswith(SERVER_SERIES):
            continue
        name, val = line.rsplit(" ", 1)
        out[name] = float(val)
    return out


async def slow(a) -> dict:
    """Ordinary one-pair clients (aiohttp, this process) on a quiet server, then again beside slow-body
    connections and vanishing clients (bench/storm.py vanish, a process of its own, so that the client
    measuring latency is not slowed by the attackers' own work)."""
    # The cache off: the vanishing clients resend 16 bodies, which the cache would answer after the first.
    srv = Server(a.model, "--cache-mb", "0", *a.server_args.split())
    try:
        srv.wait_ready()
        rng = random.Random(2)
        refusals: list[str] = []  # the first answers other than 200 an ordinary client got

        async def ordinary(s: aiohttp.ClientSession, seconds: float) -> tuple[list[float], dict]:
            lat: list[float] = []
            st: dict[int | str, int] = {}
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                t0 = time.perf_counter()
                async with s.post(srv.url + "/score", json={"query": title(rng), "titles": [title(rng)]}) as r:
                    body = await r.read()
                st[r.status] = st.get(r.status, 0) + 1
                if r.status != 200 and len(refusals) < 5:
                    refusals.append(body.decode()[:200])
                lat.append(time.perf_counter() - t0)
            return lat, st

        async with aiohttp.ClientSession() as s:
            base = await asyncio.gather(*(ordinary(s, a.seconds / 2) for _ in range(4)))
            base_lat = [x for lat, _ in base for x in lat]
            m_quiet = await asyncio.to_thread(scrape, srv)
            open_conns: list = []
            stop = time.monotonic() + a.seconds
            vanish = await asyncio.create_subprocess_exec(
                sys.executable,
                str(Path(__file__).with_name("storm.py")),
                "vanish",
                srv.url,
                str(a.vanishing),
                str(a.seconds),
                stdout=asyncio.subprocess.PIPE,
            )
            during = asyncio.gather(*(ordinary(s, a.seconds) for _ in range(4)))
            attackers = [asyncio.create_task(slowloris(srv.port, open_conns, stop)) for _ in range(a.slow_conns)]
            res = await during
            open_at_end = len(open_conns)
            for t in attackers:
                t.cancel()
            await asyncio.gather(*attackers, return_exceptions=True)
            for w in open_conns:
                w.close()
            out, _ = await vanish.communicate()
            m_end = await asyncio.to_thread(scrape, srv)
        dur_lat = [x for lat, _ in res for x in lat]
        statuses: dict = {}
        for _, st in res:
            for k, v in st.items():
                statuses[k] = statuses.get(k, 0) + v
        await asyncio.sleep(1.0)
        quiet_p99 = pct(base_lat, 0.99) or 0.0
        return {
            "scenario": "slow",
            "seconds": a.seconds,
            "slow_body_connections": a.slow_conns,
            "slow_connections_still_open_at_end": open_at_end,
            "vanishing_clients": a.vanishing,
            "extra_server_args": a.server_args,
            "requests_abandoned_by_vanishing_clients": int(out.decode().strip() or 0),
            "ordinary_baseline_p50_ms": pct(base_lat, 0.5),
            "ordinary_baseline_p99_ms": quiet_p99,
            "ordinary_during_p50_ms": pct(dur_lat, 0.5),
            "ordinary_during_p99_ms": pct(dur_lat, 0.99),
            "target_p99_ms": max(2 * quiet_p99, 250.0),
            "ordinary_requests_during": len(dur_lat),
            "ordinary_statuses_during": statuses,
            "ordinary_refusals": refusals,
            "dropped_pairs_disconnected": srv.metric("qtrel_dropped_pairs_total"),
            "rejected_disconnected": srv.metric("qtrel_rejected_total"),
            "queue_depth_after": srv.metric("qtrel_queue_depth"),
            "in_flight_after": srv.metric("qtrel_pairs_in_flight"),
            "server_metrics_after_quiet_phase": m_quiet,
            "server_metrics_during_attack": {k: round(v - m_quiet.get(k, 0.0), 4) for k, v in m_end.items()},
        }
    finally:
        srv.stop()


# --- fuzz ---------------------------------------------------------------------------------------
def fuzz(a) -> dict:
    srv = Server(a.model)
    try:
        srv.wait_ready()
        st = Path(sys.executable).with_name("st")
        cmd = [
            str(st),
            "run",
            srv.url + "/openapi.json",
            "--checks",
            "not_a_server_error",
            "--max-examples",
            str(a.examples),
            "--workers",
            "2",
            "--no-color",
        ]
        before = statuses(srv, by_route=True)  # the start-up's 503s from wait_ready's polling
        t0 = time.monotonic()
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, cwd="/tmp")  # its cache: not here
        ready = httpx.get(srv.url + "/health/ready", timeout=5).status_code
        five = sum(v for k, v in statuses(srv).items() if k.startswith("5"))  # 503 on /health/* is readiness
        ok = httpx.post(srv.url + "/score", json={"query": "drill", "titles": ["cordless drill"]}, timeout=10)
        return {
            "scenario": "fuzz",
            "command": " ".join(cmd[1:]),
            "rc": out.returncode,
            "seconds": round(time.monotonic() - t0, 1),
            "server_5xx": five,
            "requests": sum(statuses(srv).values()),
            "statuses": statuses(srv),
            "5xx_by_route_during_fuzz": {
                k: v - before.get(k, 0) for k, v in statuses(srv, by_route=True).items() if v - before.get(k, 0)
            },
            "startup_503_before_fuzz": before,
            "worker_restarts": srv.metric("qtrel_worker_restarts_total"),
            "batches_failed": srv.metric("qtrel_batches_failed_total"),
            "ready_after": ready,
            "score_after": ok.status_code,
            "summary": out.stdout[-3000:],
        }
    finally:
        srv.stop()


def quick(a) -> None:
    """Every phase a second or so, on a tiny checkpoint (both models of reload and shadow), out to the scratch
    folder: the scenario runs end to end, its figures mean nothing."""
    tmp = tempfile.mkdtemp(prefix="qtrel-stress-")
    atexit.register(shutil.rmtree, tmp, True)
    a.model = a.second = str(tiny_checkpoint(Path(tmp) / "tiny"))
    a.seconds, a.load_s, a.drain, a.slow_conns, a.vanishing, a.examples, a.clients = 1, 1, 5, 20, 2, 5, 8
    a.storm, a.every, a.before, a.after, a.sample_every, a.burst_every, a.reloads = 3, 1, 1, 1, 1, 1, 2
    a.out = str(quick_dir() / "stress.json")
    quick_dir().mkdir(parents=True, exist_ok=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    scenarios = {"overload": overload, "sigterm": sigterm, "slow": slow}
    scenarios |= {"killstorm": killstorm, "soak": soak, "goodput": goodput, "reload": reload, "shadow": shadow}
    p.add_argument("scenario", choices=[*scenarios, "fuzz"])
    p.add_argument("--model", default="builtin:default")
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--queue-pairs", type=int, default=400)
    p.add_argument("--drain", type=float, default=30)
    p.add_argument("--load-s", type=float, default=5)
    p.add_argument("--slow-conns", type=int, default=200)
    p.add_argument("--vanishing", type=int, default=8)
    p.add_argument("--examples", type=int, default=100)
    p.add_argument("--timeout", type=float, default=300)
    p.add_argument("--out", default="/tmp/qtrel-stress.json")
    p.add_argument("--repeat", type=int, default=1, help="the scenario this many times, a new server each")
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, seconds-long phases")
    add_arguments(p)
    add_reload_arguments(p)
    a = p.parse_args()
    if a.quick:
        quick(a)
    if a.http_workers:  # every server the scenario starts (harness.live.Server) inherits it
        os.environ["QTREL_HTTP_WORKERS"] = a.http_workers
    runs = [fuzz(a) if a.scenario == "fuzz" else asyncio.run(scenarios[a.scenario](a)) for _ in range(a.repeat)]
    res = runs[0] if a.repeat == 1 else {"scenario": a.scenario, "runs": runs}
    res |= {"http_workers": a.http_workers or "auto", "repeat": a.repeat}
    if a.repeat > 1 and all("lost" in r for r in runs):
        res["lost"] = sum(r["lost"] for r in runs)
    res["command"] = res.get("command") or "python bench/stress.py " + " ".join(sys.argv[1:])
    print(json.dumps({k: v for k, v in res.items() if k != "summary"}))
    if "summary" in res:
        print(res["summary"])
    path = Path(a.out)
    prev = json.loads(path.read_text()) if path.exists() else {}
    prev[a.scenario] = res
    path.write_text(json.dumps(prev, indent=1))


if __name__ == "__main__":
    main()
