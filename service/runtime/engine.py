"""The engine joins tokenisation, the score cache and the served models behind the calls HTTP needs:
score these pairs (with this model), explain this pair, reload a model, are you ready, describe yourself.

It is handed its parts by the composition root (`service.app`): the served models (each its runtime,
worker and batcher, `service.runtime.models`) and the shadow; it decides nothing about where or how a
model runs. It owns the one readiness function and the one drain switch. Larger requests are tokenised
on their own thread, overlapping forward passes in the model processes; the event loop only awaits.

It knows nothing of HTTP: what goes wrong is raised as the runtime's own errors (below, and the
batcher's `Overloaded`, `Closed`, `DeadlineExceeded`, the backend's `NotReady`), which
`service.http.errors` maps to statuses in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from model.levels import unpack_row
from service.logs import request_id
from service.metrics import Metrics
from service.runtime.api import EngineAPI
from service.runtime.batcher import Closed, DeadlineExceeded, Overloaded, priority_of
from service.runtime.cache import Cached, Key, ScoreCache, make_key
from service.runtime.encoded import Encoded, Stale
from service.runtime.flight import Flight, Flights
from service.runtime.layout import package_version, resolve_http_workers
from service.runtime.models import ModelNotFound, Models, ReloadBusy, ReloadFailed, Served, Slot
from service.runtime.results import (
    InferenceFailed,
    InputTooLong,
    Scored,
    Tokenized,
    Unreadable,
    WindowPick,
    check_readable,
)
from service.runtime.scoring import FrameSide, describe_error
from service.runtime.texts import INLINE_PAIRS, TextSide
from service.runtime.windows import TooManyWindows
from service.runtime.workers.backend import BackendError, NotReady
from service.runtime.workers.worker import ModelInfo
from service.settings import Settings
from service.tracing import Tracing

__all__ = [  # the errors HTTP maps (service.http.errors), with the engine's own, and its interface
    "BackendError",
    "EngineAPI",
    "INLINE_PAIRS",
    "Closed",
    "DeadlineExceeded",
    "Engine",
    "InferenceFailed",
    "InputTooLong",
    "ModelNotFound",
    "NotReady",
    "Overloaded",
    "ReloadBusy",
    "ReloadFailed",
    "Scored",
    "Stale",
    "Tokenized",
    "TooManyWindows",
    "Unreadable",
    "WindowPick",
]

log = logging.getLogger("qtrel.engine")


class Engine(TextSide, FrameSide):
    def __init__(self, settings: Settings, models: Models, metrics: Metrics, tracing: Tracing | None = None):
        self.settings = settings
        self.tracing = tracing or Tracing()  # off: every call a no-op
        self.models = models
        models.on_reload = self._forget
        self.metrics = metrics
        self._draining = False  # readiness off (SIGTERM): the requests the HTTP server holds are still taken
        self._closed = False  # drain() runs: no new work
        self.cache = ScoreCache(settings.cache_mb * 2**20)
        self.flights = Flights(self._landed)
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="qtrel-tokenize")
        self._children: dict[tuple, Any] = {}  # labelled metric series by (metric, labels): see _series
        self._tally: dict[Any, int] = {}  # counts to add at the end of this event-loop turn (FrameSide.tally)
        self._level_series: dict = {}  # per model: its levels and their series (FrameSide.answer)

    # the default model's parts (what one-model callers and tests read)
    runtime = property(lambda self: self.models.default.current.runtime, doc="the default model's Runtime")
    worker = property(lambda self: self.models.default.current.worker, doc="the default model's Worker")
    batcher = property(lambda self: self.models.default.current.batcher, doc="the default model's Batcher")

    generation = property(lambda self: self.models.default.generation, doc="the default model's load generation")

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> str | None:
        """Load and warm up every model; None once serving, else why one cannot be served (the caller exits)."""
        why = await self.models.start()
        if why is None and self.models.default.state() == "ready":
            self.metrics.ready.set(1)
        return why

    def readiness(self) -> tuple[bool, str]:
        """The one readiness rule: every model is loaded and warmed up (or being reloaded: its requests
        wait), a model process serves, and the service is not draining. (ready, why)."""
        return (False, "draining") if self._draining else self.models.readiness()

    def liveness(self) -> tuple[bool, str]:
        return self.models.liveness()

    def begin_drain(self) -> None:
        """Stop reporting ready (SIGTERM). The requests the HTTP server still holds are taken and answered, as a
        front's are (service.runtime.remote): refusing them would answer 503 to requests sent before the signal.
        Safe to call from a signal handler (it only sets values)."""
        self._draining = True
        self.metrics.ready.set(0)

    @property
    def draining(self) -> bool:
        return self._draining

    async def drain(self, timeout: float) -> None:
        """Stop taking work (the HTTP server has finished its requests); let admitted work finish (up to `timeout`)."""
        self.begin_drain()
        self._closed = True
        if not await self.models.drain(timeout):
            log.warning("drain timed out with pairs outstanding")

    async def stop(self) -> None:
        await self.models.stop()
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    def _forget(self) -> None:
        """A model was reloaded: its old scores are unreachable (the generation is in every cache key) and
        the entries are let go at once (the other models' too: a reload is rare, the cache refills)."""
        self.cache.clear()
        self.metrics.cache_bytes.set(0)
        self.metrics.cache_entries.set(0)

    async def reload(self, name: str | None = None, path: str | None = None) -> dict | None:
        """Load a model again (from `path`, or its own) beside the serving one and switch to it (see
        service.runtime.models); None: every model (SIGHUP; failures logged and counted). Raises
        ModelNotFound, ReloadBusy, or ReloadFailed (the old one still serves)."""
        if self._draining:
            raise NotReady("draining")
        return await self.models.reload(name, path)

    def listing(self) -> list[dict]:
        """GET /v1/models: each served model, the default first."""
        return [self.models.listing(m) for m in self.models]

    def describe(self) -> dict:
        """Everything /info shows: the default model (once loaded), the runtime, the worker, the settings,
        and every served model with its share of the cores."""
        m = self.worker.info
        s, rt = self.settings, self.runtime
        return {
            "model_id": self.models.default.name,
            "model_path": str(rt.model_dir),
            "levels": m.labels if m else [],
            "max_length": m.max_length if m else s.max_length,
            "device": str(m.device) if m else rt.device,
            "dtype": m.dtype if m else rt.dtype,
            "version": package_version(),
            "state": self.readiness()[1],
            "model": m.details if m else {},
            "worker": self.worker.describe(),
            "job_processes": self.models.job_processes(self.models.default),
            "cache": self.cache.describe() | {"generation": self.generation, "in_flight": len(self.flights)},
            "models": self.listing(),
            "shadow": self.models.shadow.describe() if self.models.shadow is not None else None,
            "settings": s.public(),
        }

    async def info(self) -> dict:
        """`describe` and the HTTP layout, as the routes ask for it (awaited: in a front process it is the
        engine core's answer, service.runtime.remote)."""
        return self.describe() | {"fronts": {"http_workers": 1, "chosen": resolve_http_workers(self.settings)[1]}}

    async def model_list(self) -> list[dict]:
        return self.listing()

    async def render_metrics(self) -> bytes:
        """The /metrics text: this process's registry (with fronts, the core merges every process's)."""
        return self.metrics.render()

    # --- scoring ------------------------------------------------------------------------------
    def _tokenizer_of(self, model: str | None, ready: bool) -> tuple[str, ModelInfo]:
        served = self.require_ready(model) if ready else self.models.get(model)
        return served.name, self._model(served.current)

    @staticmethod
    def _model(slot: Slot) -> ModelInfo:
        info = slot.info
        if info is None:
            raise NotReady("loading")
        return info

    def require_ready(self, model: str | None = None) -> Served:
        """The one refusal of work while the model named cannot take it (NotReady); the model otherwise."""
        if self._closed:
            raise NotReady("draining")
        return self.models.serving(model)

    def refuse_early(self) -> Overloaded | None:
        """A scoring request's refusal while admission is full, before its body is read (microseconds)."""
        return self.models.refuse_early()

    def refusal(self) -> Overloaded | None:
        """What refuse_early would answer now, counting nothing (the engine core tells its fronts)."""
        return self.models.refusal()

    def _admit(self, slot: Slot, pairs: int, priority: int) -> None:
        try:
            slot.batcher.check_admission(pairs, priority=priority)  # refuse before spending work
        except Overloaded:
            self.metrics.rejected.labels("overloaded").inc()
            raise

    async def score(
        self,
        queries: list[str],
        titles: list[str],
        truncation: str = "only_second",
        side: str = "right",
        timeout_ms: int | None = None,
        allow_truncation: bool = True,
        use_cache: bool = True,
        model: str | None = None,
        priority: str = "high",
        max_unknown: float | None = None,
        encoded: Encoded | None = None,
    ) -> Scored:
        """Score the pairs with the model named (None: the default), each distinct pair once: from the
        cache (unless `use_cache` is false: the caller asked for fresh scores, which are then cached),
        joining the same pair already in flight for another request, or forwarded. A sample of the
        default model's pairs is handed to the shadow model, if any, after the answer is known.
        `encoded`: the pairs as a front process tokenised them, with that model's load generation (Stale
        when the model was reloaded since). `priority`: "high" (interactive) or "low" (score jobs: forwarded
        only while no high work waits). `max_unknown`: refuse (Unreadable) a pair whose unknown share is over it,
        before any pair is forwarded."""
        served = self.require_ready(model)
        deadline = time.monotonic() + (timeout_ms or self.settings.request_timeout_ms) / 1000
        args = (queries, titles, truncation, side, deadline, allow_truncation, use_cache, priority_of(priority))
        async with served.hold(deadline) as slot:
            if encoded is not None and encoded.generation != slot.generation:
                raise Stale(served.name, slot.generation)
            scored = await self._score(served.name, slot, *args, encoded, max_unknown)
        if (shadow := self.models.shadow) is not None and served is self.models.default:
            shadow.offer(queries, titles, scored, truncation, side)
        return scored

    async def _score(  # the body of score, on the slot held
        self,
        name: str,
        slot: Slot,
        queries: list[str],
        titles: list[str],
        truncation: str,
        side: str,
        deadline: float,
        allow_truncation: bool,
        use_cache: bool,
        priority: int,
        pre: Encoded | None = None,
        max_unknown: float | None = None,
    ) -> Scored:
        model = self._model(slot)
        keys = [
            make_key(name, slot.generation, truncation, side, model.max_length, q, t) for q, t in zip(queries, titles)
        ]
        found: dict[Key, Cached] = {}
        flights: dict[Key, Flight] = {}
        look = use_cache and self.cache.enabled
        todo = self.lookup(slot, keys, look, priority, found, flights)  # key -> index of its first pair
        if todo:
            if pre is not None:
                enc = pre.pick(list(todo.values()))
            else:
                enc = await self._encode(
                    model, [queries[i] for i in todo.values()], [titles[i] for i in todo.values()], truncation, side
                )
            encoded = dict(
                zip(todo, zip(enc.lengths, zip(enc.input_ids, enc.token_type_ids), enc.truncated, enc.unknown))
            )
            for k in list(todo):  # while it was tokenised, another request may have queued the same pair
                if (f := self.flights.get(k)) is not None:
                    flights[k] = f
                    del todo[k]
        self._count(len(keys), len(found), len(flights), len(todo), look)
        if not allow_truncation:
            cut = {k: c.truncated for k, c in found.items()} | {k: f.truncated for k, f in flights.items()}
            cut |= {k: encoded[k][2] for k in todo}
            if (first := next((i for i, k in enumerate(keys) if cut[k]), None)) is not None:
                raise InputTooLong(first, model.max_length)
        if max_unknown is not None:
            unk = {k: c.unknown for k, c in found.items()} | {k: f.unknown for k, f in flights.items()}
            check_readable([unk[k] if k in unk else encoded[k][3] for k in keys], max_unknown)
        if todo:
            mine = self._submit(slot, [encoded[k][:2] for k in todo], deadline, priority)
            for k, fut in zip(todo, mine):
                n, payload, cut_, unknown = encoded[k]
                flights[k] = self.flights.start(k, Flight(fut, payload, n, cut_, deadline, unknown))
        if flights:
            await self._wait(slot, flights, deadline, priority)
        for k, f in flights.items():
            found[k] = Cached(f.future.result(), f.length, f.truncated, f.unknown)
        outputs = [found[k] for k in keys]
        self._series(self.metrics.pairs, name).inc(len(outputs))
        levels = model.labels
        for level, n in Counter(c.row[0] for c in outputs).items():  # a row's first byte is its level
            self._series(self.metrics.levels, name, levels[level]).inc(n)
        return Scored(
            [unpack_row(c.row) for c in outputs],
            [c.length for c in outputs],
            [c.truncated for c in outputs],
            model.labels,
            name,
            [c.unknown for c in outputs],
        )

    def _submit(self, slot: Slot, items: list[tuple[int, Any]], deadline: float, priority: int) -> list[asyncio.Future]:
        try:
            tag = f"request {request_id.get() or '-'}"
            return slot.batcher.submit(items, deadline, trace=self.tracing.context(), tag=tag, priority=priority)
        except Overloaded:
            self.metrics.rejected.labels("overloaded").inc()
            raise

    def _requeue(self, slot: Slot, deadline: float, priority: int) -> Callable[[Key, Flight], Flight]:
        def requeue(key: Key, old: Flight) -> Flight:
            (fut,) = self._submit(slot, [(old.length, old.payload)], deadline, priority)
            return Flight(fut, old.payload, old.length, old.truncated, deadline, old.unknown)

        return requeue

    async def _wait(self, slot: Slot, flights: dict[Key, Flight], deadline: float, priority: int) -> None:
        try:
            await self.flights.wait(flights, deadline, self._requeue(slot, deadline, priority))
        except DeadlineExceeded:
            self.metrics.rejected.labels("deadline").inc()
            raise
        except (Closed, Overloaded, asyncio.CancelledError):
            raise
        except Exception as e:  # the batch failed
            raise InferenceFailed(f"inference failed: {describe_error(e)}") from e

    def _count(self, pairs: int, hits: int, joined: int, forwarded: int, looked: bool) -> None:
        m = self.metrics
        if looked:
            m.cache_hits.inc(hits)
            m.cache_misses.inc(joined + forwarded)
        self._series(m.folded, "request").inc(pairs - hits - joined - forwarded)
        self._series(m.folded, "in_flight").inc(joined)

    def _series(self, metric: Any, *labels: str) -> Any:
        """metric.labels(*labels), remembered: prometheus_client's lookup costs more than the count."""
        key = (id(metric), labels)
        if (child := self._children.get(key)) is None:
            child = self._children[key] = metric.labels(*labels)
        return child

    def _landed(self, key: Key, flight: Flight) -> None:
        """A pair came back from the model: cache it (called once per pair), unless its generation is old."""
        if self.cache.enabled and self.models.generation_of(key[0]) == key[1]:
            self.metrics.cache_evictions.inc(
                self.cache.put(key, Cached(flight.future.result(), flight.length, flight.truncated, flight.unknown))
            )
            self.metrics.cache_bytes.set(self.cache.bytes)
            self.metrics.cache_entries.set(len(self.cache))

    async def explain(self, query: str, title: str, model: str | None = None, **options) -> dict:
        """model.explain.explain_pair on a model, between batches (the worker's "explain" job)."""
        served = self.require_ready(model)
        try:
            async with served.hold(time.monotonic() + self.settings.request_timeout_ms / 1000) as slot:
                return await slot.worker.job("explain", query, title, **options) | {"model": served.name}
        except Exception as e:
            self.require_ready(model)  # the worker stopped or drains since the check above
            raise InferenceFailed(f"explanation failed: {describe_error(e)}") from e
