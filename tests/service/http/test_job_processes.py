"""Score jobs' driver (service.runtime.background, service.runtime.workers.driver) through the real app on the
tiny checkpoint: one process at the OS's idle priority runs the whole job, only while a job runs, and the live
model processes forward none of it; a killed driver is started again and the job resumes with no row lost or
twice; a cancel kills it; the output stays byte for byte `qtrel score`'s. `job_processes=shared` is the live
processes as before."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest

from service.runtime.workers.priority import SCHED_IDLE, policy_of
from tests.service.conftest import live_server
from tests.service.http.test_jobs import make_pairs, qtrel_score, wait_finished, write_input

ADMIN = "admin-secret"
pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")


def submit(c: httpx.Client, src, chunk_rows: int = 250) -> str:
    r = c.post("/v1/jobs", content=src.read_bytes(), params={"filename": src.name, "chunk_rows": str(chunk_rows)})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def job_pids(c: httpx.Client, timeout: float = 60, rows: int = 0, job_id: str | None = None) -> list[int]:
    """The job driver's pid once it has its model (and, given `job_id`, once the job has `rows` written)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        described = c.get("/info").json()["job_processes"]
        done = c.get(f"/v1/jobs/{job_id}").json()["progress"]["rows_done"] if job_id else 0
        if described["running"] and described["pids"] and described["priority"] and done >= rows:
            return described["pids"]
        time.sleep(0.02)
    raise AssertionError(f"no job driver came up: {described}")


