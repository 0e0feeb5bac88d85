"""Two long scenarios against a real `qtrel serve` (run through bench/stress.py):

  python bench/stress.py killstorm            # SIGKILL a random model process every 3 s for 30 s, 16 clients
  python bench/stress.py killstorm --kill fronts --http-workers 2 --every 12 --storm 60   # front processes
  python bench/stress.py soak --seconds 1800  # 30 minutes of mixed traffic; --seconds 60 for a short run

The clients are aiohttp (one event loop, little CPU beside the server's); every figure is counted by
the client and cross-checked with the server's own metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from pathlib import Path

import aiohttp
import httpx
from harness.live import Server, statuses, title
from harness.loadlog import Log, post, summary

OPEN_CAP = 512  # requests in flight at most in an open loop, as load.py's
FRONT_UP_S = 3.0  # killstorm --kill fronts: a front is killed only while every front has been up this long


def age_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f, open("/proc/uptime") as up:
        return float(up.read().split()[0]) - int(f.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")


def victims(srv: Server, kill: str) -> list[int]:
    """The model processes' pids, or the front processes' once every front has been up for FRONT_UP_S
    (a storm of fronts, not the death of all at once; none while /info cannot answer)."""
    try:
        info = httpx.get(srv.url + "/info", timeout=5).json()
        if kill == "models":
            return info["worker"]["pids"]
        pids = info["fronts"].get("pids", [])
        full = len(pids) == info["fronts"]["http_workers"] and min(map(age_s, pids)) >= FRONT_UP_S
        return pids if full else []
    except (httpx.TransportError, ValueError, OSError):
        return []  # a new connection can meet the front just killed, a pid its end


def health(srv: Server) -> dict:
    out: dict = {}
    for p in ("ready", "live"):
        try:
            out[p] = httpx.get(srv.url + f"/health/{p}", timeout=5).status_code
        except httpx.TransportError as e:
            out[p] = type(e).__name__
    return out


# --- the kill storm -------------------------------------------------------------------------------
async def killstorm(a) -> dict:
    srv = Server(a.model, "--request-timeout-ms", "120000")
    try:
        srv.wait_ready()
        if a.kill == "fronts" and len(victims(srv, "fronts")) < 2:
            raise SystemExit("--kill fronts needs --http-workers 2 or more: one front must serve on")
        rng = random.Random(3)
        log = Log()
        stop = asyncio.Event()

        async def client(s: aiohttp.ClientSession, n: int) -> None:
            while not stop.is_set():
                body = {"query": title(rng), "titles": [title(rng) for _ in range(n)]}
                await post(s, srv.url + "/score", body, log, n)

        kills: list[dict] = []
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            sizes = [1] * (a.clients - a.clients // 4) + [50] * (a.clients // 4)
            tasks = [asyncio.create_task(client(s, n)) for n in sizes]
            await asyncio.sleep(a.before)
            t_storm = time.monotonic()
            while time.monotonic() - t_storm < a.storm:
                pids = await asyncio.to_thread(victims, srv, a.kill)
                if pids:
                    pid = rng.choice(pids)
                    try:
                        os.kill(pid, signal.SIGKILL)
                        kills.append({"t": round(time.monotonic() - t_storm, 2), "pid": pid})
                    except ProcessLookupError:
                        pass
                await asyncio.sleep(a.every)
            t_end = time.monotonic()
            after_storm = await asyncio.to_thread(health, srv)
            await asyncio.sleep(a.after)
            stop.set()
            await asyncio.gather(*tasks)
        t_done = time.monotonic()
        base = summary(log.window(t_storm - a.before, t_storm), a.before)
        # Back at full speed: the first second after the storm from which a 3 s window serves >= 90% of
        # the pairs/s before it.
        recovered = None
        for k in range(int(a.after) - 2):
            w = summary(log.window(t_end + k, t_end + k + 3), 3)
            if base["pairs_per_s"] and (w["pairs_per_s"] or 0) >= 0.9 * base["pairs_per_s"]:
                recovered = k
                break
        rows = log.rows
        return {
            "scenario": "killstorm",
            "killed": a.kill,
            "clients": a.clients,
            "kill_every_s": a.every,
            "storm_s": a.storm,
            "kills": len(kills),
            "kill_times": kills,
            "before": base,
            "during": summary(log.window(t_storm, t_end), t_end - t_storm),
            "after": summary(log.window(t_end, t_done), t_done - t_end),
            "health_right_after_storm": after_storm,
            "health_at_end": health(srv),
            "recovered_full_speed_after_s": recovered,
            # a front's death drops the connections it held (ServerDisconnectedError, ClientOSError); a
            # connection refused (ClientConnectorError) was never accepted
            "accepted_not_answered": sum(1 for r in rows if isinstance(r[1], str) and r[1] != "ClientConnectorError"),
            "answered_not_200": sum(1 for r in rows if isinstance(r[1], int) and r[1] != 200),
            "front_restarts": (await asyncio.to_thread(httpx.get, srv.url + "/info")).json()["fronts"].get("restarts"),
            "server_statuses": statuses(srv),
            "worker_restarts": srv.metric("qtrel_worker_restarts_total"),
            "batches_retried": srv.metric("qtrel_batches_retried_total"),
            "batches_split": srv.metric("qtrel_batches_split_total"),
            "batches_failed": srv.metric("qtrel_batches_failed_total"),
        }
    finally:
        srv.stop()


# --- the soak -------------------------------------------------------------------------------------
def proc_sample(pid: int) -> dict:
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {
        "rss_mb": round(int(fields["VmRSS"].split()[0]) / 1024, 1),
        "threads": int(fields["Threads"]),
        "fds": len(os.listdir(f"/proc/{pid}/fd")),
    }


async def soak(a) -> dict:
    srv = Server(
        a.model,
        "--max-queue-pairs",
        str(a.queue_pairs),
        "--max-pairs-per-request",
        str(min(200, a.queue_pairs)),  # the hang-ups' 200 titles; the default (2048) exceeds a small queue
        "--request-timeout-ms",
        "30000",
    )
    try:
        srv.wait_ready()
        at_start = statuses(srv)  # wait_ready's readiness polls before the model was warm: 503s, not load
        rng = random.Random(4)
        log = Log()
        stop = asyncio.Event()
        u = srv.url
        bad = [  # each must be refused with a 4xx, never a 5xx
            ("/score", {"query": "", "titles": ["x"]}),
            ("/score", {"query": "q", "titles": []}),
            ("/score", {"pairs": [{"query": "q"}]}),
            ("/score", {"query": "q", "titles": ["x"], "truncation": "middle"}),
            ("/v1/rerank", {"query": "q"}),
            ("/tokenize", {"query": 3, "titles": ["x"]}),
        ]

        async def mixed(s: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                x = rng.random()
                q = title(rng)
                if x < 0.45:
                    await post(s, u + "/score", {"query": q, "titles": [title(rng)]}, log, 1)
                elif x < 0.65:
                    await post(s, u + "/score", {"query": q, "titles": [title(rng) for _ in range(50)]}, log, 50)
                elif x < 0.8:
                    docs = [title(rng) for _ in range(20)]
                    await post(s, u + "/v1/rerank", {"model": "m", "query": q, "documents": docs, "top_n": 3}, log, 20)
                elif x < 0.85:
                    await post(s, u + "/explain", {"query": q, "title": title(rng)}, log, 1)
                elif x < 0.92:
                    await post(s, u + "/tokenize", {"query": q, "titles": [title(rng)]}, log, 0)
                else:
                    path, body = rng.choice(bad)
                    await post(s, u + path, body, log, 0)

        async def hangups(s: aiohttp.ClientSession) -> None:
            while not stop.is_set():
                body = {"query": title(rng), "titles": [title(rng) for _ in range(200)]}
                await post(s, u + "/score", body, log, 0, timeout=0.05)
                await asyncio.sleep(0.5)

        async def bursts(s: aiohttp.ClientSession) -> None:  # now and then more than the queue holds: 429s
            while not stop.is_set():
                await asyncio.sleep(a.burst_every)
                body = {"query": title(rng), "titles": [title(rng) for _ in range(50)]}
                await asyncio.gather(*(post(s, u + "/score", body, log, 50) for _ in range(12)))

        samples: list[dict] = []
        t0 = time.monotonic()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
            tasks = [asyncio.create_task(mixed(s)) for _ in range(a.clients)]
            tasks += [asyncio.create_task(hangups(s)), asyncio.create_task(bursts(s))]
            last = t0
            while time.monotonic() - t0 < a.seconds:
                await asyncio.sleep(a.sample_every)
                now = time.monotonic()
                pids = await asyncio.to_thread(victims, srv, "models")
                win = summary(log.window(last, now), now - last)
                samples.append(
                    {
                        "t_s": round(now - t0),
                        "server": proc_sample(srv.proc.pid),
                        "models": [proc_sample(p) for p in pids],
                        "p99_ms": win["p99_ms"],
                        "pairs_per_s": win["pairs_per_s"],
                        "5xx": sum(v for k, v in win["statuses"].items() if k.startswith("5")),
                    }
                )
                last = now
            stop.set()
            await asyncio.gather(*tasks)
        total = summary(log.rows, time.monotonic() - t0)
        warm = samples[max(0, len(samples) // 5 - 1)]  # after warm-up: the end of the first fifth
        end = samples[-1]

        def growth(key: str) -> dict:
            def rss(sample):
                return sample["server"]["rss_mb"] + sum(m["rss_mb"] for m in sample["models"])

            if key == "rss_mb":
                return {"after_warmup": round(rss(warm), 1), "end": round(rss(end), 1), "growth": rss(end) / rss(warm)}
            vals = [x["server"][key] + sum(m[key] for m in x["models"]) for x in samples]
            return {"min": min(vals), "max": max(vals), "after_warmup": vals[len(samples) // 5 - 1 or 0]}

        p99s = [x["p99_ms"] for x in samples if x["p99_ms"] is not None]
        return {
            "scenario": "soak",
            "seconds": a.seconds,
            "clients": a.clients,
            "total": total,
            "server_5xx": sum(v - at_start.get(k, 0) for k, v in statuses(srv).items() if k.startswith("5")),
            "server_statuses": statuses(srv),
            "server_statuses_at_start": at_start,
            "rss_mb_all_processes": growth("rss_mb"),
            "open_fds_all_processes": growth("fds"),
            "threads_all_processes": growth("threads"),
            "p99_ms_per_window": {"first_after_warmup": p99s[len(p99s) // 5] if p99s else None, "max": max(p99s)},
            "worker_restarts": srv.metric("qtrel_worker_restarts_total"),
            "health_at_end": health(srv),
            "samples": samples,
        }
    finally:
        srv.stop()


def add_arguments(p) -> None:
    p.add_argument("--http-workers", default="", help="every scenario: the server's front processes (default auto)")
    p.add_argument("--kill", choices=["models", "fronts"], default="models", help="killstorm: whose processes")
    p.add_argument("--every", type=float, default=3.0, help="killstorm: seconds between kills")
    p.add_argument("--storm", type=float, default=30.0, help="killstorm: seconds of kills")
    p.add_argument("--before", type=float, default=10.0, help="killstorm: seconds of load before the storm")
    p.add_argument("--after", type=float, default=20.0, help="killstorm: seconds of load after the storm")
    p.add_argument("--sample-every", type=float, default=10.0, help="soak: seconds between samples")
    p.add_argument("--burst-every", type=float, default=20.0, help="soak: seconds between overload bursts")
    p.add_argument("--open-loop", action="store_true", help="goodput: the 4x phase as an open loop at 4x capacity")
    p.add_argument("--server-args", default="", help="goodput, slow: extra `qtrel serve` arguments, space-separated")


if __name__ == "__main__":
    import sys

    if len(sys.argv) == 5 and sys.argv[1] == "vanish":  # used by bench/stress.py slow, in a process of its own
        from harness.vanish import vanish

        print(asyncio.run(vanish(sys.argv[2], int(sys.argv[3]), float(sys.argv[4]))))
    else:
        print(json.dumps({"use": "python bench/stress.py killstorm|soak"}))
