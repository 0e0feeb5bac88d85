"""The idle priority of score jobs' driver process (service.runtime.workers.priority), in real child processes:
SCHED_IDLE, and nice 19 where SCHED_IDLE is not to be had; where job batches run."""

from __future__ import annotations

import multiprocessing as mp
import os

import pytest

from service.runtime.layout import resolve_job_processes, resolve_runtime
from service.runtime.workers import priority
from service.settings import Settings


def _lower(prefer_idle: bool, conn) -> None:
    conn.send(priority.lower_priority(prefer_idle))
    conn.recv()  # stay alive while the parent reads /proc


def lowered_child(prefer_idle: bool):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_lower, args=(prefer_idle, child), daemon=True)
    proc.start()
    return proc, parent, parent.recv()


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_lowered_to_sched_idle():
    proc, conn, how = lowered_child(True)
    try:
        assert how == priority.SCHED_IDLE
        assert os.sched_getscheduler(proc.pid) == os.SCHED_IDLE
        assert priority.policy_of(proc.pid) == priority.SCHED_IDLE
    finally:
        conn.send("done")
        proc.join(10)


def test_nice_19_where_there_is_no_sched_idle():
    proc, conn, how = lowered_child(False)
    try:
        assert how == priority.NICE
        assert os.getpriority(os.PRIO_PROCESS, proc.pid) == 19
        assert priority.policy_of(proc.pid) == priority.NICE
        assert priority.policy_of(os.getpid()) == "normal"
    finally:
        conn.send("done")
        proc.join(10)


def test_where_job_batches_run():
    cpu = resolve_runtime(Settings(model="builtin:default", device="cpu"))
    assert resolve_job_processes(Settings(job_processes="shared"), cpu) == ("shared", "set")
    assert resolve_job_processes(Settings(job_processes="idle"), cpu) == ("idle", "set")
    thread = resolve_runtime(Settings(model="builtin:default", device="cpu", worker="thread"))
    assert resolve_job_processes(Settings(job_processes="idle"), thread)[0] == "shared"


def test_auto_keeps_shared_under_a_cpu_quota(monkeypatch):
    from service.runtime import layout

    cpu = resolve_runtime(Settings(model="builtin:default", device="cpu"))
    seen = len(os.sched_getaffinity(0))
    monkeypatch.setattr(layout, "cgroup_cpu_limit", lambda: None)
    assert resolve_job_processes(Settings(), cpu) == ("idle", "auto")
    monkeypatch.setattr(layout, "cgroup_cpu_limit", lambda: seen - 0.5)
    mode, why = resolve_job_processes(Settings(), cpu)
    assert mode == "shared" and "CPU quota" in why
