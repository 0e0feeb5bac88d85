"""Slow clients on a real uvicorn server: connections that send a body a byte at a time do not hold up
ordinary requests, and those whose client hangs up leave nothing queued (docs/reliability.md)."""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager

import httpx
import pytest

from tests.e2e.test_sigterm import start_server, wait_ready
from tests.service.conftest import free_port, live_server


class Served:
    """`qtrel serve` as a process, with the in-process server's url and metric()."""

    def __init__(self, url: str):
        self.url = url

    def metric(self, name: str) -> float:
        lines = httpx.get(self.url + "/metrics", timeout=30).text.splitlines()
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith((name + " ", name + "{")))


@contextmanager
def server(model_dir, fronts: int | None, log):
    if fronts is None:  # in process: the one-process layout
        with live_server(model_dir, max_wait_ms=5, replicas=1) as srv:
            yield srv
        return
    port = free_port()
    proc = start_server(model_dir, port, "--max-wait-ms", "5", "--replicas", "1", log=log, fronts=fronts)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc, timeout=120)
        yield Served(f"http://127.0.0.1:{port}")
    finally:
        proc.terminate()
        proc.wait(90)


async def _slow_body(port: int, writers: list) -> None:
    _, w = await asyncio.open_connection("127.0.0.1", port)
    writers.append(w)
    w.write(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{")
    await w.drain()


@pytest.mark.parametrize("fronts", [None, 2], ids=["default", "2fronts"])
def test_slow_bodies_do_not_hold_up_others_and_vanished_work_leaves_the_queue(tiny_checkpoint, tmp_path, fronts):
    with server(tiny_checkpoint, fronts, tmp_path / "server.log") as srv:
        port = int(srv.url.rsplit(":", 1)[1])

        async def main():
            writers: list = []
            await asyncio.gather(*(_slow_body(port, writers) for _ in range(100)))
            async with httpx.AsyncClient(timeout=10) as c:
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    r = await c.post(srv.url + "/score", json={"query": "drill", "titles": ["cordless drill"]})
                    assert r.status_code == 200, r.text
                    times.append(time.perf_counter() - t0)
                # clients that hang up 20 ms into a 500-pair request
                for _ in range(5):
                    async with httpx.AsyncClient(timeout=0.02) as gone:
                        try:
                            await gone.post(
                                srv.url + "/score",
                                json={"query": "drill", "titles": [f"drill {i}" for i in range(500)]},
                            )
                        except httpx.TimeoutException:
                            pass
            for w in writers:
                w.close()
            return times

        times = asyncio.run(main())
        assert max(times) < 2.0, times  # 100 half-sent bodies cost an ordinary request nothing measurable
        deadline = time.monotonic() + 10
        while srv.metric("qtrel_pairs_in_flight") or srv.metric("qtrel_queue_depth"):
            assert time.monotonic() < deadline, "work of vanished clients stayed queued"
            time.sleep(0.1)
