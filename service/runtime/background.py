"""Score jobs run off the serving process: one job driver per loaded copy of a model (its `Slot`), a process at
the OS's idle priority that runs the whole job, `qtrel score`'s own code (service.runtime.workers.driver), with
the model forked from the fork server's template (the live processes' weights and bits). The server process
only starts it, follows a line per chunk written, and kills it to cancel or stop; it reads, tokenises,
forwards and writes nothing of the job, so a live request never waits for the job's Python under the server's
interpreter lock, and the live model processes and the HTTP process take a CPU from the driver the moment
they want one (the kernel's wake-up preemption, service.runtime.workers.priority).

A driver runs only while a job does, so a server without jobs pays no memory for it. One that dies is started
again and resumes from the job's last written chunk (`DriverDied`, counted as a model process restart); one
that cannot load its model leaves the job to the live processes (`usable` is False until the next job), as
`job_processes=shared` runs it (service.jobs.scoring). A retiring copy (a reload, the server's stop) kills its
driver (`stop`): the job resumes on the copy that serves next.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable

from service.runtime.workers.backend import BackendError
from service.runtime.workers.driver import Broke, DriverProcess, Finished, Started, Task, Written
from service.runtime.workers.worker import Worker, WorkerObserver

log = logging.getLogger("qtrel.jobs")

POLL_S = 0.2  # how often a running job's driver is asked whether to stop (a cancel, the server's stop)


class DriverDied(BackendError):
    """The driver ended without a last word (killed, out of memory): the job resumes from its output."""


class Interrupted(BackendError):
    """The model copy retired under the job (a reload, a stop): the job resumes on the copy serving next."""


class DriverFailed(BackendError):
    """The driver could not load its model: the live processes run the job instead."""


class JobBroke(Exception):
    """The job itself failed (a bad row, a full disk): `broke` says why."""

    def __init__(self, broke: Broke):
        super().__init__(broke.message)
        self.broke = broke


class Background:
    """The job driver of one loaded model copy, beside its live `worker` (whose spec and size it takes)."""

    def __init__(
        self,
        live: Worker,
        observer: WorkerObserver,
        on_count: Callable[[int], None] = lambda n: None,
    ):
        self.live, self.observer = live, observer
        self.on_count = on_count  # told the processes up (0 once stopped): the gauge
        self.driver: DriverProcess | None = None
        self.started: Started | None = None
        self.error: str | None = None  # why no driver could load; the live processes run jobs meanwhile
        self.restarts = 0
        self._retired = False

    @property
    def size(self) -> int:
        """Forward workers: as many as the live model processes."""
        return self.live.size

    @property
    def usable(self) -> bool:
        return self.error is None and not self._retired

    async def drive(
        self, task: Task, on_written: Callable[[Written], Awaitable[None]], halt: Callable[[], Exception | None]
    ) -> dict:
        """Run `task` in a driver; `on_written` after each chunk. Returns the run's summary; raises `halt()`'s
        exception (the driver killed first), JobBroke, DriverDied, Interrupted or DriverFailed."""
        if not self.usable:
            raise Interrupted("the model copy retired") if self._retired else DriverFailed(self.error or "")
        task = dataclasses.replace(task, workers=self.size)
        try:
            driver = await asyncio.to_thread(DriverProcess, self.live.start_spec, task)
        except Exception as e:  # e.g. no memory left to start a process
            self.error = f"the job driver did not start: {type(e).__name__}: {e}"
            raise DriverFailed(self.error) from e
        self.driver, self.started = driver, None
        self.on_count(1)
        pending: asyncio.Future | None = None
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(asyncio.to_thread(driver.recv))
                done, _ = await asyncio.wait({pending}, timeout=POLL_S)
                if (why := halt()) is not None:
                    raise why
                if not done:
                    continue
                try:
                    message = pending.result()
                except EOFError:
                    if self._retired:
                        raise Interrupted("the model copy retired") from None
                    self.restarts += 1
                    self.observer.restarted("died")
                    code = await asyncio.to_thread(driver.join, 5)
                    raise DriverDied(f"the job driver died (exit code {code})") from None
                finally:
                    pending = None
                if isinstance(message, Written):
                    await on_written(message)
                elif isinstance(message, Started):
                    self.started = message
                    log.info("job driver %d up at %s priority, its model from the %s in %.2fs", message.pid,
                             message.priority, message.model_from, message.load_s)  # fmt: skip
                elif isinstance(message, Finished):
                    return message.summary
                elif isinstance(message, Broke):
                    if message.loading:
                        self.error = f"the job driver could not load its model: {message.kind}: {message.message}"
                        log.error("%s; the live model processes run the job", self.error)
                        raise DriverFailed(self.error)
                    raise JobBroke(message)
        finally:
            await asyncio.to_thread(driver.kill)
            if pending is not None:  # it reads EOF now that the driver is gone
                await asyncio.wait({pending})
            driver.close()
            self.driver = None
            self.on_count(0)

    async def stop(self) -> None:
        """No job is left, or the copy retires: a driver still running is killed (its job resumes); the next
        job tries a driver again after a failed load."""
        if (driver := self.driver) is not None:
            self._retired = True
            await asyncio.to_thread(driver.kill)
        self.error = None

    @property
    def priority(self) -> str | None:
        return self.started.priority if self.started is not None else None

    def describe(self) -> dict:
        d, s = self.driver, self.started
        return {
            "mode": "idle",
            "running": d is not None,
            "processes": 1 if d is not None else 0,
            "forward_workers": self.size,
            "priority": self.priority,
            "pids": [d.pid] if d is not None else [],
            "model_from": s.model_from if s is not None else None,
            "restarts": self.restarts,
            "error": self.error,
        }
