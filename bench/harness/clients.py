"""Load clients for a server on loopback: closed-loop clients and an open-loop Poisson schedule, driven from
this process's own event loop, and one scenario's summary (throughput, latency quantiles, errors, CPU, and
the server's batch metrics over the window)."""

from __future__ import annotations

import asyncio
import random
import statistics
import sys
import time
from itertools import cycle
from typing import Any

from harness.data import Body
from harness.server import cpu_seconds, metrics_of


class Http:
    """aiohttp when installed (lighter on the CPU the server also needs), else httpx."""

    def __init__(self, connections: int):
        self.connections = connections
        self.s: Any = None  # aiohttp.ClientSession or httpx.AsyncClient, opened on entry
        try:
            import aiohttp  # noqa: F401

            self.kind = "aiohttp"
        except ImportError:
            self.kind = "httpx"
            print(
                "warning: aiohttp not installed, using httpx, which takes about a core at 64 clients and becomes the"
                " bottleneck on 2 cores (pip install -e '.[bench]')",
                file=sys.stderr,
            )

    async def __aenter__(self) -> Http:
        if self.kind == "aiohttp":
            import aiohttp

            self.s = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.connections), timeout=aiohttp.ClientTimeout(total=120)
            )
        else:
            import httpx

            limits = httpx.Limits(max_connections=self.connections, max_keepalive_connections=self.connections)
            self.s = httpx.AsyncClient(limits=limits, timeout=120)
        return self

    async def __aexit__(self, *exc) -> None:
        await (self.s.close() if self.kind == "aiohttp" else self.s.aclose())

    async def post(self, url: str, body: bytes) -> int:
        headers = {"content-type": "application/json"}
        if self.kind == "aiohttp":
            async with self.s.post(url, data=body, headers=headers) as r:
                await r.read()
                return r.status
        return (await self.s.post(url, content=body, headers=headers)).status_code

    async def get_text(self, url: str) -> str:
        if self.kind == "aiohttp":
            async with self.s.get(url) as r:
                return await r.text()
        return (await self.s.get(url)).text


async def send(http: Http, url: str, body: Body, t_ref: float, records: list) -> None:
    """One request; records (reference time, end, pairs, status). The open loop's reference time is the
    scheduled arrival, so time spent waiting on the client side counts as latency."""
    status: int | str
    try:
        status = await http.post(url, body[0])
    except Exception as e:  # a failed request is a result, not a crash of the run
        status = type(e).__name__
    records.append((t_ref, time.perf_counter(), body[1], status))


async def closed_loop(http: Http, url: str, bodies: list[Body], clients: int, end: float) -> list:
    records: list = []
    it = cycle(bodies)

    async def client() -> None:
        while (now := time.perf_counter()) < end:
            await send(http, url, next(it), now, records)

    await asyncio.gather(*(client() for _ in range(clients)))
    return records


async def open_loop(http: Http, url: str, bodies: list[Body], rate: float, end: float, cap: int) -> list:
    """Poisson arrivals at `rate` requests/s until `end`; at most `cap` in flight (beyond: counted, not sent)."""
    records: list = []
    rng, it = random.Random(0), cycle(bodies)
    tasks: set[asyncio.Task[None]] = set()
    t = time.perf_counter()
    while (t := t + rng.expovariate(rate)) < end:
        await asyncio.sleep(max(0.0, t - time.perf_counter()))
        if len(tasks) >= cap:
            records.append((t, t, 1, "client cap"))
            continue
        task = asyncio.create_task(send(http, url, next(it), t, records))
        tasks.add(task)
        task.add_done_callback(tasks.discard)
    await asyncio.gather(*tasks)
    return records


async def scenario(
    name: str,
    base: str,
    bodies: list[Body],
    a,
    server_pid: int | None,
    *,
    clients: int = 0,
    rate: float = 0.0,
    metrics: bool = True,
    path: str = "/score",
) -> dict:
    """Run one scenario: closed loop with `clients`, or open loop at `rate`; summarise its window."""
    async with Http(clients or 512) as http, Http(1) as control:  # scrapes never wait behind the load
        t0 = time.perf_counter()
        start, end = t0 + a.warmup, t0 + a.warmup + a.seconds
        run = (
            closed_loop(http, base + path, bodies, clients, end)
            if clients
            else open_loop(http, base + path, bodies, rate, end, 512)
        )
        task = asyncio.ensure_future(run)
        await asyncio.sleep(a.warmup)
        cpu0 = (time.process_time(), cpu_seconds(server_pid) if server_pid else 0.0)
        before = metrics_of(await control.get_text(base + "/metrics")) if metrics else {}
        records = await task
        wall = time.perf_counter() - start
        cpu = (time.process_time() - cpu0[0], (cpu_seconds(server_pid) - cpu0[1]) if server_pid else None)
        after = metrics_of(await control.get_text(base + "/metrics")) if metrics else {}
    done = [r for r in records if r[3] == 200 and start <= r[1] <= end]
    lat = sorted(1000 * (r[1] - r[0]) for r in records if r[3] == 200 and start <= r[0] < end)
    errors: dict[str, int] = {}
    for r in records:
        if r[3] != 200 and start <= r[0] < end:
            errors[str(r[3])] = errors.get(str(r[3]), 0) + 1
    q = statistics.quantiles(lat, n=100, method="inclusive") if len(lat) > 1 else [float("nan")] * 99
    out = {
        "name": name,
        "clients": clients or None,
        "target_rate": rate or None,
        "pairs_per_s": sum(r[2] for r in done) / a.seconds,
        "requests_per_s": len(done) / a.seconds,
        "requests": len(lat),
        "p50_ms": q[49],
        "p95_ms": q[94],
        "p99_ms": q[98],
        "errors": errors,
        "client_cpu_s": cpu[0],
        "server_cpu_s": cpu[1],
        "client_cores": cpu[0] / wall,
        "server_cores": None if cpu[1] is None else cpu[1] / wall,
    }
    if metrics:
        d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        n = d.get("qtrel_batch_pairs_count", 0.0)
        out["mean_padding"] = d.get("qtrel_batch_padding_ratio_sum", 0.0) / n if n else None
        out["mean_batch_pairs"] = d.get("qtrel_batch_pairs_sum", 0.0) / n if n else None
    print(
        f"{name}: {out['pairs_per_s']:.0f} pairs/s, p50 {out['p50_ms']:.0f} ms, p99 {out['p99_ms']:.0f} ms, "
        f"errors {errors or 0}"
    )
    return out
