"""The queue under load, on a live server with a real checkpoint slow enough to measure (4 layers, hidden 256,
one model process of one thread, the cache off): a client that hangs up frees the model process within
about max_batch_ms, low-priority work yields to high, and work whose queue ahead would take longer than
max_queue_wait_ms is refused with a Retry-After from the measured rate."""

from __future__ import annotations

import asyncio
import contextlib
import time

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.service.conftest import live_server, run

WORDS = "cordless drill battery hammer ladder paint faucet kitchen chrome tile saw cedar fence garden hose".split()


def long_titles(n: int, tag: str) -> list[str]:
    """`n` distinct titles of more than max_length tokens: each pair is a full 128-token row."""
    return [f"{tag} {i} " + " ".join(WORDS[(i + j) % len(WORDS)] for j in range(150)) for i in range(n)]


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(
        tmp_path_factory.mktemp("slow") / "slow-bert",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
    )
    options = dict(replicas=1, threads=1, cache_mb=0, max_batch_ms=50, max_queue_wait_ms=400, warmup=False)
    with live_server(ckpt, wait_ready=False, **options) as srv:
        deadline = time.monotonic() + 180  # a shared 2-vCPU host can take longer than live_server's minute
        while httpx.get(srv.url + "/health/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        # The pace is measured on saturated batches: 600 short pairs are 5 batches of 128 with work waiting.
        r = httpx.post(
            srv.url + "/score", json={"query": "drill", "titles": [f"drill {i}" for i in range(600)]}, timeout=120
        )
        assert r.status_code == 200, r.text
        yield srv


def test_an_abandoned_big_request_stops_occupying_the_model_process(slow_server):
    url = slow_server.url + "/score"

    async def main() -> tuple[float, float]:
        async with httpx.AsyncClient(timeout=60) as c:
            t0 = time.perf_counter()
            r = await c.post(url, json={"query": "drill", "titles": long_titles(64, "alone")})  # max_batch_tokens
            big = time.perf_counter() - t0
            assert r.status_code == 200, r.text
            async with httpx.AsyncClient(timeout=60) as gone:  # 400 such pairs, and the client hangs up ...
                body = {"query": "drill", "titles": long_titles(400, "gone")}
                task = asyncio.create_task(gone.post(url, json=body))
                deadline = time.monotonic() + 60
                while not await asyncio.to_thread(slow_server.metric, "qtrel_queue_depth"):  # ... once they queue
                    assert time.monotonic() < deadline and not task.done(), "the big request never queued"
                    await asyncio.sleep(0.02)
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            t0 = time.perf_counter()
            r = await c.post(url, json={"query": "drill", "titles": ["cordless drill"]})
            assert r.status_code == 200, r.text
            return big, time.perf_counter() - t0

    big, small = run(main())
    assert big > 0.4, f"the checkpoint is too fast for this test to mean anything: {big:.3f}s"
    # Without batches bounded in time the gone client's first batch (64 pairs, as big) runs to its end first.
    assert small < big / 4, (big, small)
    deadline = time.monotonic() + 10
    while slow_server.metric("qtrel_pairs_in_flight"):
        assert time.monotonic() < deadline, "the gone client's pairs stayed in flight"
        time.sleep(0.1)
    assert slow_server.metric("qtrel_dropped_pairs_total", reason="cancelled") > 300


def test_low_priority_work_yields_to_high_priority_work_that_came_later(slow_server):
    url = slow_server.url + "/score"

    async def timed(c: httpx.AsyncClient, body: dict) -> tuple[float, int]:
        r = await c.post(url, json=body)
        return time.perf_counter(), r.status_code

    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            low = asyncio.create_task(timed(c, {"query": "drill", "titles": long_titles(48, "low"), "priority": "low"}))
            await asyncio.sleep(0.2)  # the low request's first batch is on the model
            assert slow_server.metric("qtrel_queue_depth_by_priority", priority="low") > 0
            high = await timed(c, {"query": "drill", "titles": long_titles(48, "high"), "priority": 0})
            return await low, high

    (low_done, low_status), (high_done, high_status) = run(main())
    assert low_status == high_status == 200
    assert high_done < low_done  # of two equal requests, the low one that came first finishes last


def test_the_priority_field_takes_high_low_or_an_integer(slow_server):
    url = slow_server.url + "/score"
    for priority, status in (("high", 200), ("low", 200), (3, 200), (-1, 200), ("urgent", 422), (1.5, 422)):
        r = httpx.post(url, json={"query": "q", "titles": ["t"], "priority": priority}, timeout=60)
        assert r.status_code == status, (priority, r.text)
    r = httpx.post(slow_server.url + "/rerank", json={"query": "q", "texts": ["t"], "priority": "low"}, timeout=60)
    assert r.status_code == 200, r.text


def test_work_whose_queue_ahead_would_take_too_long_is_refused_with_retry_after(slow_server):
    url = slow_server.url + "/score"

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=60) as c:  # six requests of ~1 s of work each, at once
            bodies = [{"query": "drill", "titles": long_titles(64, f"wait{k}")} for k in range(6)]
            return await asyncio.gather(*(c.post(url, json=b) for b in bodies))

    before = slow_server.metric("qtrel_admission_refused_total", reason="wait")
    rs = run(main())
    codes = [r.status_code for r in rs]
    assert 200 in codes and 429 in codes, codes
    refused = next(r for r in rs if r.status_code == 429)
    assert refused.json()["error_type"] == "overloaded"
    assert int(refused.headers["retry-after"]) >= 1
    assert slow_server.metric("qtrel_admission_refused_total", reason="wait") > before