def wait_gone(c: httpx.Client, server, pids: list[int]) -> None:
    deadline = time.monotonic() + 30  # no job left: the driver ends
    while c.get("/info").json()["job_processes"]["running"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.get("/info").json()["job_processes"]["running"] is False
    assert server.metric("qtrel_job_processes", model="tiny-bert") == 0
    assert not any(_alive(pid) for pid in pids)  # reaped, not a zombie


def sched_policy(pid: int) -> int:
    """The policy as the kernel writes it in /proc/PID/sched (5: SCHED_IDLE)."""
    for line in open(f"/proc/{pid}/sched").read().splitlines():
        if line.startswith("policy"):
            return int(line.split(":")[1])
    raise AssertionError("no policy line")


@pytest.fixture(scope="module")
def server(tiny_checkpoint, tmp_path_factory):
    from multiprocessing import forkserver

    # The fork server is one per pytest process, its template the first spec that asked for one: a fresh one,
    # so that the driver can fork from this server's model as it would in a server of its own.
    forkserver._forkserver._stop()  # type: ignore[attr-defined]
    jobs = tmp_path_factory.mktemp("jobs")
    with live_server(
        tiny_checkpoint, max_wait_ms=5, jobs_dir=jobs, job_min_free_bytes=0, replicas=2, admin_keys=ADMIN
    ) as srv:
        yield srv


def test_the_job_driver_runs_the_whole_job_at_idle_priority(server, tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "pairs.csv", make_pairs(3000, long_every=3))
    forwards = server.metric("qtrel_inference_seconds_count", model="tiny-bert")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        described = c.get("/info").json()["job_processes"]
        assert described["mode"] == "idle" and described["running"] is False and described["why"] == "auto"
        job_id = submit(c, src)
        pids = job_pids(c)
        info = c.get("/info").json()
        live = set(info["worker"]["pids"])
        assert len(pids) == 1 and pids[0] not in live and pids[0] != os.getpid()  # one process, of its own
        assert info["job_processes"]["forward_workers"] == 2  # as many as the live model processes
        assert info["job_processes"]["model_from"] == "template"  # forked: the live processes' weights
        for pid in pids:
            assert os.sched_getscheduler(pid) == os.SCHED_IDLE and sched_policy(pid) == 5
            assert policy_of(pid) == SCHED_IDLE
            assert all(sched_policy(int(t)) == 5 for t in os.listdir(f"/proc/{pid}/task"))  # every thread
        assert all(os.sched_getscheduler(pid) == os.SCHED_OTHER for pid in live)
        assert info["job_processes"]["priority"] == SCHED_IDLE
        assert server.metric("qtrel_job_processes", model="tiny-bert") == 1
        done = wait_finished(c, job_id)
        assert done["status"] == "completed" and done["progress"]["pairs_per_s"] > 0, done
        got = c.get(done["output"]["url"]).content
        wait_gone(c, server, pids)
    # the serving processes forwarded nothing of the job: the driver did it all
    assert server.metric("qtrel_inference_seconds_count", model="tiny-bert") == forwards
    assert got == qtrel_score(tiny_checkpoint, src, tmp_path / "ref.csv", "--chunk-rows", "250")


def test_a_killed_driver_resumes_with_no_row_lost_or_twice(server, tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "pairs.csv", make_pairs(8000, long_every=3))  # still running once killed
    died = server.metric("qtrel_worker_restarts_total", model="tiny-bert", reason="died")
    with httpx.Client(base_url=server.url, timeout=60) as c:
        restarts = c.get("/info").json()["job_processes"]["restarts"]
        job_id = submit(c, src)
        first = job_pids(c, rows=1000, job_id=job_id)  # mid-job: some chunks written
        os.kill(first[0], signal.SIGKILL)
        mid = c.get(f"/v1/jobs/{job_id}").json()
        assert mid["status"] == "in_progress" and 1000 <= mid["progress"]["rows_done"] < 8005, mid
        again = job_pids(c)
        while again == first:  # the killed one may still be listed for a moment
            again = job_pids(c)
        assert os.sched_getscheduler(again[0]) == os.SCHED_IDLE
        done = wait_finished(c, job_id)
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 8005, done
        got = c.get(done["output"]["url"]).content
        assert c.get("/info").json()["job_processes"]["restarts"] == restarts + 1
        wait_gone(c, server, first + again)
    assert server.metric("qtrel_worker_restarts_total", model="tiny-bert", reason="died") == died + 1
    assert got == qtrel_score(tiny_checkpoint, src, tmp_path / "ref.csv", "--chunk-rows", "250")


def test_cancel_kills_the_driver_and_removes_the_output(server, tmp_path):
    src = write_input(tmp_path / "pairs.jsonl", make_pairs(8000, long_every=3))
    with httpx.Client(base_url=server.url, timeout=60) as c:
        job_id = submit(c, src)
        pids = job_pids(c, rows=250, job_id=job_id)
        r = c.post(f"/v1/jobs/{job_id}/cancel")
        assert r.status_code == 200 and r.json()["status"] in ("cancelling", "cancelled"), r.text
        done = wait_finished(c, job_id, timeout=30)
        assert done["status"] == "cancelled" and done["progress"]["rows_done"] < 8005, done
        wait_gone(c, server, pids)
        folder = server.settings.jobs_dir / job_id
        assert not (folder / "output.jsonl").exists() and (folder / "input.jsonl").exists()


def test_a_hot_reload_moves_the_job_to_the_new_copy_from_its_last_chunk(server, tiny_checkpoint, tmp_path):
    src = write_input(tmp_path / "pairs.csv", make_pairs(30000, long_every=2))  # still running once reloaded
    with httpx.Client(base_url=server.url, timeout=120) as c:
        died = server.metric("qtrel_worker_restarts_total", model="tiny-bert", reason="died")
        generation = c.get("/v1/models").json()["data"][0]["generation"]
        job_id = submit(c, src)
        first = job_pids(c, rows=1000, job_id=job_id)
        r = c.post("/admin/models/tiny-bert/reload", headers={"Authorization": f"Bearer {ADMIN}"})
        assert r.status_code == 200, r.text
        assert c.get("/v1/models").json()["data"][0]["generation"] == generation + 1
        deadline = time.monotonic() + 30
        while _alive(first[0]) and time.monotonic() < deadline:  # the retired copy takes its driver with it
            time.sleep(0.02)
        assert not _alive(first[0])
        assert c.get(f"/v1/jobs/{job_id}").json()["status"] == "in_progress"
        again = job_pids(c)
        assert again != first and os.sched_getscheduler(again[0]) == os.SCHED_IDLE  # the new copy's driver
        done = wait_finished(c, job_id)
        assert done["status"] == "completed" and done["request_counts"]["completed"] == 30005, done
        got = c.get(done["output"]["url"]).content
        assert c.get("/info").json()["job_processes"]["restarts"] == 0  # the new copy's: a move, not a death
        assert server.metric("qtrel_worker_restarts_total", model="tiny-bert", reason="died") == died
        wait_gone(c, server, again)
    # the same checkpoint reloaded: every row once, the bytes of an uninterrupted run
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
