"""`qtrel serve` as a real process: a checkpoint that cannot load ends it at once with a one-line reason;
SIGHUP under load ends nothing and drops no request; a storm of model-process kills fails no request."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.conftest import fronts_env, read_pairs
from tests.e2e.test_sigterm import start_server, wait_ready
from tests.service.conftest import free_port


def _processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line), read from /proc: `ps` cuts its lines to $COLUMNS (80 under some
    runners), which hid the fork server's name."""
    out: dict[int, tuple[int, str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            cmdline = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # exited meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # after "(comm)": state, then ppid
        out[int(d.name)] = (ppid, cmdline)
    return out


# a test that runs with the server's default layout and with two front processes (tests/conftest.py)
FRONTS = pytest.mark.parametrize("fronts", [None, 2], ids=["default", "2fronts"])


def fork_servers(server_pid: int, procs: dict[int, tuple[int, str]] | None = None) -> set[int]:
    """The server's fork server (the model processes' template), if it runs one."""
    procs = _processes() if procs is None else procs
    return {p for p, (pp, args) in procs.items() if pp == server_pid and "multiprocessing.forkserver" in args}


def model_pids(server_pid: int) -> list[int]:
    """The server's model processes: spawned by multiprocessing, or forked by its fork server (a child of
    the server: the model processes are its children)."""
    procs = _processes()
    servers = fork_servers(server_pid, procs)
    return [
        p for p, (pp, args) in procs.items() if (pp == server_pid and "multiprocessing.spawn" in args) or pp in servers
    ]


@pytest.mark.parametrize("broken", ["missing", "truncated"])
def test_a_checkpoint_that_cannot_load_ends_serve_with_its_reason(tiny_checkpoint, tmp_path, broken):
    if broken == "missing":
        model = tmp_path / "no" / "such" / "dir"
    else:
        model = tmp_path / "truncated"
        shutil.copytree(tiny_checkpoint, model)
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    t0 = time.monotonic()
    proc = start_server(model, free_port())
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out
    assert time.monotonic() - t0 < 60
    last = out.strip().splitlines()[-1]
    assert last.startswith("qtrel serve: ") and str(model.name) in out, out
    if broken == "truncated":
        assert "model failed to load" in last and "cannot read weights" in last, last


# one process only in the default suite (CI time): tests/e2e/test_fronts.py reloads on SIGHUP with two fronts, and
# QTREL_TEST_HTTP_WORKERS=2 runs this test with two
@pytest.mark.parametrize("fronts", [None], ids=["default"])
def test_sighup_under_load_drops_nothing_and_the_server_serves_on(tiny_checkpoint, tmp_path, fronts):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    extra = ("--max-batch-size", "2", "--request-timeout-ms", "120000")
    proc = start_server(tiny_checkpoint, port, *extra, log=tmp_path / "server.log", fronts=fronts)
    try:
        wait_ready(url, proc)
        titles = [t for _, t in read_pairs(10)]

        async def main():
            async with httpx.AsyncClient(timeout=60) as client:
                tasks = [
                    asyncio.create_task(client.post(url + "/score", json={"query": "drill", "titles": titles}))
                    for _ in range(20)
                ]
                await asyncio.sleep(0.3)
                for _ in range(3):
                    proc.send_signal(signal.SIGHUP)
                    await asyncio.sleep(0.1)
                return await asyncio.gather(*tasks, return_exceptions=True)

        results = asyncio.run(main())
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), results
        assert proc.poll() is None
        assert httpx.get(url + "/health/ready", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(90)


@FRONTS
def test_a_kill_storm_fails_no_request_and_the_server_recovers(tiny_checkpoint, tmp_path, fronts):
    """Two model processes; under 8 clients, SIGKILL a random live model process every 0.4 s for 8 s
    (so that some kills land on a replacement still loading or warming up), and once the fork server
    they are forked from. No request fails, and within seconds of the storm both processes
    serve again, the server is ready and live, and no killed fork server's model process lingers."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(
        tiny_checkpoint,
        port,
        "--replicas",
        "2",
        "--request-timeout-ms",
        "120000",
        "--drain-timeout-s",
        "5",
        log=tmp_path / "server.log",  # hundreds of request lines: a pipe would fill and stall the server
        fronts=fronts,
    )
    try:
        wait_ready(url, proc)
        titles = [t for _, t in read_pairs(6)]
        stop = time.monotonic() + 8

        async def client(c: httpx.AsyncClient) -> list[int]:
            codes = []
            while time.monotonic() < stop:
                r = await c.post(url + "/score", json={"query": "cordless drill", "titles": titles})
                codes.append(r.status_code)
            return codes

        first = fork_servers(proc.pid)
        assert first, "the model processes are forked from a fork server by default"

        async def storm() -> int:
            kills = 0
            rng = __import__("random").Random(7)
            while time.monotonic() < stop:
                pids = await asyncio.to_thread(model_pids, proc.pid)
                if kills == 8:  # once, late, their template: the next model process needs a new fork server
                    pids = sorted(await asyncio.to_thread(fork_servers, proc.pid) & first) or pids
                if pids:
                    try:
                        os.kill(rng.choice(pids), signal.SIGKILL)
                        kills += 1
                    except ProcessLookupError:
                        pass
                await asyncio.sleep(0.4)
            return kills

        async def main():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(storm(), *(client(c) for _ in range(8)))

        kills, *codes = asyncio.run(main())
        flat = [code for cs in codes for code in cs]
        assert kills >= 8 and flat and set(flat) == {200}, (kills, {c: flat.count(c) for c in set(flat)})
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            info = httpx.get(url + "/info", timeout=5).json()
            # both conditions: the storm's last kill may not be noticed yet when the states are read
            if info["worker"]["replica_states"] == ["ready", "ready"] and len(model_pids(proc.pid)) == 2:
                break
            time.sleep(0.2)
        assert info["worker"]["replica_states"] == ["ready", "ready"], info["worker"]
        assert kills > 8 and not fork_servers(proc.pid) & first  # the first fork server was killed
        assert len(model_pids(proc.pid)) == 2  # and none of its model processes lingers
        assert httpx.get(url + "/health/ready", timeout=5).status_code == 200
        assert httpx.get(url + "/health/live", timeout=5).status_code == 200
    finally:
        proc.terminate()
        proc.wait(90)


def test_sighup_rereads_the_key_file_at_once(tiny_checkpoint, tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("old-key-0123456789\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tiny_checkpoint, port, "--api-keys-file", str(keys), log=tmp_path / "server.log")
    try:
        wait_ready(url, proc)
        body = {"query": "drill", "titles": ["a cordless drill"]}

        def score(key):
            return httpx.post(url + "/score", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=30)

        assert score("old-key-0123456789").status_code == 200  # the file was just checked: not again for 1 s
        keys.write_text("new-key-9876543210\n")
        proc.send_signal(signal.SIGHUP)
        time.sleep(0.2)
        assert score("new-key-9876543210").status_code == 200
        assert score("old-key-0123456789").status_code == 401
        assert proc.poll() is None
    finally:
        proc.terminate()
        proc.wait(90)


@FRONTS
def test_the_http_process_never_loads_torch(tiny_checkpoint, tmp_path, fronts):
    """In process mode the model lives in the model processes: the server process plans the layout,
    tokenises and serves HTTP without torch (about 250 MB of RSS it does not need), and so do its fronts."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(tiny_checkpoint, port, "--device", "auto", log=tmp_path / "server.log", fronts=fronts)
    try:
        wait_ready(url, proc)
        assert httpx.post(url + "/score", json={"query": "drill", "titles": ["a drill"]}, timeout=30).status_code == 200
        front_pids = httpx.get(url + "/info", timeout=30).json()["fronts"].get("pids", [])
        assert fronts is None or len(front_pids) == fronts
        for pid in (proc.pid, *front_pids):
            assert "libtorch" not in open(f"/proc/{pid}/maps").read()
        assert any("libtorch" in open(f"/proc/{pid}/maps").read() for pid in model_pids(proc.pid))
    finally:
        proc.terminate()
        proc.wait(90)


def test_serve_from_a_directory_with_model_and_service_folders_of_its_own(tiny_checkpoint, tmp_path):
    """A user's working directory may hold Python packages named like qtrel's (an ML project's own `model`):
    the model processes must still import qtrel's, not those (the fork server starts as `python -c`, whose
    path begins with the working directory)."""
    qtrel = Path(sys.executable).with_name("qtrel")
    assert qtrel.exists(), "the package's console script (pip install -e .)"
    for name in ("model", "service"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f'raise SystemExit("the ./{name} folder was imported")\n')
    port = free_port()
    env = {**os.environ, **fronts_env(2), "QTREL_LOG_JSON": "true"}  # two fronts: each is a `python -m` too
    env.pop("PYTHONSAFEPATH", None)
    cmd = [str(qtrel), "serve", "--model", str(tiny_checkpoint), "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_ready(f"http://127.0.0.1:{port}", proc)
        r = httpx.post(f"http://127.0.0.1:{port}/score", json={"query": "drill", "titles": ["cordless drill"]})
        assert r.status_code == 200, r.text
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=60)
