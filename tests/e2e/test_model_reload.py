"""`qtrel serve --model a=... --model b=...` as a real process: each model its own model processes; SIGHUP
reloads every model in new processes beside the old ones, the old ones exit, and the generation moves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx

from tests.conftest import fronts_env, make_tiny_checkpoint
from tests.e2e.test_sigterm import wait_ready
from tests.e2e.test_start_and_signals import model_pids
from tests.service.conftest import free_port


def generations(url: str) -> dict[str, int]:
    return {m["id"]: m["generation"] for m in httpx.get(url + "/v1/models", timeout=5).json()["data"]}


def test_sighup_reloads_every_model_in_new_processes(tiny_checkpoint, tmp_path):
    second = make_tiny_checkpoint(tmp_path / "second", seed=1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", f"a={tiny_checkpoint}", "--model", f"b={second}"]
    # torch pinned: a reload probes `auto` again, and the other engine's scores differ in the last bits
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--no-warmup", "--inference", "torch"]
    with open(tmp_path / "server.log", "w") as log:
        env = {**os.environ, **fronts_env(), "QTREL_LOG_JSON": "true"}
        proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_ready(url, proc, timeout=120)
        assert generations(url) == {"a": 1, "b": 1}
        before = set(model_pids(proc.pid))
        assert len(before) == 2  # one model process each (2 cores shared by 2 models, or more)
        body = {"query": "drill", "titles": ["cordless drill", "hose"]}
        scored = {m: httpx.post(url + "/score", json=body | {"model": m}).json()["results"] for m in ("a", "b")}
        assert scored["a"] != scored["b"]
        proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 120
        while generations(url) != {"a": 2, "b": 2}:
            assert time.monotonic() < deadline, generations(url)
            assert httpx.post(url + "/score", json=body | {"model": "b"}).status_code == 200
            time.sleep(0.2)
        while set(model_pids(proc.pid)) & before:  # the old processes drain and exit
            assert time.monotonic() < deadline
            time.sleep(0.2)
        assert len(model_pids(proc.pid)) == 2 and proc.poll() is None
        assert httpx.post(url + "/score", json=body | {"model": "a"}).json()["results"] == scored["a"]
    finally:
        proc.terminate()
        proc.wait(90)
