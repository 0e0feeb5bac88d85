"""The engine joins tokenisation, the batcher and the worker behind the calls HTTP needs: score these
pairs, explain this pair, are you ready, describe yourself.

It is handed its parts by the composition root (`service.app`): the resolved runtime, the worker and
the batcher; it decides nothing about where or how the model runs. It owns the one readiness function
and the one drain switch. Tokenisation of larger requests runs on its own thread, so it overlaps with
forward passes in the model processes; the event loop only awaits.

It knows nothing of HTTP: what goes wrong is raised as the runtime's own errors (below, and the
batcher's `Overloaded`, `Closed`, `DeadlineExceeded`, the backend's `NotReady`), which
`service.http.errors` maps to statuses in one place.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from model.chunks import split_pairs
from model.tokenizer import EncodedPairs, PairCut
from service.logs import request_id
from service.metrics import Metrics
from service.runtime.backend import BackendError, NotReady, State
from service.runtime.batcher import Batcher, Closed, DeadlineExceeded, Overloaded
from service.runtime.cache import Cached, Key, ScoreCache, make_key
from service.runtime.flight import Flight, Flights
from service.runtime.layout import Runtime, package_version
from service.runtime.windows import TooManyWindows, Windowed, WindowPick, flatten, reduce
from service.runtime.worker import ModelInfo, PairOutput, Worker
from service.settings import Settings
from service.tracing import Tracing

__all__ = [  # the errors HTTP maps (service.http.errors), with the engine's own
    "BackendError",
    "Closed",
    "DeadlineExceeded",
    "Engine",
    "InferenceFailed",
    "InputTooLong",
    "NotReady",
    "Overloaded",
    "Scored",
    "Tokenized",
    "TooManyWindows",
    "WindowPick",
    "Windowed",
]

log = logging.getLogger("qtrel.engine")

# Requests with at most this many pairs are tokenised on the event loop (see Engine.score).
INLINE_PAIRS = 4


@dataclass
class Scored:
    outputs: list[PairOutput]
    lengths: list[int]  # per pair, its tokens (special tokens included)
    truncated: list[bool]  # per pair, whether truncation cut it
    labels: list[str]  # the model's levels, in class order
    model: str  # the model's name


@dataclass
class Tokenized:
    """Pairs as the model sees them, and what was cut (`/tokenize`): no forward pass."""

    enc: EncodedPairs
    tokens: list[list[str]]  # per pair, the text of each id
    cuts: list[PairCut]  # per pair, what truncation kept and cut (ids)
    pieces: Callable[[Sequence[int]], list[str]]  # ids -> their word-piece texts
    max_length: int
    model: str


class InputTooLong(ValueError):
    """A pair longer than the model's window, where the caller asked for no truncation."""

    def __init__(self, index: int, max_length: int):
        super().__init__(f"input {index} is longer than the model's {max_length} tokens; set truncate=true")


class InferenceFailed(BackendError):
    """The forward pass (or an explanation) failed; only the requests of that batch fail."""


