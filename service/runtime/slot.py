"""One served model (`Served`) and the loaded copy serving it (`Slot`: its runtime, model processes and
batcher queue, and its load generation).

A reload loads and warms a new slot beside the serving one, switches traffic to it at once (one
assignment on the event loop), then retires the old slot: the requests that took it finish on it (so
a request never mixes two models' tokenisers or weights), its queue drains and its processes exit.
A checkpoint that fails to load or warm leaves the serving slot untouched. Where two copies would not
fit in memory the reload is made in place instead: new requests wait (up to their deadline) while
the old copy drains and the new one loads, a bounded pause instead of a crash.

It knows nothing of HTTP; the engine is its one user.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from service.runtime.background import Background
from service.runtime.batcher import Batcher
from service.runtime.layout import Runtime
from service.runtime.workers.backend import BackendError, NotReady, State
from service.runtime.workers.worker import ModelInfo, Worker
from service.settings import ModelEntry

log = logging.getLogger("qtrel.models")

RETIRE_POLL_S = 0.02


class ModelNotFound(LookupError):
    """A request named a model this server does not serve (with several served)."""

    def __init__(self, name: str, served: list[str]):
        super().__init__(f"model {name!r} is not served; served: {', '.join(served)}")
        self.name = name
        self.served = served


class ReloadFailed(BackendError):
    """The new checkpoint could not be loaded or warmed up; the old model keeps serving."""


class ReloadBusy(BackendError):
    """A reload of this model is already under way."""


@dataclass(eq=False)
class Slot:
    """One loaded copy of a model: its runtime, processes (worker) and queue (batcher), and score jobs' own
    processes (`background`: None where jobs' batches run on the live processes)."""

    runtime: Runtime
    worker: Worker
    batcher: Batcher
    generation: int
    background: Background | None = None
    users: int = 0  # requests holding this slot: retired only once they are done
    draining: bool = False
    loaded_at: float = field(default_factory=time.time)

    @property
    def info(self) -> ModelInfo | None:
        return self.worker.info

    def start(self) -> None:
        self.batcher.start()
        self.worker.start()

    async def retire(self, timeout: float) -> None:
        """Let the requests that hold this slot finish, drain its queue, end its processes."""
        self.draining = True
        end = time.monotonic() + timeout
        while self.users and time.monotonic() < end:
            await asyncio.sleep(RETIRE_POLL_S)
        if not await self.batcher.drain(max(0.0, end - time.monotonic())):
            log.warning(
                "retiring generation %d: %d pairs outstanding at the timeout", self.generation, self.batcher.outstanding
            )
        await self.batcher.stop()
        await self.stop_processes()

    async def stop_processes(self) -> None:
        if self.background is not None:
            await self.background.stop()
        await asyncio.to_thread(self.worker.stop)


class Served:
    """One named model: the slot serving it now, and how it is reloaded."""

    def __init__(self, name: str, entry: ModelEntry, build: Callable[..., Slot]):
        self.name = name  # fixed at start: routes, cache keys and metric labels keep it across reloads
        self.entry = entry
        self._build = build
        self.current = build(entry.path, 1)
        self.reloading = False
        self._paused: asyncio.Event | None = None  # set while an in-place reload holds new requests
        self.retiring: set[asyncio.Task] = set()  # old copies draining (held: the loop keeps weak references)
        self.last_reload: dict = {}

    @property
    def generation(self) -> int:
        return self.current.generation

    def state(self) -> str:
        """loading, ready, draining (an old copy retiring after a reload), reloading, or the worker's."""
        if self._paused is not None:
            return "reloading"
        s = self.current.worker.state
        if s == State.READY and self.reloading:
            return "reloading"
        return "ready" if s == State.READY else "loading" if s in (State.LOADING, State.WARMING) else s.value

    @contextlib.asynccontextmanager
    async def hold(self, deadline: float) -> AsyncIterator[Slot]:
        """The serving slot, held for one request (an in-place reload is waited for, up to the deadline)."""
        if self._paused is not None:
            try:
                await asyncio.wait_for(self._paused.wait(), max(0.001, deadline - time.monotonic()))
            except TimeoutError:
                raise NotReady(f"model {self.name} is being reloaded in place") from None
        slot = self.current
        slot.users += 1
        try:
            yield slot
        finally:
            slot.users -= 1

    async def reload(self, path: str | None, drain_timeout: float, in_place: bool) -> Slot:
        """Load `path` (None: the model's own) and switch to it; the old copy retires in the background.
        ReloadFailed (old copy still serving) if it cannot be loaded or warmed up."""
        if self.reloading:
            raise ReloadBusy(f"model {self.name} is already being reloaded")
        self.reloading = True
        path = path or self.entry.path
        old = self.current
        try:
            if in_place:
                return await self._in_place(path, old, drain_timeout)
            new = await self._load(path, old.generation + 1)
            self.current = new  # the switch: every request from now on takes the new copy
            self.entry = ModelEntry(self.entry.name, path)
            task = asyncio.create_task(old.retire(drain_timeout), name=f"qtrel-retire-{self.name}")
            self.retiring.add(task)
            task.add_done_callback(self.retiring.discard)
            return new
        finally:
            self.reloading = False

    async def _load(self, path: str | None, generation: int, warm: bool = True) -> Slot:
        try:
            new = self._build(path, generation, warm=warm)
        except (OSError, ValueError) as e:  # no such checkpoint, a bad builtin: name
            raise ReloadFailed(f"cannot load {path}: {e}") from e
        new.start()
        await new.worker.wait_ready()
        if new.worker.state != State.READY:
            why = new.worker.error or new.worker.state.value
            await new.batcher.stop()
            await asyncio.to_thread(new.worker.stop)
            raise ReloadFailed(f"model failed to load from {path}: {why}")
        return new

    async def _in_place(self, path: str | None, old: Slot, drain_timeout: float) -> Slot:
        """Two copies will not fit: hold new requests, retire the old copy, load the new; if the new one
        fails, load the old path again. The pause is the drain plus one or two loads, without the warm-up
        ladder (its ~30 s on a shared 2-vCPU machine would be most of it: the first batches of each shape
        pay for their kernels instead)."""
        self._paused = asyncio.Event()
        try:
            await old.retire(drain_timeout)
            try:
                self.current = await self._load(path, old.generation + 1, warm=False)
                self.entry = ModelEntry(self.entry.name, path)
            except ReloadFailed:
                self.current = await self._load(self.entry.path, old.generation + 1, warm=False)
                raise
            return self.current
        finally:
            self._paused.set()
            self._paused = None
