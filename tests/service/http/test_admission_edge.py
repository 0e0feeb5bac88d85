"""Under overload a scoring request is refused at the edge, before its body is read or parsed: the 429
costs microseconds, and the cores stay with the work already admitted."""

from __future__ import annotations

import asyncio

import httpx

from tests.service.conftest import live_server, run


def test_a_full_queue_refuses_before_reading_the_body(tiny_checkpoint):
    # A batch waits up to 1.5 s to fill, so 4 admitted pairs hold the queue (max_queue_pairs=4) full.
    with live_server(
        tiny_checkpoint, max_queue_pairs=4, max_pairs_per_request=4, max_wait_ms=1500, max_batch_size=64
    ) as srv:

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                held = asyncio.create_task(
                    client.post(srv.url + "/score", json={"query": "q", "titles": ["t1", "t2", "t3", "t4"]})
                )
                await asyncio.sleep(0.5)
                # Not JSON at all: parsed, it would be a 400. Refused at the edge, it is a 429.
                refused = await client.post(
                    srv.url + "/v1/rerank", content=b"{not json", headers={"content-type": "application/json"}
                )
                health = await client.get(srv.url + "/health/ready")  # other routes are not refused
                return await held, refused, health

        held, refused, health = run(main())
        assert held.status_code == 200
        assert refused.status_code == 429 and refused.json()["error_type"] == "overloaded"
        assert int(refused.headers["retry-after"]) >= 1
        assert health.status_code == 200
        assert srv.metric("qtrel_rejected_total", reason="overloaded") == 1
        assert httpx.post(srv.url + "/score", json={"query": "q", "titles": ["t"]}).status_code == 200
