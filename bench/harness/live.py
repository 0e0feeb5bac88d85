"""A real `qtrel serve` process on loopback for the stress scenarios (bench/stress.py, bench/storm.py):
start it, wait for readiness, read its metrics, find what survives it, stop it."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
WORDS = (
    "cordless drill dewalt 20v battery kit hammer screwdriver bosch makita brushless impact driver "
    "ladder paint white interior gallon faucet kitchen chrome pull-down tile saw wet cutter outdoor "
    "light led solar path fence post cedar garden hose reel"
).split()


def free_port() -> int:
    """A free port: any, or the first free one of QTREL_BENCH_PORTS (e.g. 18200-18299) where a shared host
    gives each user a range."""
    lo, _, hi = os.environ.get("QTREL_BENCH_PORTS", "0-0").partition("-")
    for port in range(int(lo), int(hi or lo) + 1):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise SystemExit(f"no free port in QTREL_BENCH_PORTS={os.environ['QTREL_BENCH_PORTS']}")


def title(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 14)))


class Server:
    def __init__(self, model: str, *extra: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "service.cli",
            "serve",
            "--model",
            model,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--log-level",
            "warning",
            *extra,
        ]
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )  # its own process group: survivors are findable

    def wait_ready(self, timeout: float = 120) -> float:
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise SystemExit(f"server exited with {self.proc.returncode}")
            try:
                if httpx.get(self.url + "/health/ready", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise SystemExit("server never became ready")

    def metric(self, name: str) -> float:
        total = 0.0
        for line in httpx.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def survivors(self) -> int:
        """Processes of the server's group still alive (model processes, multiprocessing helpers)."""
        n = 0
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":  # pgid, state
                    n += 1
        return n

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)


async def post_all(
    url: str, bodies: list[bytes], clients: int, timeout: float = 300
) -> tuple[list, list[float], float]:
    """POST every JSON body to `url` from `clients` closed-loop aiohttp clients (each takes the next body):
    (per body its parsed answer, None where not 200; latencies in seconds; wall seconds)."""
    import asyncio
    import json

    import aiohttp

    answers: list = [None] * len(bodies)
    latencies: list[float] = []
    next_i = 0

    async def client(session: aiohttp.ClientSession) -> None:
        nonlocal next_i
        while next_i < len(bodies):
            i, next_i = next_i, next_i + 1
            t0 = time.perf_counter()
            async with session.post(url, data=bodies[i], headers={"content-type": "application/json"}) as r:
                raw = await r.read()
            latencies.append(time.perf_counter() - t0)
            if r.status == 200:
                answers[i] = json.loads(raw)

    conn = aiohttp.TCPConnector(limit=clients)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=timeout)) as session:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(session) for _ in range(clients)))
        wall = time.perf_counter() - t0
    return answers, latencies, wall


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return round(xs[min(len(xs) - 1, int(q * len(xs)))] * 1000, 1)


def statuses(srv: Server, by_route: bool = False) -> dict[str, float]:
    """Requests by status (or 5xx by route and status) from the server's own counter."""
    out: dict[str, float] = {}
    for line in httpx.get(srv.url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("qtrel_requests_total{") and 'route="/metrics"' not in line:
            status = line.split('status="', 1)[1].split('"', 1)[0]
            route = line.split('route="', 1)[1].split('"', 1)[0]
            if by_route and not status.startswith("5"):
                continue
            key = f"{route} {status}" if by_route else status
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out
