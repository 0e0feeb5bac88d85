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
    """One backend and the thread that alone drives it: start it, serve jobs from the shared queue,
    replace its process whenever it dies -- also while loading or warming up -- until stop. It reports to
    its worker only through the callbacks it is given."""

    def __init__(
        self,
        index: int,
        make_backend: Callable[[int], Backend],
        jobs: queue.Queue,
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

    def request_stop(self) -> None:
        self.machine.advance(State.STOPPING)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
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

    def _dead(self) -> str | None:
        """Why the model process is dead, or None while it lives."""
        assert self._backend is not None
        health = self._backend.health()
        return None if health.alive else health.detail

    def _main(self) -> None:
        if not self._start():
            return
        while not self.machine.ending:
            try:
                item = self._jobs.get(timeout=0.5)
            except queue.Empty:  # idle: notice a dead model process before a request does
                if (why := self._dead()) and not self._restart("died", why):
                    return
                continue
            if item is None:
                self._jobs.put(None)  # the other replicas stop too
                return
            if why := self._dead():
                self._jobs.put(item)  # another replica may serve it while this one restarts
                if not self._restart("died", why):
                    return
                continue
            if not item.future.set_running_or_notify_cancel():
                continue
            try:
                item.future.set_result(self._execute(item.message))
            except ProcessDied as e:
                item.future.set_exception(e)
                if not self._restart(e.reason, str(e)):
                    return
            except Exception as e:  # this job only
                item.future.set_exception(e)

    def _execute(self, message: Forward | Job) -> Any:
        assert self._backend is not None
        if isinstance(message, Forward):
            return self._backend.forward(message.batch)
        return self._backend.job(message.name, message.args, message.kwargs)
