"""The models a server serves, by name, in configuration order (the first is the default), and the
shadow: each its own model processes and batcher queue (`service.runtime.slot`), its share of the cores
resolved once at start. Reloads (one model, or all on SIGHUP) are chosen here: beside the serving copy
when a second copy fits in memory, else in place. It knows nothing of HTTP; the engine is its one user.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

from model.builtin import resolve_model
from service.metrics import Metrics
from service.runtime.background import Background
from service.runtime.batcher import Batcher, Overloaded
from service.runtime.layout import (
    memory_available,
    package_version,
    resolve_job_processes,
    resolve_runtime,
    usable_cores,
)
from service.runtime.pace import Pace
from service.runtime.shadow import Shadow
from service.runtime.slot import ModelNotFound, ReloadBusy, ReloadFailed, Served, Slot
from service.runtime.workers.backend import NotReady, State
from service.runtime.workers.worker import Worker
from service.settings import ModelEntry, Settings, parse_entry, parse_models
from service.tracing import Tracing

__all__ = ["ModelNotFound", "Models", "ReloadBusy", "ReloadFailed", "Served", "Slot"]

log = logging.getLogger("qtrel.models")


def checkpoint_name(model_dir: Path) -> str:
    """The name a checkpoint gives itself (config key qtrel_model_id, else its directory's), as
    model.relevance does, read without loading it."""
    try:
        named = json.loads((model_dir / "config.json").read_text()).get("qtrel_model_id")
    except (OSError, ValueError, AttributeError):
        named = None
    return str(named or model_dir.name)


def entries_of(settings: Settings) -> list[ModelEntry]:
    return parse_models(settings.models) if settings.models else [ModelEntry(None, settings.model)]


class Models:
    """The served models by name, in configuration order (the first is the default), and the shadow."""

    def __init__(self, settings: Settings, metrics: Metrics, tracing: Tracing | None = None):
        self.settings = settings
        self.metrics = metrics
        self.tracing = tracing
        entries = entries_of(settings)
        cores = usable_cores()
        self.cores_each = max(1, cores // len(entries))  # resolved once; a reload keeps it
        self._served: list[Served] = []
        for e in entries:
            name = e.name or checkpoint_name(resolve_model(e.path))  # a bare path: named as before
            self._served.append(Served(name, e, functools.partial(self.build, name)))
        self.on_reload: Callable[[], None] = lambda: None  # the engine lets go of the cache
        self.on_queue_change: Callable[[], None] = lambda: None  # a queue changed: the engine core tells its fronts
        for m in self._served:
            for result in ("ok", "failed"):
                metrics.model_reloads.labels(m.name, result)
        self.shadow: Shadow | None = None
        if settings.shadow:  # one model process of one thread, beside the served models' shares
            entry = parse_entry(settings.shadow)
            assert entry.name is not None  # the settings' validator holds it
            slot = self.build(entry.name, entry.path, 1, cores=1, queue=settings.shadow_queue_pairs, jobs=False)
            self.shadow = Shadow(
                entry.name, slot, settings.shadow_rate, settings.shadow_queue_pairs, self.default, metrics
            )

    def build(
        self,
        name: str,
        path: str | None,
        generation: int,
        cores: int | None = None,
        queue: int | None = None,
        warm: bool = True,
        jobs: bool = True,
    ) -> Slot:
        """A new copy of model `name` from `path` (started by the caller), observed under its name; `warm`
        False skips the warm-up (an in-place reload, whose pause it would lengthen); `jobs`: with score jobs'
        own processes where jobs are on and `job_processes` resolves to idle (not the shadow's)."""
        observer = self.metrics.for_model(name)
        s = self.settings
        runtime = resolve_runtime(s, cores or self.cores_each, model=path)
        spec = runtime.load_spec(s)
        worker = Worker(
            spec if warm else dataclasses.replace(spec, warmup=False),
            mode=runtime.worker,
            replicas=runtime.replicas,
            observer=observer,
            batch_timeout_s=s.batch_timeout_s,
        )
        batcher = Batcher(
            worker.run,
            max_batch_tokens=s.max_batch_tokens,
            max_batch_size=s.max_batch_size,
            max_wait_s=s.max_wait_ms / 1000,
            max_queue_items=queue or s.max_queue_pairs,
            max_queue_tokens=s.max_queue_tokens,
            observer=observer,
            concurrency=worker.size,
            tracer=self.tracing.batch_tracer if self.tracing else None,
            pace=Pace(worker.size),
            max_queue_wait_s=s.max_queue_wait_ms / 1000,
            max_batch_s=s.max_batch_ms / 1000,
            on_change=lambda: self.on_queue_change(),
        )
        background = None
        if jobs and s.jobs_dir is not None and resolve_job_processes(s, runtime)[0] == "idle":
            gauge = self.metrics.job_processes.labels(name)
            background = Background(worker, observer, on_count=gauge.set)
        return Slot(runtime, worker, batcher, generation, background)

    # --- lookup -------------------------------------------------------------------------------
    def __iter__(self):
        return iter(self._served)

    @property
    def default(self) -> Served:
        return self._served[0]

    @property
    def names(self) -> list[str]:
        return [m.name for m in self._served]

    def get(self, name: str | None) -> Served:
        """The model a request names; with one model served any name is it (Cohere's clients always send
        one); None is the default."""
        if name is None or len(self._served) == 1:
            return self.default
        for m in self._served:
            if m.name == name:
                return m
        raise ModelNotFound(name, self.names)

    def generation_of(self, name: str) -> int | None:
        return next((m.generation for m in self._served if m.name == name), None)

    # --- state --------------------------------------------------------------------------------
    def _named(self, m: Served) -> str:
        return "model " if len(self._served) == 1 else f"model {m.name} "

    def readiness(self) -> tuple[bool, str]:
        """Ready while every model serves (or is being reloaded: its requests wait)."""
        for m in self._served:
            state = m.current.worker.state
            if state == State.FAILED:
                return False, f"{self._named(m)}failed to load: {m.current.worker.error}"
            if m.state() not in ("ready", "reloading"):
                return False, state.value
        return True, State.READY.value

    def liveness(self) -> tuple[bool, str]:
        for m in self._served:
            if m.state() == "reloading":
                continue  # an in-place reload stops the old processes on purpose
            w = m.current.worker
            if loops := w.crash_loops():
                return False, f"crash loop: model process {loops} restarted too often"
            if not w.alive():
                return False, w.state.value
        return True, self.default.current.worker.state.value

    def serving(self, name: str | None) -> Served:
        """The model named, if it can take work: it serves, is reloaded, or its processes restart (the
        work waits for them; its deadline and the queue's bounds still hold), so that neither a crash nor
        a swap fails a request. NotReady otherwise, ModelNotFound for a name not served."""
        served = self.get(name)
        state = served.current.worker.state
        if state == State.FAILED:
            raise NotReady(f"{self._named(served)}failed to load: {served.current.worker.error}")
        if served.state() not in ("ready", "reloading") and not (
            state == State.RESTARTING and served.current.info is not None
        ):
            raise NotReady(state.value)
        return served

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> str | None:
        """Start every model and wait until each is up: None, or why one cannot be served."""
        for m in self._served:
            m.current.start()
        await asyncio.gather(*(m.current.worker.wait_ready() for m in self._served))
        if self.shadow is not None:  # after the served models: its load does not slow theirs
            self.shadow.start()
        for m in self._served:
            w = m.current.worker
            if w.state == State.FAILED:
                return f"{self._named(m)}failed to load: {w.error}"
            if w.state != State.READY or w.info is None:
                return None  # stopping before the model was up
        for m in self._served:
            info = m.current.info
            assert info is not None
            self.metrics.model_info.labels(m.name, str(info.device), info.dtype, package_version()).set(1)
            self.metrics.model_generation.labels(m.name).set(m.generation)
        return None

    async def drain(self, timeout: float) -> bool:
        done = await asyncio.gather(*(m.current.batcher.drain(timeout) for m in self._served))
        return all(done)

    async def stop(self) -> None:
        if self.shadow is not None:
            await self.shadow.stop()
        await asyncio.gather(*(t for m in self._served for t in m.retiring))  # old copies finish retiring
        for m in self._served:
            await m.current.batcher.stop()
        await asyncio.gather(*(m.current.stop_processes() for m in self._served))

    def refusal(self) -> Overloaded | None:
        """Why no scoring request could be admitted now, whatever its model: every model's queue is full
        (None: one has room). Counts nothing."""
        refusals = [m.current.batcher.refusal() for m in self._served]
        if (first := refusals[0]) is None or None in refusals:
            return None
        return first

    def refuse_early(self) -> Overloaded | None:
        """Before a request's model is known: refused only when every model's queue is full."""
        if (first := self.refusal()) is None:
            return None
        self.metrics.rejected.labels("overloaded").inc()
        self.metrics.admission_refused.labels(self.default.name, first.reason).inc()
        return first

    async def reload(self, name: str | None, path: str | None = None) -> dict | None:
        """Reload one model (optionally from a new path): what it serves now, or ReloadFailed / ReloadBusy
        with the old copy still serving. Counted by result in qtrel_model_reloads. None: every model
        from its own path, one after the other, then the shadow (SIGHUP); a failure is logged and counted."""
        if name is None:
            for m in list(self._served):
                with contextlib.suppress(ReloadFailed, ReloadBusy):
                    await self.reload(m.name)
            if self.shadow is not None:
                await self._reload_shadow(self.shadow)
            return None
        served = self.exact(name)
        in_place = not self.fits_beside(served)
        if in_place and self.settings.reload == "auto":
            log.warning("a second copy of model %s does not fit in memory: reloading it in place", served.name)
        t0 = time.monotonic()
        try:
            await served.reload(path, self.settings.drain_timeout_s, in_place)
        except ReloadBusy:
            raise
        except ReloadFailed as e:
            self.metrics.model_reloads.labels(served.name, "failed").inc()
            served.last_reload = {"ok": False, "error": str(e), "at": time.time()}
            log.error("reload of model %s failed, the loaded one keeps serving: %s", served.name, e)
            raise
        self.on_reload()
        seconds = round(time.monotonic() - t0, 3)
        self.metrics.model_reloads.labels(served.name, "ok").inc()
        self.metrics.model_generation.labels(served.name).set(served.generation)
        served.last_reload = {"ok": True, "mode": "in_place" if in_place else "beside", "seconds": seconds}
        log.info(
            "model %s reloaded (%s, %.2fs): generation %d",
            served.name,
            served.last_reload["mode"],
            seconds,
            served.generation,
        )
        return self.listing(served)

    async def _reload_shadow(self, shadow: Shadow) -> None:
        """The shadow from its path, beside the old copy (off the request path: no pause to bound)."""
        path = parse_entry(self.settings.shadow).path
        new = self.build(shadow.name, path, shadow.slot.generation + 1, cores=1, queue=self.settings.shadow_queue_pairs)
        new.start()
        await new.worker.wait_ready()
        if new.worker.state != State.READY:
            await new.retire(0)
            self.metrics.model_reloads.labels(shadow.name, "failed").inc()
            log.error("reload of shadow %s failed, the loaded one keeps scoring: %s", shadow.name, new.worker.error)
            return
        old, shadow.slot = shadow.slot, new
        self.metrics.model_reloads.labels(shadow.name, "ok").inc()
        await old.retire(self.settings.drain_timeout_s)

    def exact(self, name: str) -> Served:
        """The model of this exact name (the admin routes do not take "any name" as scoring does)."""
        for m in self._served:
            if m.name == name:
                return m
        raise ModelNotFound(name, self.names)

    def listing(self, m: Served) -> dict:
        """One model as GET /v1/models lists it."""
        info = m.current.info
        rt = m.current.runtime
        return {
            "id": m.name,
            "object": "model",
            "created": int(m.current.loaded_at),
            "owned_by": "qtrel",
            "path": str(rt.model_dir),
            "levels": info.labels if info else [],
            "languages": languages(rt.model_dir),
            "dtype": info.dtype if info else rt.dtype,
            "device": str(info.device) if info else rt.device,
            "state": m.state(),
            "generation": m.generation,
            "default": m is self.default,
            "layout": {"cores": self.cores_each, "replicas": rt.replicas, "threads": rt.threads},
            "last_reload": m.last_reload,
            "job_processes": self.job_processes(m),
        }

    def job_processes(self, m: Served) -> dict | None:
        """Where the model's score jobs' batches run (/info); None while jobs are off."""
        if self.settings.jobs_dir is None:
            return None
        mode, why = resolve_job_processes(self.settings, m.current.runtime)
        bg = m.current.background
        return (bg.describe() if bg is not None else {"mode": mode}) | {"why": why}

    def fits_beside(self, served: Served) -> bool:
        """Whether a second copy of the model fits in memory now: twice the serving copy's resident size
        (its model processes; warm-up peaks near twice the settled size, docs/benchmarks.md) against
        what the machine, or the container's limit, has available."""
        if self.settings.reload == "beside":
            return True
        if self.settings.reload == "in_place":
            return False
        need = sum(_rss(pid) for pid in served.current.worker.pids)
        free = memory_available()
        return free is None or need == 0 or 2 * need < free


def languages(model_dir: Path) -> list[str] | None:
    """The languages a checkpoint says it reads (config key `languages`, e.g. ["zh", "en"]); None: unsaid."""
    try:
        got = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")).get("languages")
    except (OSError, ValueError):
        return None
    return [str(x) for x in got] if isinstance(got, list) else None


def _rss(pid: int) -> int:
    """Resident bytes of a process (0 if gone or unreadable)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0
