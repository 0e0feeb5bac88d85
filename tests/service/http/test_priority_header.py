"""`X-Priority` beside the body's `priority` on every scoring route (service.http.priority): the header sets
the class where the body gives none, the body wins where it does, and a header that says neither high, low
nor an integer is a 422. On a live server with a checkpoint slow enough that a queued request can be seen in
qtrel_queue_depth_by_priority."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.conftest import make_tiny_checkpoint
from tests.service.conftest import live_server, run
from tests.service.http.test_queue_classes import long_titles


@pytest.fixture(scope="module")
def slow_server(tmp_path_factory):
    ckpt = make_tiny_checkpoint(
        tmp_path_factory.mktemp("slow") / "slow-bert",
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
    )
    options = dict(replicas=1, threads=1, cache_mb=0, max_batch_ms=50, warmup=False)
    with live_server(ckpt, wait_ready=False, **options) as srv:
        deadline = time.monotonic() + 180
        while httpx.get(srv.url + "/health/ready", timeout=10).status_code != 200:
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.1)
        yield srv


def queued_class(server, body: dict, headers: dict) -> tuple[float, float]:
    """The most pairs seen queued as low and as high while a request of 96 long pairs runs."""

    async def main() -> tuple[float, float]:
        async with httpx.AsyncClient(timeout=120) as c:
            task = asyncio.create_task(c.post(server.url + "/score", json=body, headers=headers))
            low = high = 0.0
            while not task.done():
                low = max(low, await asyncio.to_thread(server.metric, "qtrel_queue_depth_by_priority", priority="low"))
                high = max(
                    high, await asyncio.to_thread(server.metric, "qtrel_queue_depth_by_priority", priority="high")
                )
                await asyncio.sleep(0.02)
            assert (await task).status_code == 200
            return low, high

    return run(main())


def test_the_header_sets_the_class_and_the_body_wins(slow_server):
    titles = long_titles(96, "hdr")
    low, high = queued_class(slow_server, {"query": "drill", "titles": titles}, {"X-Priority": "low"})
    assert low > 0 and high == 0, (low, high)
    low, high = queued_class(slow_server, {"query": "drill", "titles": titles}, {"X-Priority": "5"})
    assert low > 0 and high == 0, (low, high)
    body = {"query": "drill", "titles": long_titles(96, "body"), "priority": "high"}
    low, high = queued_class(slow_server, body, {"X-Priority": "low"})
    assert high > 0 and low == 0, (low, high)
    low, high = queued_class(slow_server, {"query": "drill", "titles": long_titles(96, "none")}, {})
    assert high > 0 and low == 0, (low, high)


def test_every_scoring_route_takes_it_and_refuses_a_bad_one(slow_server):
    bodies = {
        "/score": {"query": "q", "titles": ["t"]},
        "/predict": {"inputs": [["q", "t"]]},
        "/rerank": {"query": "q", "texts": ["t"]},
        "/v1/rerank": {"query": "q", "documents": ["t"]},
        "/v2/rerank": {"query": "q", "documents": ["t"], "model": "slow-bert"},
    }
    schema = httpx.get(slow_server.url + "/openapi.json").json()
    for route, body in bodies.items():
        for value in ("low", "HIGH", "-3", "7"):
            r = httpx.post(slow_server.url + route, json=body, headers={"X-Priority": value}, timeout=60)
            assert r.status_code == 200, (route, value, r.text)
        for value in ("urgent", "1.5", ""):
            r = httpx.post(slow_server.url + route, json=body, headers={"X-Priority": value}, timeout=60)
            assert r.status_code == 422 and "X-Priority" in r.json()["error"], (route, value, r.text)
        twice = [("X-Priority", "low"), ("X-Priority", "high")]
        assert httpx.post(slow_server.url + route, json=body, headers=twice, timeout=60).status_code == 422
        names = [p["name"] for p in schema["paths"][route]["post"].get("parameters", [])]
        assert "X-Priority" in names, (route, names)
