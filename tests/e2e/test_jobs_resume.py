"""A score job survives SIGKILL of the whole server: `qtrel serve` as a real process group (the server and its
model processes, and with two fronts the engine core and the fronts) killed mid-job, started again on the same
jobs directory; the job resumes from its last written chunk and its output is byte for byte an uninterrupted
run's (`qtrel score`'s). With two fronts each request goes to either front: submission, status, cancel, delete
and the output answer the same from both (the jobs directory is the truth)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from tests.conftest import fronts_env
from tests.e2e.test_sigterm import wait_ready
from tests.service.conftest import free_port
from tests.service.http.test_jobs import make_pairs, qtrel_score, write_input

pytestmark = pytest.mark.slow


def serve(model_dir, port, jobs_dir, log, fronts=1):
    """`qtrel serve` in a process group of its own, so that it can be killed whole."""
    cmd = [sys.executable, "-m", "service.cli", "serve", "--model", str(model_dir), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--dtype", "float32", "--inference", "torch", "--jobs-dir", str(jobs_dir)]
    cmd += ["--job-min-free-bytes", "0", "--http-workers", str(fronts)]
    out = open(log, "w")  # noqa: SIM115 (the child holds it)
    env = {**os.environ, **fronts_env()}
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def kill_group(proc) -> None:
    """SIGKILL to the server and every model process it started: nothing gets to clean up."""
    os.killpg(os.getpgid(proc.pid), signal.SIGKILL)
    proc.wait(timeout=30)


@pytest.mark.parametrize("suffix,fronts", [(".parquet", 1), (".csv", 2)])  # both formats, both layouts
def test_sigkill_mid_job_then_restart_completes_with_identical_output(tiny_checkpoint, tmp_path, suffix, fronts):
    src = write_input(tmp_path / f"pairs{suffix}", make_pairs(6000, long_every=3))
    reference = qtrel_score(tiny_checkpoint, src, tmp_path / f"reference{suffix}", "--chunk-rows", "250")
    jobs_dir, port = tmp_path / "jobs", free_port()
    url = f"http://127.0.0.1:{port}"
    proc = serve(tiny_checkpoint, port, jobs_dir, tmp_path / "first.log", fronts)
    try:
        wait_ready(url, proc, timeout=120)
        r = httpx.post(url + "/v1/jobs", content=src.read_bytes(), params={"filename": src.name, "chunk_rows": "250"})
        assert r.status_code == 200, r.text
        job_id = r.json()["id"]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:  # until some chunks are written, and not all
            job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
            if job["progress"]["rows_done"] >= 1000:
                break
            time.sleep(0.01)
        assert job["status"] == "in_progress" and job["progress"]["rows_done"] < job["request_counts"]["total"], job
    finally:
        kill_group(proc)
    assert (jobs_dir / job_id / f"output{suffix}").exists() or (jobs_dir / job_id / f"output{suffix}.parts").exists()

    proc = serve(tiny_checkpoint, port, jobs_dir, tmp_path / "second.log", fronts)
    try:
        wait_ready(url, proc, timeout=120)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            job = httpx.get(f"{url}/v1/jobs/{job_id}").json()
            if job["status"] in ("completed", "failed", "cancelled"):
                break
            time.sleep(0.1)
        assert job["status"] == "completed", job
        assert job["request_counts"]["total"] == 6005 and job["progress"]["rows_done"] == 6005
        got = httpx.get(f"{url}/v1/jobs/{job_id}/output", timeout=60).content
        if fronts > 1:
            every_call_from_either_front(url, src, job_id)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    assert got == reference


def every_call_from_either_front(url: str, src, done_id: str) -> None:
    """A second job queued, cancelled and deleted, a request at a time to whichever front takes it."""
    with httpx.Client(base_url=url, timeout=60) as c:
        r = c.post("/v1/jobs", content=src.read_bytes(), params={"filename": src.name, "chunk_rows": "100"})
        assert r.status_code == 200, r.text
        new = r.json()["id"]
        for _ in range(10):  # each front reads the jobs directory: the new job at once, from any of them
            assert c.get(f"/v1/jobs/{new}").json()["status"] in ("queued", "in_progress", "finalizing", "completed")
            assert [j["id"] for j in c.get("/v1/jobs").json()["data"]][:2] == [new, done_id]
        cancelled = c.post(f"/v1/jobs/{new}/cancel").json()
        assert cancelled["status"] in ("cancelling", "cancelled", "completed"), cancelled
        deadline = time.monotonic() + 60
        while (job := c.get(f"/v1/jobs/{new}").json())["status"] not in ("cancelled", "completed"):
            assert time.monotonic() < deadline, job
            time.sleep(0.05)
        assert c.post(f"/v1/jobs/{new}/cancel").status_code == 409
        assert c.delete(f"/v1/jobs/{new}").json()["deleted"] is True
        for _ in range(10):
            assert c.get(f"/v1/jobs/{new}").status_code == 404
        assert c.get(f"/v1/jobs/{done_id}/output").status_code == 200
        metrics = c.get("/metrics").text  # the core's job gauges, merged into every front's /metrics
        assert 'qtrel_jobs{state="completed"}' in metrics and "qtrel_job_pairs_total" in metrics
