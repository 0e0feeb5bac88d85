"""Model lifecycle under load (issue 21), against a real `qtrel serve` with two models: `reload` swaps a
model N times through the admin route while clients score both models, and counts every non-200;
`shadow` measures live latency without and with a shadow model scoring a share of the pairs.

  python bench/stress.py reload --reloads 10 --clients 8
  python bench/stress.py reload --reloads 10 --clients 8 --reload-mode in_place
  python bench/stress.py shadow --seconds 30 --clients 8 --shadow-rate 0.25
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import httpx
from harness.live import Server, pct, title


def group_rss(srv: Server) -> int:
    """Resident bytes of the server's process group (the server and its model processes)."""
    total = 0
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == srv.proc.pid:
                    total += int((d / "statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except (OSError, ValueError, IndexError):
                continue
    return total


def add_arguments(p) -> None:
    p.add_argument("--reloads", type=int, default=10, help="reload: swaps, one after the other")
    p.add_argument("--reload-mode", default="beside", choices=["beside", "in_place", "auto"])
    p.add_argument("--second", default="builtin:pruned", help="reload: the second model; shadow: the shadow")
    p.add_argument("--shadow-rate", type=float, default=0.25)
    p.add_argument("--pairs", type=int, default=8, help="pairs per request")
    p.add_argument("--rate", type=float, default=0, help="shadow: open-loop requests/s (0: --clients closed loops)")


async def load(url: str, clients: int, pairs: int, models: list[str | None], stop, seed: int = 0):
    """Clients scoring fresh pairs (Cache-Control: no-cache) until `stop()`: statuses and (t, seconds) of 200s."""
    statuses: dict[int, int] = {}
    done: list[tuple[float, float]] = []

    async def client(c: httpx.AsyncClient, k: int) -> None:
        rng = random.Random(seed + k)
        model = models[k % len(models)]
        while not stop():
            body = {"query": title(rng), "titles": [title(rng) for _ in range(pairs)]}
            if model:
                body["model"] = model
            t0 = time.perf_counter()
            try:
                r = await c.post(url + "/score", json=body, headers={"Cache-Control": "no-cache"})
                code = r.status_code
            except httpx.TransportError:
                code = 0
            statuses[code] = statuses.get(code, 0) + 1
            if code == 200:
                done.append((time.monotonic(), time.perf_counter() - t0))

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=clients)) as c:
        await asyncio.gather(*(client(c, k) for k in range(clients)))
    return statuses, done


async def open_load(url: str, rate: float, seconds: float, pairs: int):
    """Requests sent at a fixed rate (open loop, below capacity), whatever the answers take."""
    statuses: dict[int, int] = {}
    done: list[tuple[float, float]] = []
    rng = random.Random(0)

    async def one(c: httpx.AsyncClient, body: dict) -> None:
        t0 = time.perf_counter()
        try:
            code = (await c.post(url + "/score", json=body, headers={"Cache-Control": "no-cache"})).status_code
        except httpx.TransportError:
            code = 0
        statuses[code] = statuses.get(code, 0) + 1
        if code == 200:
            done.append((time.monotonic(), time.perf_counter() - t0))

    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=256)) as c:
        tasks, start = [], time.monotonic()
        for i in range(int(rate * seconds)):
            await asyncio.sleep(max(0.0, start + i / rate - time.monotonic()))
            body = {"query": title(rng), "titles": [title(rng) for _ in range(pairs)]}
            tasks.append(asyncio.create_task(one(c, body)))
        await asyncio.gather(*tasks)
    return statuses, done


