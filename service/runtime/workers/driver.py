"""The job driver: one process that runs a whole score job, `qtrel score`'s own code (`model.bulk.score_file`:
its readers, tokenising, batches, forward workers of one thread each, writers and resume), at the OS's idle
priority, so that the server process does none of the job's work. The server starts it, follows what it says
(a line per chunk written), and kills it to cancel or stop the job; a killed driver left the output with its
last synced chunk whole, and the next one resumes from there, as `qtrel score --resume` does.

The model: forked from the fork server's template where it is the spec's (the weights and warmed kernels
shared with the live model processes: the same bits, no loading), else loaded from the checkpoint as a model
process loads it (a second model, a reload from another checkpoint, no fork server). It forwards on as many
workers as the live model processes, each with their threads (`model.parallel`).

The driver ends itself when the server goes (its pipe reads EOF) and holds a lock on the job's folder while it
runs, so that a driver left by a killed server never writes beside the next one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

from model.bulk.score import ScoreOptions
from model.tokenizer import Truncation
from service.runtime.workers import priority
from service.runtime.workers.backend import LoadSpec

log = logging.getLogger("qtrel.jobs")


@dataclass(frozen=True)
class Task:
    """A job as the driver runs it: `score_file`'s arguments, and how many forward workers."""

    input: str
    output: str
    options: ScoreOptions
    truncation: Truncation
    chunk_rows: int
    workers: int


# --- driver -> server ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Started:
    """The model is ready: where it came from ("template" or "checkpoint") and in how many seconds."""

    pid: int
    priority: str
    model_from: str
    load_s: float


@dataclass(frozen=True)
class Written:
    """A chunk is written and synced: the rows the output holds, the chunk's bad rows, this run's rows and
    seconds (for the rate)."""

    rows: int
    bad: int
    run_rows: int
    run_s: float


@dataclass(frozen=True)
class Finished:
    summary: dict


@dataclass(frozen=True)
class Broke:
    """The job (or, `loading`, the model) failed: why, in the error's words."""

    kind: str
    message: str
    errno: int | None
    loading: bool


def driver_main(conn: Any, spec: LoadSpec, task: Task) -> None:
    """The driver process: lower its priority first (every thread torch starts inherits it), then load, then
    run the job, saying each step on `conn`."""
    lowered = priority.lower_priority()
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the server stops it (SIGKILL) when it must
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_exit_with_server, args=(conn,), name="qtrel-driver-watch", daemon=True).start()
    folder = os.open(os.path.dirname(task.output) or ".", os.O_RDONLY)
    fcntl.flock(folder, fcntl.LOCK_EX)  # a driver of a killed server still writing: wait for its end
    try:
        t0 = time.perf_counter()
        model, source = _model(spec, task.workers)
        conn.send(Started(os.getpid(), lowered, source, round(time.perf_counter() - t0, 3)))
    except Exception as e:
        conn.send(_broke(e, loading=True))
        return
    from model.bulk.score import score_file

    t0, kept = time.perf_counter(), -1

    def written(rows: int, bad: int) -> None:
        nonlocal kept
        if kept < 0:  # the rows the output held at the start: whole chunks, before this first one
            kept = (rows - 1) // task.chunk_rows * task.chunk_rows
        conn.send(Written(rows, bad, rows - kept, time.perf_counter() - t0))

    try:
        summary = score_file(
            model,
            task.input,
            task.output,
            task.options,
            chunk_rows=task.chunk_rows,
            resume=True,
            progress=False,
            truncation=task.truncation,
            on_chunk=written,
        )
    except Exception as e:
        conn.send(_broke(e, loading=False))
        return
    conn.send(Finished(summary))


def _model(spec: LoadSpec, workers: int) -> tuple[Any, str]:
    """The spec's model, with `workers` forward workers of the spec's threads each."""
    import torch

    from service.runtime.workers import runner, template

    base = template.take(spec)
    each = spec.threads or (base.default_threads if base is not None else torch.get_num_threads())
    if base is not None:
        model, source = base.model, "template"
    else:
        model, source = runner.load_model(dataclasses.replace(spec, threads=each)), "checkpoint"
    runner.start_inference(model, spec)  # after the fork, as a model process: OpenVINO's pools are its own
    torch.set_num_threads(max(1, workers) * each)
    model.workers = max(1, workers)  # model.parallel.plan: `workers` workers of `each` threads
    return model, source


def _broke(e: Exception, loading: bool) -> Broke:
    code = e.errno if isinstance(e, OSError) else None
    return Broke(type(e).__name__, str(e), code, loading)


def _exit_with_server(conn: Any) -> None:
    """The server sends nothing: a read returns only once it is gone (EOF). Then end at once: its next start
    resumes the job, and this driver must not write beside it."""
    with contextlib.suppress(Exception):
        conn.recv()
    os._exit(1)


class DriverProcess:
    """The server's handle on one driver: started from the fork server where the live model processes are
    (`backend_process.start_context`), read a message at a time, killed."""

    def __init__(self, spec: LoadSpec, task: Task, name: str = "qtrel-job-driver"):
        from service.runtime.workers.backend_process import start_context

        ctx = start_context(spec)
        self._conn, child = ctx.Pipe()
        try:
            self._proc = ctx.Process(target=driver_main, args=(child, spec, task), name=name, daemon=True)
            self._proc.start()
        finally:
            child.close()  # so that the driver's end reads as EOF here

    @property
    def pid(self) -> int:
        return self._proc.pid

    def recv(self) -> Started | Written | Finished | Broke:
        """The driver's next message (blocking); EOFError once it has gone without a last word."""
        try:
            return self._conn.recv()
        except OSError:
            raise EOFError from None

    def kill(self) -> None:
        """SIGKILL and reap: once this returns the driver writes nothing more."""
        if self._proc.is_alive():
            self._proc.kill()
        self._proc.join(30)

    def close(self) -> None:
        self._conn.close()

    def join(self, timeout: float) -> int | None:
        self._proc.join(timeout)
        return self._proc.exitcode