class Engine:
    def __init__(
        self,
        settings: Settings,
        runtime: Runtime,
        worker: Worker,
        batcher: Batcher,
        metrics: Metrics,
        tracing: Tracing | None = None,
    ):
        self.settings = settings
        self.tracing = tracing or Tracing()  # off: every call a no-op
        self.runtime = runtime
        self.worker = worker
        self.batcher = batcher
        self.metrics = metrics
        self._draining = False
        self.generation = 1  # the model's load generation: part of every cache key (a reload bumps it)
        self.cache = ScoreCache(settings.cache_mb * 2**20)
        self.flights = Flights(self._landed)
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="qtrel-tokenize")

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> str | None:
        """Load and warm up; None once serving, else why the model cannot be served (the caller exits)."""
        self.batcher.start()
        self.worker.start()
        await self.worker.wait_ready()
        if self.worker.state == State.READY:
            m = self._model()
            self.metrics.model_info.labels(m.name, str(m.device), m.dtype, package_version()).set(1)
            self.metrics.ready.set(1)
            return None
        if self.worker.state == State.FAILED:
            return f"model failed to load: {self.worker.error}"
        return None  # stopping before the model was up

    def readiness(self) -> tuple[bool, str]:
        """The one readiness rule: the model is loaded and warmed up, a model process serves, and the
        service is not draining. (ready, why) -- why is the state's name, or what failed."""
        if self._draining:
            return False, "draining"
        state = self.worker.state
        if state == State.FAILED:
            return False, f"model failed to load: {self.worker.error}"
        return state == State.READY, state.value

    def liveness(self) -> tuple[bool, str]:
        if loops := self.worker.crash_loops():
            return False, f"crash loop: model process {loops} restarted too often"
        return self.worker.alive(), self.worker.state.value

    def begin_drain(self) -> None:
        """Stop reporting ready and taking new work. The one writer of the drain state; safe to call
        from a signal handler (it only sets values)."""
        self._draining = True
        self.metrics.ready.set(0)

    async def drain(self, timeout: float) -> None:
        """Stop taking work; let admitted work finish (up to `timeout`)."""
        self.begin_drain()
        if not await self.batcher.drain(timeout):
            log.warning("drain timed out with %d pairs outstanding", self.batcher.outstanding)

    async def stop(self) -> None:
        await self.batcher.stop()
        await asyncio.to_thread(self.worker.stop)
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    def new_generation(self) -> int:
        """A new model (or the same one again) was loaded: nothing scored before is served (the generation
        is in every cache key) and the old entries are let go at once."""
        self.generation += 1
        self.cache.clear()
        self.metrics.cache_bytes.set(0)
        self.metrics.cache_entries.set(0)
        return self.generation

    def describe(self) -> dict:
        """Everything /info shows: the model (once loaded), the runtime, the worker, the settings."""
        m = self.worker.info
        s, rt = self.settings, self.runtime
        return {
            "model_id": m.name if m else rt.model_dir.name,
            "model_path": str(rt.model_dir),
            "levels": m.labels if m else [],
            "max_length": m.max_length if m else s.max_length,
            "device": str(m.device) if m else rt.device,
            "dtype": m.dtype if m else rt.dtype,
            "version": package_version(),
            "state": self.readiness()[1],
            "model": m.details if m else {},
            "worker": self.worker.describe(),
            "cache": self.cache.describe() | {"generation": self.generation, "in_flight": len(self.flights)},
            "settings": s.public(),
        }

    # --- scoring ------------------------------------------------------------------------------
    def _model(self) -> ModelInfo:
        info = self.worker.info
        if info is None:
            raise NotReady("loading")
        return info

    def require_ready(self) -> None:
        """The one refusal of work while no model can take it. Work is taken while a model serves, or
        while its processes restart (the work waits for them; its deadline and the queue's bounds still
        hold), so that a crash fails no request."""
        ok, why = self.readiness()
        if not ok and not (why == State.RESTARTING.value and self.worker.info is not None):
            raise NotReady(why)

    def refuse_early(self) -> Overloaded | None:
        """The refusal of a scoring request while admission is full, before its body is read or parsed:
        under overload, refusing costs microseconds and leaves the cores to the work admitted."""
        if not self.batcher.full():
            return None
        self.metrics.rejected.labels("overloaded").inc()
        return Overloaded("pairs", self.batcher.retry_after())

    def _admit(self, pairs: int) -> None:
        try:
            self.batcher.check_admission(pairs)  # refuse before spending work
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
    ) -> Scored:
        """Score the pairs, each distinct one once: from the cache (unless `use_cache` is false: the
        caller asked for fresh scores, which are then cached), joining the same pair already in flight
        for another request, or forwarded."""
        self.require_ready()
        deadline = time.monotonic() + (timeout_ms or self.settings.request_timeout_ms) / 1000
        model = self._model()
        keys = [
            make_key(model.name, self.generation, truncation, side, model.max_length, q, t)
            for q, t in zip(queries, titles)
        ]
        found: dict[Key, Cached] = {}
        flights: dict[Key, Flight] = {}
        todo: dict[Key, int] = {}  # key -> index of its first pair
        look = use_cache and self.cache.enabled
        for i, k in enumerate(keys):
            if k in found or k in flights or k in todo:
                continue
            if look and (c := self.cache.get(k)) is not None:
                found[k] = c
            elif (f := self.flights.get(k)) is not None:
                flights[k] = f
            else:
                todo[k] = i
        if todo:
            self._admit(len(todo))
            enc = await self._encode(
                model, [queries[i] for i in todo.values()], [titles[i] for i in todo.values()], truncation, side
            )
            encoded = dict(zip(todo, zip(enc.lengths, zip(enc.input_ids, enc.token_type_ids), enc.truncated)))
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
        if todo:
            mine = self._submit([encoded[k][:2] for k in todo], deadline)
            for k, fut in zip(todo, mine):
                n, payload, cut_ = encoded[k]
                flights[k] = self.flights.start(k, Flight(fut, payload, n, cut_, deadline))
        if flights:
            await self._wait(flights, deadline)
        for k, f in flights.items():
            found[k] = Cached(f.future.result(), f.length, f.truncated)
        outputs = [found[k] for k in keys]
        self.metrics.pairs.inc(len(outputs))
        for c in outputs:
            self.metrics.levels.labels(model.labels[c.output.level]).inc()
        return Scored(
            [c.output for c in outputs],
            [c.length for c in outputs],
            [c.truncated for c in outputs],
            model.labels,
            model.name,
        )

    async def score_windows(
        self, queries: list[str], titles: list[str], max_chunks: int, overlap: int | None = None, **options
    ) -> Windowed:
        """`score`, each title longer than the model's window split into at most `max_chunks` windows that
        share `overlap` tokens (default: the chunk_overlap setting); a title gets its best window's scores
        (service.runtime.windows). The windows count against max_pairs_per_request."""
        self.require_ready()
        n = self.settings.chunk_overlap if overlap is None else overlap
        args = (self._model().tokenizer, queries, titles, max_chunks, n)
        if len(titles) <= INLINE_PAIRS:
            docs = split_pairs(*args)
        else:
            docs = await asyncio.get_running_loop().run_in_executor(self._tok_pool, split_pairs, *args)
        if (windows := sum(map(len, docs))) > self.settings.max_pairs_per_request:
            raise TooManyWindows(windows, self.settings.max_pairs_per_request)
        s = await self.score(*flatten(queries, docs), **options)
        return reduce(s.outputs, s.lengths, s.truncated, docs, s.labels, s.model)

    async def _encode(
        self, model: ModelInfo, queries: list[str], titles: list[str], truncation: str, side: str
    ) -> EncodedPairs:
        t0 = time.perf_counter()
        tok = model.tokenizer
        with self.tracing.span("qtrel.tokenize", pairs=len(queries)) as span:
            if len(queries) <= INLINE_PAIRS:  # ~50 us: cheaper here than a hop to the tokeniser thread
                enc = tok.encode(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            else:
                enc = await asyncio.get_running_loop().run_in_executor(
                    self._tok_pool,
                    lambda: tok.encode(queries, titles, truncation=truncation, side=side),  # type: ignore[arg-type]
                )
            span.set_attribute("qtrel.tokens", sum(enc.lengths))
        self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        return enc

    def _submit(self, items: list[tuple[int, Any]], deadline: float) -> list[asyncio.Future]:
        try:
            return self.batcher.submit(
                items, deadline, trace=self.tracing.context(), tag=f"request {request_id.get() or '-'}"
            )
        except Overloaded:
            self.metrics.rejected.labels("overloaded").inc()
            raise

    def _requeue(self, deadline: float) -> Callable[[Key, Flight], Flight]:
        def requeue(key: Key, old: Flight) -> Flight:
            (fut,) = self._submit([(old.length, old.payload)], deadline)
            return Flight(fut, old.payload, old.length, old.truncated, deadline)

        return requeue

    async def _wait(self, flights: dict[Key, Flight], deadline: float) -> None:
        try:
            await self.flights.wait(flights, deadline, self._requeue(deadline))
        except DeadlineExceeded:
            self.metrics.rejected.labels("deadline").inc()
            raise
        except (Closed, Overloaded, asyncio.CancelledError):
            raise
        except Exception as e:  # the batch failed
            raise InferenceFailed(f"inference failed: {_describe(e)}") from e

    def _count(self, pairs: int, hits: int, joined: int, forwarded: int, looked: bool) -> None:
        m = self.metrics
        if looked:
            m.cache_hits.inc(hits)
            m.cache_misses.inc(joined + forwarded)
        m.folded.labels("request").inc(pairs - hits - joined - forwarded)
        m.folded.labels("in_flight").inc(joined)

    def _landed(self, key: Key, flight: Flight) -> None:
        """A pair came back from the model: cache it (the flight table calls this once per pair)."""
        if self.cache.enabled:
            self.metrics.cache_evictions.inc(
                self.cache.put(key, Cached(flight.future.result(), flight.length, flight.truncated))
            )
            self.metrics.cache_bytes.set(self.cache.bytes)
            self.metrics.cache_entries.set(len(self.cache))

    async def tokenize(
        self, queries: list[str], titles: list[str], truncation: str = "only_second", side: str = "right"
    ) -> Tokenized:
        """The pairs' tokens under these truncation options, and what truncation kept and cut."""
        model = self._model()
        tok = model.tokenizer

        def work() -> Tokenized:
            enc, cuts = tok.explain_truncation(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            return Tokenized(
                enc, [tok.tokens(ids) for ids in enc.input_ids], cuts, tok.tokens, model.max_length, model.name
            )

        if len(queries) <= INLINE_PAIRS:
            return work()
        return await asyncio.get_running_loop().run_in_executor(self._tok_pool, work)

    async def explain(self, query: str, title: str, **options) -> dict:
        """model.explain.explain_pair on a model, between batches (the worker's "explain" job)."""
        self.require_ready()
        try:
            return await self.worker.job("explain", query, title, **options)
        except Exception as e:
            self.require_ready()  # the worker stopped or drains since the check above
            raise InferenceFailed(f"explanation failed: {_describe(e)}") from e


def _describe(e: Exception) -> str:
    """A backend error says what failed in its own words; anything else is named by its type."""
    return str(e) if isinstance(e, BackendError) else f"{type(e).__name__}: {e}"
