"""Score jobs' own model processes (service.runtime.background) through the real app on the tiny checkpoint:
they run at the OS's idle priority, only while a job runs, a killed one is replaced and the job completes, and
the output stays byte for byte `qtrel score`'s; `job_processes=shared` is the live processes as before."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from service.runtime.workers.priority import SCHED_IDLE, policy_of
from tests.service.conftest import live_server
from tests.service.http.test_jobs import make_pairs, qtrel_score, wait_finished, write_input

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def submit(c: httpx.Client, src, chunk_rows: int = 250) -> str:
    r = c.post("/v1/jobs", content=src.read_bytes(), params={"filename": src.name, "chunk_rows": str(chunk_rows)})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def job_pids(c: httpx.Client, timeout: float = 60) -> list[int]:
    """The job processes' pids once they are up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        described = c.get("/info").json()["job_processes"]
        if described["running"] and described["pids"]:
            return described["pids"]
        time.sleep(0.02)
    raise AssertionError(f"no job processes came up: {described}")


def sched_policy(pid: int) -> int:
    """The policy as the kernel writes it in /proc/PID/sched (5: SCHED_IDLE)."""
    for line in open(f"/proc/{pid}/sched").read().splitlines():
        if line.startswith("policy"):
            return int(line.split(":")[1])
    raise AssertionError("no policy line")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    jobs = tmp_path_factory.mktemp("jobs")
    with live_server(tiny_checkpoint, max_wait_ms=5, jobs_dir=jobs, job_min_free_bytes=0, replicas=2) as srv:
        yield srv


def test_job_processes_run_at_idle_priority_only_while_a_job_runs(server, tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "pairs.csv", make_pairs(3000, long_every=3))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        described = c.get("/info").json()["job_processes"]
        assert described["mode"] == "idle" and described["running"] is False and described["why"] == "auto"
        job_id = submit(c, src)
        pids = job_pids(c)
        live = set(c.get("/info").json()["worker"]["pids"])
        assert len(pids) == 2 and not live & set(pids)  # as many as the live ones, none of them
        for pid in pids:
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE and sched_policy(pid) == 5
            assert policy_of(pid) == SCHED_IDLE
            assert all(sched_policy(int(t)) == 5 for t in os.listdir(f"/proc/{pid}/task"))  # every thread
        assert all(os.sched_getscheduler(pid) == os.SCHED_OTHER for pid in live)
        assert c.get("/info").json()["job_processes"]["priority"] == SCHED_IDLE
        assert server.metric("qtrel_job_processes", model="tiny-bert") == 2
        done = wait_finished(c, job_id)
        assert done["status"] == "completed", done
        got = c.get(done["output"]["url"]).content
        deadline = time.monotonic() + 30  # no job left: they end
        while c.get("/info").json()["job_processes"]["running"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert c.get("/info").json()["job_processes"]["running"] is False
        assert server.metric("qtrel_job_processes", model="tiny-bert") == 0
        assert not any(os.path.exists(f"/proc/{pid}/status") and _alive(pid) for pid in pids)
    assert got == qtrel_score(tiny_checkpoint, src, tmp_path / "ref.csv", "--chunk-rows", "250")


def test_a_killed_job_process_is_replaced_and_the_job_completes(server, tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "pairs.csv", make_pairs(6000, long_every=3))  # still running once replaced
    died = server.metric("qtrel_worker_restarts_total", model="tiny-bert", reason="died")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        job_id = submit(c, src)
        first = job_pids(c)
        os.kill(first[0], signal.SIGKILL)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # replaced: a new one, ready, at idle priority, beside the other
            described = c.get("/info").json()["job_processes"]
            pids = described["pids"]
            if len(pids) == 2 and first[0] not in pids and described["replica_states"] == ["ready", "ready"]:
                break
            time.sleep(0.02)
        assert first[1] in pids and first[0] not in pids, pids
        new = next(p for p in pids if p not in first)
        assert os.sched_getscheduler(new) == os.SCHED_IDLE
        done = wait_finished(c, job_id)
        assert done["status"] == "completed", done
        got = c.get(done["output"]["url"]).content
    assert server.metric("qtrel_worker_restarts_total", model="tiny-bert", reason="died") == died + 1
    assert got == qtrel_score(tiny_checkpoint, src, tmp_path / "ref.csv", "--chunk-rows", "250")


def test_shared_runs_jobs_on_the_live_processes(tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "pairs.csv", make_pairs(600))
    with live_server(tiny_checkpoint, jobs_dir=tmp_path / "jobs", job_min_free_bytes=0, job_processes="shared") as srv:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/info").json()["job_processes"] == {"mode": "shared", "why": "set"}
            done = wait_finished(c, submit(c, src, 100))
            assert done["status"] == "completed", done
            got = c.get(done["output"]["url"]).content
            assert srv.metric("qtrel_job_processes", model="tiny-bert") == 0
    assert got == qtrel_score(tiny_checkpoint, src, tmp_path / "ref.csv", "--chunk-rows", "100")


def _alive(pid: int) -> bool:
    """Not a zombie: a stopped job process is reaped by its parent."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return not any(line.startswith("State:") and "Z" in line for line in f)
    except OSError:
        return False
