"""A replica: one backend and the thread that alone drives it, and the policy by which it replaces a
model process that keeps dying. The worker (`service.runtime.workers.worker`) runs one replica per model instance."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.runtime.workers.backend import Backend, Forward, Job, LoadFailed, ProcessDied, State, StateMachine

log = logging.getLogger("qtrel.worker")

ENDING = frozenset({State.STOPPING, State.STOPPED})
CLOSE_WAIT_S = 10.0  # at stop, how long a batch the event loop drives may take to end


@dataclass(frozen=True)
class RestartPolicy:
    """How a replica replaces a model process that keeps dying. The first `free` restarts within
    `window_s` are immediate (a kill storm, or isolating a poison batch, takes several); each one after
    waits twice as long as the one before, up to `max_backoff_s`, so that a crash loop costs little CPU.
    `crash_loop` restarts within the window is a crash loop: liveness reports it, so that an
    orchestrator replaces the pod."""

    window_s: float = 60.0
    free: int = 8
    max_backoff_s: float = 30.0
    crash_loop: int = 12

    def delay(self, recent: int) -> float:
        """Seconds to wait before a restart that is the `recent`-th within the window."""
        over = recent - self.free
        return 0.0 if over <= 0 else min(self.max_backoff_s, 2.0 ** (over - 1))


class Replica:
    """One backend and its thread: start it, serve jobs from the shared queue, replace its process whenever it
    dies -- also while loading or warming up, or in a batch the event loop drove (`take`, `drive`) -- until
    stop. Whoever drives the backend holds `hold`. It reports to its worker only through the callbacks it is
    given."""

    def __init__(
        self,
        index: int,
        make_backend: Callable[[int], Backend],
        jobs: queue.SimpleQueue,
        on_change: Callable[[], None],
        on_loaded: Callable[[dict], None],
        on_restart: Callable[[str], None],
        policy: RestartPolicy,
    ):
        self.index = index
        self.policy = policy
        self.error: str | None = None  # why the model could not be (re)loaded, until it is
        self.machine = StateMachine(on_change=lambda old, new: on_change())
        self.thread = threading.Thread(target=self._main, name=f"qtrel-worker-{index}", daemon=True)
        self._make_backend = make_backend
        self._jobs = jobs
        self._on_loaded = on_loaded
        self._on_restart = on_restart
        self._backend: Backend | None = None
        self._restarts: deque[float] = deque()  # monotonic times of the restarts within the window
        self._restarts_lock = threading.Lock()  # appended here, counted by health probes
        self._served = False  # READY at least once: a crash loop after that is not a failed start
        # Whoever drives the backend holds this: this thread (a queued job, a restart, a health check) or the
        # event loop (`drive`: a batch with no thread hop). The loop never waits for it: it queues the job instead.
        self.hold = threading.Lock()
        self.claiming = False  # this thread took a job and waits for `hold`
        self.death: ProcessDied | None = None  # the loop saw the model process die: this thread replaces it
        self._driver: Any = None  # the event loop that last drove the backend

    @property
    def state(self) -> State:
        return self.machine.state

    @property
    def backend(self) -> Backend | None:
        return self._backend

    def recent_restarts(self) -> int:
        now = time.monotonic()
        with self._restarts_lock:
            while self._restarts and now - self._restarts[0] > self.policy.window_s:
                self._restarts.popleft()
            return len(self._restarts)

    @property
    def crash_looping(self) -> bool:
        return self.recent_restarts() >= self.policy.crash_loop

    def take(self) -> bool:
        """On the event loop: hold this replica for one `drive` if it is ready and free; never waits."""
        b = self._backend
        if self.machine.state != State.READY or self.death is not None or b is None or not b.loop_driven:
            return False
        if self.claiming or not self._jobs.empty():  # first in, first served: queued jobs go before
            return False
        if not self.hold.acquire(blocking=False):
            return False
        if self.machine.state != State.READY or self.death is not None:
            self.hold.release()
            return False
        return True

    def drive(self, loop: Any, message: Forward | Job) -> Any:
        """On the event loop, after `take`: run `message` on this replica's process; a future of its value.
        The exchange ends (and frees the replica) even if the awaiting task is cancelled."""
        assert self._backend is not None
        self._driver = loop
        future = loop.create_future()

        def done(value: Any, error: BaseException | None) -> None:
            if isinstance(error, ProcessDied):
                self.death = error  # before the release: no batch is sent to the dead process
            self.hold.release()
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

        self._backend.start_on_loop(loop, message, done)
        return future

    def request_stop(self) -> None:
        self.machine.advance(State.STOPPING)

    def close(self) -> None:
        # A batch the event loop drives ends first, so that its reader leaves the loop before the pipe closes
        # (a closed descriptor's stale reader would shadow a later one of the same number): unless that loop
        # is gone or the batch outlasts CLOSE_WAIT_S.
        end = time.monotonic() + CLOSE_WAIT_S
        while not (held := self.hold.acquire(timeout=0.05)):
            if self._driver is None or self._driver.is_closed() or time.monotonic() > end:
                break
        try:
            if self._backend is not None:
                self._backend.close()
        finally:
            if held:
                self.hold.release()
        self.machine.advance(State.STOPPED)

    def _launch(self, first: bool) -> None:
        """A new backend, loaded and warmed up. Raises LoadFailed."""
        if self._backend is not None:
            self._backend.close()
        self._backend = backend = self._make_backend(self.index)
        self._on_loaded(backend.load())
        if first:
            self.machine.advance(State.WARMING)
        if not self.machine.ending:
            backend.warm_up()

    def _ready(self, restarted: bool) -> bool:
        if not self.machine.advance(State.READY):
            return False  # stopping
        self.error = None
        self.death = None
        self._served = True
        assert self._backend is not None
        log.info("model %d %s (pid %s)", self.index, "restarted" if restarted else "ready", self._backend.pid)
        return True

    def _start(self) -> bool:
        """The first start. A checkpoint that cannot load fails the replica (and the server); a process
        that died while loading or warming up is replaced, as after any crash."""
        try:
            self._launch(first=True)
        except LoadFailed as e:
            if not e.crashed:
                self.error = str(e)
                self.machine.advance(State.FAILED)
                return False
            return self._restart("died", str(e))
        return self._ready(restarted=False)

    def _restart(self, reason: str, detail: str) -> bool:
        """Replace a dead model process, again and again (with backoff) until one is up; False only if
        stop began. A replacement that dies while it warms up is simply replaced in turn."""
        while not self.machine.ending:
            self.machine.advance(State.RESTARTING)
            with self._restarts_lock:
                self._restarts.append(time.monotonic())
            tries = self.recent_restarts()  # launches so far, the first start's included
            if not self._served and self.crash_looping:  # never up since the start: it will not come up
                self.error = f"{detail} ({tries} tries)"
                log.error("model process %d never came up: %s", self.index, self.error)
                self.machine.advance(State.FAILED)
                return False
            delay = self.policy.delay(tries)
            log.error(
                "model process %d %s (%s); restarting it%s",
                self.index,
                {"timeout": "timed out", "load_failed": "could not load"}.get(reason, "died"),
                detail,
                f" in {delay:g}s" if delay else "",
            )
            self._on_restart(reason)
            if delay and self.machine.wait_for(ENDING, delay) in ENDING:
                return False
            try:
                self._launch(first=False)
            except LoadFailed as e:
                self.error = str(e)
                reason, detail = ("died" if e.crashed else "load_failed"), str(e)
                continue
            return self._ready(restarted=True)
        return False

    def _dead(self) -> tuple[str, str] | None:
        """Why the model process is dead (reason, detail), or None while it lives."""
        assert self._backend is not None
        if (death := self.death) is not None:  # seen by the event loop, with the watchdog's reason if it killed
            return death.reason, str(death)
        health = self._backend.health()
        return None if health.alive else ("died", health.detail)

    def _main(self) -> None:
        with self.hold:
            if not self._start():
                return
        while not self.machine.ending:
            try:
                item = self._jobs.get(timeout=0.5 if self.death is None else 0.01)
            except queue.Empty:  # idle: notice a dead model process before a request does
                if not self.hold.acquire(blocking=False):
                    continue  # the loop drives it
                try:
                    if (why := self._dead()) and not self._restart(*why):
                        return
                finally:
                    self.hold.release()
                continue
            if item is None:
                self._jobs.put(None)  # the other replicas stop too
                return
            self.claiming = True
            while not self.hold.acquire(timeout=0.1):
                if self.machine.ending:
                    self._jobs.put(item)  # failed by the worker's stop
                    return
            self.claiming = False
            try:
                if not self._serve(item):
                    return
            finally:
                self.hold.release()

    def _serve(self, item: Any) -> bool:
        """Run one queued job (with `hold`); False if stop began while its process was replaced."""
        if why := self._dead():
            self._jobs.put(item)  # another replica may serve it while this one restarts
            return self._restart(*why)
        if not item.taken():
            return True
        try:
            item.settle(self._execute(item.message))
        except ProcessDied as e:
            item.settle(error=e)
            return self._restart(e.reason, str(e))
        except Exception as e:  # this job only
            item.settle(error=e)
        return True

    def _execute(self, message: Forward | Job) -> Any:
        assert self._backend is not None
        if isinstance(message, Forward):
            return self._backend.forward(message.batch)
        return self._backend.job(message.name, message.args, message.kwargs)
