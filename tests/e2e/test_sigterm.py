"""`qtrel serve` as a real process: SIGTERM under load drains without losing an accepted request."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import fronts_env, read_pairs
from tests.service.conftest import free_port


def start_server(model_dir, port, *extra, log=None, fronts: int | None = None):
    """`qtrel serve` as a child process. Its output goes to a pipe (read by `wait_ready` or the caller), or,
    for a long or chatty run, to the file `log`: a pipe nobody drains fills up and stalls the server.
    `fronts`: its HTTP front processes (else QTREL_TEST_HTTP_WORKERS, tests/conftest.py)."""
    env = {**os.environ, **fronts_env(fronts), "QTREL_LOG_JSON": "true"}
    cmd = [
        sys.executable,
        "-m",
        "service.cli",
        "serve",
        "--model",
        str(model_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra,
    ]
    out = open(log, "w") if log is not None else subprocess.PIPE  # noqa: SIM115 (the child holds it)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)


def wait_ready(url, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else "exited"
        try:
            if httpx.get(url + "/health/ready", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise AssertionError("server never became ready")


def in_flight(url) -> float:
    for line in httpx.get(url + "/metrics", timeout=2).text.splitlines():
        if line.startswith("qtrel_pairs_in_flight "):
            return float(line.split()[1])
    return 0.0


def test_sigterm_under_load_loses_no_accepted_request(tiny_checkpoint):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # One pair per forward pass, so that 300 queued pairs take a while to drain.
    proc = start_server(
        tiny_checkpoint, port, "--max-batch-size", "1", "--drain-timeout-s", "60", "--request-timeout-ms", "120000"
    )
    try:
        wait_ready(url, proc)
        titles = [t for _, t in read_pairs(10)]

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [
                    asyncio.create_task(client.post(url + "/score", json={"query": "drill", "titles": titles}))
                    for _ in range(30)
                ]
                for _ in range(100):  # wait until the work is admitted and queued
                    await asyncio.sleep(0.05)
                    if await asyncio.to_thread(in_flight, url) >= 150:
                        break
                proc.send_signal(signal.SIGTERM)
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        statuses = [r.status_code if isinstance(r, httpx.Response) else type(r).__name__ for r in results]
        assert statuses == [200] * 30, statuses
        for r in results:
            assert len(r.json()["results"]) == 10
        # uvicorn re-raises the captured SIGTERM after a clean shutdown, so -15 is the normal exit.
        assert proc.wait(timeout=60) in (0, -signal.SIGTERM)
        out = proc.stdout.read()
        assert "Application shutdown complete" in out
        # After the signal, new connections are refused: nothing is accepted and then dropped.
        try:
            httpx.get(url + "/health/ready", timeout=1)
            raise AssertionError("server still accepting after exit")
        except httpx.TransportError:
            pass
        assert '"level": "error"' not in out, out[-2000:]
    finally:
        if proc.poll() is None:
            proc.kill()


def model_pids(url) -> list[int]:
    return [int(p) for p in httpx.get(url + "/info", timeout=2).json()["worker"].get("pids", [])]


def gone(pid: int, timeout: float = 15) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


def test_model_processes_exit_with_the_server(tiny_checkpoint):
    """No orphans: the model processes end when the server ends, cleanly (SIGTERM) or not (SIGKILL:
    a model process sees its pipe close and exits)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(tiny_checkpoint, port, "--replicas", "2", "--threads", "1")
        try:
            wait_ready(url, proc)
            pids = model_pids(url)
            assert len(pids) == 2 and proc.pid not in pids
            proc.send_signal(sig)
            proc.wait(timeout=60)
            assert all(gone(p) for p in pids), (sig, pids)
        finally:
            if proc.poll() is None:
                proc.kill()
