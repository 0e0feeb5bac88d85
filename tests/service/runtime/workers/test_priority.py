"""The idle priority of score jobs' model processes (service.runtime.workers.priority), in real child processes:
SCHED_IDLE, nice 19 where SCHED_IDLE is not to be had, and a watchdog clock that leaves out the wait for a CPU."""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest

from service.runtime.layout import resolve_job_processes, resolve_runtime
from service.runtime.workers import priority
from service.runtime.workers.backend import InFlight, LoadSpec
from service.runtime.workers.backend_process import ProcessBackend
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


@pytest.mark.skipif(not os.path.exists("/proc/self/schedstat"), reason="no schedstat")
def test_the_watchdog_leaves_out_the_wait_for_a_cpu():
    """held_s of an idle backend: the time held less what the process waited for a CPU meanwhile."""
    waited = priority.cpu_wait_s(os.getpid())
    assert waited is not None and waited >= 0
    now = time.monotonic()
    idle = ProcessBackend(LoadSpec("unused"), idle=True)
    held = InFlight("Forward", now - 10.0, os.getpid(), waited - 8.0)  # it had waited 8 s more since
    assert 1.5 < idle.held_s(held, now) <= 2.0
    assert idle.held_s(InFlight("Forward", now - 10.0, os.getpid()), now) == 10.0  # a normal process: wall time


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


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_an_idle_worker_tokenises_as_the_server_and_its_watchdog_still_kills_a_stopped_process(tiny_checkpoint):
    """A model process at idle priority (ProcessBackend's `idle`): its "encode" job gives the
    server tokenizer's very ids, and a process that is stopped (not waiting for a CPU) is still killed by the
    watchdog, replaced at idle priority, and its batch retried."""
    import asyncio
    import signal
    from pathlib import Path

    from model.tokenizer import PairTokenizer
    from service.runtime.workers.backend_process import ProcessBackend
    from service.runtime.workers.worker import Worker

    def idle_backend(spec: LoadSpec, name: str) -> ProcessBackend:
        return ProcessBackend(spec, name, idle=True)

    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), batch_timeout_s=1.0, backend=idle_backend)
    queries, titles = ["cordless drill", "garden hose"], ["DEWALT 20V drill " * 40, "50 ft hose"]

    async def main():
        w.start()
        await w.wait_ready()
        assert w.info is not None and w.info.details["priority"] == priority.SCHED_IDLE
        first = w.pids[0]
        assert os.sched_getscheduler(first) == os.SCHED_IDLE
        got = await w.job("encode", queries, titles, truncation="only_second")
        tok = PairTokenizer.from_dir(Path(tiny_checkpoint), max_length=w.info.max_length)
        assert got == tok.encode(queries, titles)
        batch = list(zip(got.input_ids, got.token_type_ids, strict=True))
        want = [o.probs for o in await w.run(batch)]
        os.kill(first, signal.SIGSTOP)
        try:
            outs = await asyncio.wait_for(w.run(batch), 60)
        finally:
            if first in w.pids:
                os.kill(first, signal.SIGKILL)
        assert [o.probs for o in outs] == want and w.pids[0] != first
        assert os.sched_getscheduler(w.pids[0]) == os.SCHED_IDLE

    try:
        asyncio.run(main())
    finally:
        w.stop()
