"""Goodput under overload, with a profile of where the CPU went (run through bench/stress.py):

  python bench/stress.py goodput --clients 4 --queue-pairs 8192 --seconds 20 --open-loop [--http-workers 2]

Capacity first: `--clients` closed-loop clients of 50-title requests, enough to keep the model busy and few
enough that nothing is refused. Then 4x: as many clients again times four, each retrying 50 ms after a 429
(harsher than following Retry-After), or with `--open-loop` 4x capacity's requests a second whatever the
answers take. Reported: the pairs served within the window against capacity, the accepted requests' p99,
what a 429 cost, and per phase a profile: the batches the server formed (its `qtrel_batch_*` and
`qtrel_inference_seconds` series: count, pairs each, forward ms each) and the CPU milliseconds per served pair
of the fronts, the engine core, the model processes and this load generator. On a 2-vCPU host every process
shares the same two cores, so a phase whose processes spend more CPU per served pair serves fewer pairs:
the profile says whose.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path

import aiohttp
from harness.live import Server, pct, title
from harness.loadlog import Log, summary
from harness.server import own_cpu_seconds, tree

OPEN_CAP = 512  # requests in flight at most in an open loop, as load.py's
BATCH_SERIES = ("qtrel_batch_pairs_count", "qtrel_batch_pairs_sum", "qtrel_inference_seconds_sum")


def cpu_by_role(root: int) -> dict[str, float]:
    """CPU seconds of the server's processes so far, by role: the engine core (the process started; in the
    one-process layout also HTTP), its fronts, and the model processes with their fork server."""
    out = {"core": 0.0, "fronts": 0.0, "models": 0.0}
    for pid, _ in tree(root):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        role = "core" if pid == root else "fronts" if b"service.front" in cmd else "models"
        out[role] += own_cpu_seconds(pid)
    return out


def snapshot(srv: Server) -> dict:
    return {
        "cpu": cpu_by_role(srv.proc.pid),
        "client": time.process_time(),
        **{s: srv.metric(s) for s in BATCH_SERIES},
    }


def profile(before: dict, after: dict, served_pairs: int) -> dict:
    """What one phase cost: its batches, and CPU ms per served pair by role."""
    batches = after["qtrel_batch_pairs_count"] - before["qtrel_batch_pairs_count"]
    pairs = after["qtrel_batch_pairs_sum"] - before["qtrel_batch_pairs_sum"]
    forward = after["qtrel_inference_seconds_sum"] - before["qtrel_inference_seconds_sum"]
    per = 1e3 / max(1, served_pairs)
    cpu = {f"{k}_cpu_ms_per_pair": round(per * (after["cpu"][k] - before["cpu"][k]), 3) for k in after["cpu"]}
    return {
        "batches": int(batches),
        "pairs_per_batch": round(pairs / max(1, batches), 1),
        "forward_ms_per_batch": round(1e3 * forward / max(1, batches), 1),
        **cpu,
        "client_cpu_ms_per_pair": round(per * (after["client"] - before["client"]), 3),
    }


async def goodput(a) -> dict:
    # The cache off and distinct titles in every request: goodput is the model's, not the cache's or single
    # flight's (a resent body in flight twice is computed once).
    srv = Server(
        a.model,
        "--max-queue-pairs",
        str(a.queue_pairs),
        "--max-pairs-per-request",
        "50",
        "--cache-mb",
        "0",
        *a.server_args.split(),
    )
    try:
        srv.wait_ready()
        rng = random.Random(6)

        def fresh() -> str:
            return json.dumps({"query": title(rng), "titles": [title(rng) for _ in range(50)]})

        async def one(s: aiohttp.ClientSession, log: Log, refused: list[float]) -> None:
            t0 = time.perf_counter()
            try:
                async with s.post(srv.url + "/score", data=fresh(), headers={"content-type": "application/json"}) as r:
                    await r.read()
                status: int | str = r.status
            except (TimeoutError, aiohttp.ClientError) as e:
                status = type(e).__name__
            dt = time.perf_counter() - t0
            log.add(status, dt, 50)
            if status == 429:
                refused.append(dt)

        async def phase(clients: int, seconds: float) -> tuple[dict, list[float]]:
            log, refused = Log(), list[float]()
            stop = time.monotonic() + seconds

            async def client(s: aiohttp.ClientSession) -> None:
                while time.monotonic() < stop:
                    n = len(refused)
                    await one(s, log, refused)
                    if len(refused) > n:
                        await asyncio.sleep(0.05)

            before = await asyncio.to_thread(snapshot, srv)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                await asyncio.gather(*(client(s) for _ in range(clients)))
            out = summary(log.rows, seconds)
            after = await asyncio.to_thread(snapshot, srv)
            served = sum(r[3] for r in log.rows if r[1] == 200)
            return {**out, "profile": profile(before, after, served)}, refused

        async def open_loop(rate: float, seconds: float) -> tuple[dict, list[float]]:
            """Requests sent at `rate` a second whatever the answers take (at most OPEN_CAP in flight)."""
            log, refused = Log(), list[float]()
            tasks: set[asyncio.Task] = set()
            before = await asyncio.to_thread(snapshot, srv)
            async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
                t0 = time.monotonic()
                n = 0
                while (now := time.monotonic()) < t0 + seconds:
                    if len(tasks) < OPEN_CAP:
                        task = asyncio.create_task(one(s, log, refused))
                        tasks.add(task)
                        task.add_done_callback(tasks.discard)
                    n += 1
                    await asyncio.sleep(max(0.0, t0 + n / rate - now))
                await asyncio.gather(*tasks)
            after = await asyncio.to_thread(snapshot, srv)
            # goodput: the pairs answered within the window; latencies: every request's, the late ones' too
            within = summary(log.window(t0, t0 + seconds), seconds)
            every = summary(log.rows, seconds)
            served = sum(r[3] for r in log.rows if r[1] == 200)
            return {
                **every,
                "pairs_per_s": within["pairs_per_s"],
                "answered_after_window": len(log.rows) - len(log.window(t0, t0 + seconds)),
                "profile": profile(before, after, served),
            }, refused

        await phase(a.clients, 3)  # warm
        cap, _ = await phase(a.clients, a.seconds)
        if a.open_loop:  # 4x capacity's requests a second, each sent whatever the answers take
            rate = 4 * (cap["pairs_per_s"] or 1.0) / 50
            over, refused = await open_loop(rate, a.seconds)
            over = {"requests_per_s": round(rate, 2), **over}
        else:
            over, refused = await phase(4 * a.clients, a.seconds)
            over = {"clients": 4 * a.clients, **over}
        return {
            "scenario": "goodput",
            "seconds": a.seconds,
            "max_queue_pairs": a.queue_pairs,
            "open_loop": a.open_loop,
            "extra_server_args": a.server_args,
            "capacity": {"clients": a.clients, **cap},
            "overload_4x": over,
            "goodput_share_of_capacity": round(over["pairs_per_s"] / cap["pairs_per_s"], 3),
            "refusal_p50_ms": pct(refused, 0.5),
            "refusal_p99_ms": pct(refused, 0.99),
            "folded_pairs": srv.metric("qtrel_duplicates_folded_total"),  # ~0: every pair distinct
        }
    finally:
        srv.stop()
