"""What the stress scenarios' clients saw (bench/storm.py): every answered request, and its summary."""

from __future__ import annotations

import time

import aiohttp

from harness.live import pct


class Log:
    """Every answered request: when it ended, its status, its latency, its pairs."""

    def __init__(self) -> None:
        self.rows: list[tuple[float, int | str, float, int]] = []

    def add(self, status: int | str, latency: float, pairs: int) -> None:
        self.rows.append((time.monotonic(), status, latency, pairs))

    def window(self, t0: float, t1: float) -> list[tuple[float, int | str, float, int]]:
        return [r for r in self.rows if t0 <= r[0] < t1]


def summary(rows, seconds: float) -> dict:
    st: dict[str, int] = {}
    for r in rows:
        st[str(r[1])] = st.get(str(r[1]), 0) + 1
    ok = [r for r in rows if r[1] == 200]
    return {
        "requests": len(rows),
        "statuses": st,
        "pairs_per_s": round(sum(r[3] for r in ok) / seconds, 1) if seconds > 0 else None,
        "p50_ms": pct([r[2] for r in ok], 0.5),
        "p99_ms": pct([r[2] for r in ok], 0.99),
    }


async def post(s: aiohttp.ClientSession, url: str, body, log: Log, pairs: int, timeout: float = 120) -> None:
    t0 = time.perf_counter()
    try:
        async with s.post(url, json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
            await r.read()
            log.add(r.status, time.perf_counter() - t0, pairs)
    except (TimeoutError, aiohttp.ClientError) as e:
        log.add(type(e).__name__, time.perf_counter() - t0, pairs)