def niceness(srv: Server) -> list[int]:
    """The nice value of each of the server's model processes."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                if int(fields[2]) == srv.proc.pid and int(fields[1]) == srv.proc.pid:  # pgid, ppid
                    out.append(int(fields[16]))
            except (OSError, ValueError, IndexError):
                continue
    return sorted(out)


ADMIN_KEY = "bench-admin-key"  # the admin route is off without a key


async def reload(a) -> dict:
    os.environ["QTREL_ADMIN_KEYS"] = ADMIN_KEY  # the server inherits it
    srv = Server(
        f"a={a.model}", "--model", f"b={a.second}", "--reload", a.reload_mode, "--request-timeout-ms", "120000"
    )
    try:
        srv.wait_ready(300)
        swaps: list[dict] = []
        windows: list[tuple[float, float]] = []
        finished = False
        rss: list[tuple[float, int]] = []

        async def sampler() -> None:
            while not finished:
                rss.append((time.monotonic(), group_rss(srv)))
                await asyncio.sleep(0.5)

        async def swapper() -> None:
            nonlocal finished
            async with httpx.AsyncClient(timeout=300) as c:
                await asyncio.sleep(3)  # the load runs first
                for i in range(a.reloads):
                    name = "ab"[i % 2]
                    t0 = time.monotonic()
                    r = await c.post(
                        f"{srv.url}/admin/models/{name}/reload", headers={"Authorization": f"Bearer {ADMIN_KEY}"}
                    )
                    windows.append((t0, time.monotonic()))
                    body = r.json()
                    swaps.append({"model": name, "status": r.status_code, "seconds": round(time.monotonic() - t0, 2)})
                    if r.status_code == 200:
                        swaps[-1] |= {"generation": body["generation"], "mode": body["last_reload"]["mode"]}
                    await asyncio.sleep(1)
                await asyncio.sleep(2)
            finished = True

        (statuses, done), _, _ = await asyncio.gather(
            load(srv.url, a.clients, a.pairs, ["a", "b"], lambda: finished), swapper(), sampler()
        )
        before = [b for t, b in rss if t < windows[0][0]] if windows else []
        during = [s for t, s in done if any(lo <= t <= hi for lo, hi in windows)]
        outside = [s for t, s in done if not any(lo <= t <= hi for lo, hi in windows)]
        non_200 = sum(n for code, n in statuses.items() if code != 200)
        return {
            "scenario": "reload",
            "models": {"a": a.model, "b": a.second},
            "reload_mode": a.reload_mode,
            "clients": a.clients,
            "pairs_per_request": a.pairs,
            "reloads": len(swaps),
            "reloads_ok": sum(s["status"] == 200 for s in swaps),
            "swap_seconds": [s["seconds"] for s in swaps],
            "statuses": statuses,
            "non_200": non_200,
            "p50_ms_during_swaps": pct(during, 0.5),
            "p99_ms_during_swaps": pct(during, 0.99),
            "max_ms_during_swaps": pct(during, 1.0),
            "p50_ms_outside": pct(outside, 0.5),
            "p99_ms_outside": pct(outside, 0.99),
            "generations": {m["id"]: m["generation"] for m in httpx.get(srv.url + "/v1/models").json()["data"]},
            "rss_mb_before_swaps": round(max(before) / 2**20) if before else None,
            "rss_mb_peak": round(max(b for _, b in rss) / 2**20) if rss else None,
            "reload_failures_counted": srv.metric("qtrel_model_reloads_total") - sum(s["status"] == 200 for s in swaps),
        }
    finally:
        srv.stop()


async def shadow(a) -> dict:
    out: dict = {"scenario": "shadow", "seconds": a.seconds, "shadow_rate": a.shadow_rate, "pairs": a.pairs}
    out |= {"rate_per_s": a.rate} if a.rate else {"clients": a.clients}
    for run, extra in (
        ("without", ()),
        ("with", ("--shadow", f"cand={a.second}", "--shadow-rate", str(a.shadow_rate))),
    ):
        srv = Server(a.model, *extra)
        try:
            srv.wait_ready(300)
            if extra:
                deadline = time.monotonic() + 120
                while httpx.get(srv.url + "/info").json()["shadow"]["state"] != "ready" and time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
            end = time.monotonic() + a.seconds
            if a.rate:
                statuses, done = await open_load(srv.url, a.rate, a.seconds, a.pairs)
            else:
                statuses, done = await load(srv.url, a.clients, a.pairs, [None], lambda end=end: time.monotonic() > end)
            lat = [s for _, s in done]
            out[run] = {
                "statuses": statuses,
                "requests_per_s": round(len(lat) / a.seconds, 1),
                "p50_ms": pct(lat, 0.5),
                "p99_ms": pct(lat, 0.99),
            }
            if extra:
                await asyncio.sleep(2)
                shadowed = srv.metric("qtrel_shadow_pairs_total")
                out[run] |= {
                    "model_process_nice": niceness(srv),
                    "pairs_shadowed": shadowed,
                    "shadow_dropped": srv.metric("qtrel_shadow_dropped_total"),
                    "level_agreement": round(srv.metric("qtrel_shadow_agreed_total") / max(1, shadowed), 3),
                    "mean_abs_diff": round(srv.metric("qtrel_shadow_score_abs_diff_total") / max(1, shadowed), 3),
                }
        finally:
            srv.stop()
    return out
