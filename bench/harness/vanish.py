"""Vanishing clients for bench/stress.py's `slow` scenario: requests abandoned a moment after they are sent.
Run in a process of their own (`python bench/storm.py vanish URL CLIENTS SECONDS`), so that their CPU is not
the measured clients'."""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp

from harness.live import title


async def vanish(url: str, clients: int, seconds: float, titles: int = 200, after_s: float = 0.05) -> int:
    """`clients` loops that send a `titles`-title request and hang up `after_s` later, again and again;
    the number of requests abandoned. Bodies are built once, so this process costs little CPU."""
    rng = random.Random(5)
    bodies = [json.dumps({"query": title(rng), "titles": [title(rng) for _ in range(titles)]}) for _ in range(16)]
    stop = time.monotonic() + seconds
    abandoned = 0

    async def one(s: aiohttp.ClientSession) -> None:
        nonlocal abandoned
        while time.monotonic() < stop:
            try:
                async with s.post(
                    url + "/score",
                    data=rng.choice(bodies),
                    headers={"content-type": "application/json"},
                    timeout=aiohttp.ClientTimeout(total=after_s),
                ) as r:
                    await r.read()
            except (TimeoutError, aiohttp.ClientError):
                abandoned += 1
            await asyncio.sleep(after_s)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as s:
        await asyncio.gather(*(one(s) for _ in range(clients)))
    return abandoned
