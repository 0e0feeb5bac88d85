"""The engine core's per-frame path: the score requests a front sends in one frame are taken on the event
loop, each without a task of its own. One request is looked up (cache, single flight), admitted and
submitted at once; its distinct pairs' futures each call back when they land, and the last one answers it.
Nothing is awaited, so a request costs its bookkeeping and a callback per pair, not an asyncio task's
steps and wake-ups (docs/fronts-bench.md: the core's CPU per request fell by a fifth to a third).

The rules are `Engine.score`'s, kept here in step: readiness, the load generation (`Stale`), the cache and
single flight, promotion of joined low-priority pairs, admission (429), `allow_truncation`, the deadline (a
pair queued under an earlier request's deadline is queued again under this one's), the metrics, the shadow.
A model held by an in-place reload is the one case left to `Engine.score` (its requests wait on the
reload): `take` returns SLOW and the caller runs the awaited path.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from service.metrics import Metrics
from service.runtime.batcher import HIGH, Batcher, Closed, DeadlineExceeded, Overloaded, priority_of
from service.runtime.cache import Cached, Key, ScoreCache, make_key
from service.runtime.encoded import Encoded, Stale
from service.runtime.flight import Flight, Flights
from service.runtime.results import InferenceFailed, InputTooLong, Rows, scored_of
from service.runtime.workers.backend import BackendError
from service.settings import Settings

Reply = Callable[[BaseException | None, Rows | None], None]  # (error, or None and the answer)
SLOW = "slow"  # `take`: this request needs Engine.score's awaited path


def describe_error(e: BaseException) -> str:
    """A backend error says what failed in its own words; anything else is named by its type."""
    return str(e) if isinstance(e, BackendError) else f"{type(e).__name__}: {e}"


def failure(e: BaseException, metrics: Metrics) -> BaseException:
    """What a request whose pairs failed with `e` raises (Engine._wait's rule)."""
    if isinstance(e, DeadlineExceeded):
        metrics.rejected.labels("deadline").inc()
        return e
    if isinstance(e, Closed | Overloaded):
        return e
    return InferenceFailed(f"inference failed: {describe_error(e)}")


class Pending:
    """One request waiting on its pairs' flights: `left` of them have not landed."""

    __slots__ = (
        *("side", "reply", "closed", "waiting", "left", "served", "slot", "model", "args", "trace", "tag"),
        *("keys", "found", "flights", "deadline", "priority"),
    )
    served: Any
    slot: Any
    model: Any
    args: dict
    trace: Any
    tag: str
    keys: list[Key]
    found: dict[Key, Cached]  # (pairs answered by the cache)
    flights: dict[Key, Flight]
    deadline: float
    priority: int

    def __init__(self, side: FrameSide, reply: Reply):
        self.side = side
        self.reply = reply
        self.closed = False
        self.waiting = False
        self.left = 0

    def watch(self, key: Key, flight: Flight) -> None:
        if not flight.future.done():
            self.left += 1
            flight.watchers.append(self)  # told by the flight's one callback (service.runtime.flight)

    def landed(self, key: Key, fut: Any) -> None:
        if self.closed:
            return
        if fut.cancelled():  # only the batcher's shutdown cancels a pair still awaited
            return self.finish(Closed("the service is shutting down"))
        if (e := fut.exception()) is not None:
            old = self.flights[key]
            if not (isinstance(e, DeadlineExceeded) and old.deadline < self.deadline):
                return self.finish(e)
            flights = self.side.flights  # another request's deadline, not ours: queue it again under ours
            old.waiters -= 1
            new = flights.get(key)
            if new is None:
                try:
                    (f,) = self.side.submit(self.slot.batcher, [(old.length, old.payload)], self)
                except Exception as err:
                    return self.finish(err)
                new = flights.start(key, Flight(f, old.payload, old.length, old.truncated, self.deadline, old.unknown))
            new.waiters += 1
            self.flights[key] = new
            self.left -= 1
            self.watch(key, new)  # (a flight another request already brought home is not waited on)
        else:
            self.left -= 1
        if self.left == 0:
            self.finish(None)

    def finish(self, error: BaseException | None) -> None:
        self.closed = True
        side = self.side
        scored = None
        if error is None:
            try:
                scored = side.answer(self.served.name, self.model, self.keys, self.found, self.flights)
            except Exception as e:  # answered with the error: a request is never left waiting
                error = e
        if error is not None:
            error = failure(error, side.metrics)
        self.release()
        if scored is not None and (shadow := side.models.shadow) is not None and self.served is side.models.default:
            a = self.args
            shadow.offer(a["queries"], a["titles"], scored_of(scored, a.get("unk") or []), a["truncation"], a["side"])
        self.reply(error, scored)

    def cancel(self) -> None:
        """The client hung up: its pairs are let go (dropped before the device if nobody else waits)."""
        if not self.closed:
            self.closed = True
            self.release()

    def release(self) -> None:
        if self.waiting:  # the flights count this request among their waiters
            for f in self.flights.values():
                self.side.flights.leave(f)
        self.slot.users -= 1


class Turn:
    """What the requests of one frame share: the batchers they queued work on (whose gauges are reported once
    a frame) and each model they named, resolved once (readiness cannot change while a frame is taken: no
    await between its requests)."""

    __slots__ = ("models", "touched")

    def __init__(self) -> None:
        self.touched: set[Batcher] = set()
        self.models: dict[str | None, tuple[Any, Any, Any]] = {}

    def resolve(self, side: FrameSide, name: str | None) -> tuple[Any, Any, Any]:
        """(served, its serving slot, its model info), or (served, None, None) while an in-place reload
        holds it (SLOW). Raises what a request naming it would meet (NotReady, ModelNotFound)."""
        served = side.require_ready(name)
        if served.state() == "reloading":
            return served, None, None  # not remembered: an error or SLOW is the rare case
        slot = served.current
        got = self.models[name] = (served, slot, side._model(slot))
        return got


class FrameSide:
    """The engine's per-frame scoring (a mixin of service.runtime.engine.Engine)."""

    settings: Settings
    metrics: Metrics
    models: Any
    cache: ScoreCache
    flights: Flights
    require_ready: Callable[..., Any]
    _model: Callable[..., Any]
    _admit: Callable[..., None]
    _tally: dict[Any, int]  # metric series -> what to add at the end of this turn of the event loop
    _series: Callable[..., Any]
    _level_series: dict[str, tuple[list[str], list[Any]]]  # per model: its levels, and each level's series

    def take(self, a: dict, trace: Any, reply: Reply, turn: Turn) -> Pending | str | None:
        """Start scoring one request of a frame (the fields of service.runtime.remote's score frame).
        Returns its `Pending` (to cancel it), None if it was answered at once (a cache hit, an error), or
        SLOW. `turn`: what the frame's requests share (service.runtime.scoring.Turn)."""
        p = Pending(self, reply)
        try:
            served, slot, model = turn.models.get(a["model"]) or turn.resolve(self, a["model"])
            if slot is None:
                return SLOW
            if a["generation"] != slot.generation:
                raise Stale(served.name, slot.generation)
        except Exception as e:
            reply(e, None)
            return None
        slot.users += 1
        p.served, p.slot, p.model, p.args, p.trace, p.flights = served, slot, model, a, trace, {}
        p.tag = f"request {a['rid'] or '-'}"
        try:
            self._start(p, a, turn.touched)
        except Exception as e:
            p.closed = True
            p.release()
            reply(e, None)
            return None
        if p.left == 0:
            p.finish(None)
            return None
        return p

    def _start(self, p: Pending, a: dict, touched: set[Batcher]) -> None:
        name, slot, model = p.served.name, p.slot, p.model
        p.deadline = time.monotonic() + (a["timeout_ms"] or self.settings.request_timeout_ms) / 1000
        p.priority = priority = priority_of(a["priority"])
        gen, trunc, side_, n = slot.generation, a["truncation"], a["side"], model.max_length
        p.keys = keys = [make_key(name, gen, trunc, side_, n, q, t) for q, t in zip(a["queries"], a["titles"])]
        found: dict[Key, Cached] = {}
        p.found = found
        flights = p.flights
        look = a["use_cache"] and self.cache.enabled
        # admitted once, by the batcher's submit, its tokens known (the awaited path admits before tokenising too)
        todo = self.lookup(slot, keys, look, priority, found, flights, admit=False)
        enc = Encoded.pick_from(a["ids"], a["segs"], a["cut"], a.get("unk") or [], list(todo.values()))
        if not a["allow_truncation"]:
            cut = {k: c.truncated for k, c in found.items()} | {k: f.truncated for k, f in flights.items()}
            cut |= dict(zip(todo, enc.truncated))
            if (first := next((i for i, k in enumerate(keys) if cut[k]), None)) is not None:
                raise InputTooLong(first, n)
        if todo:
            items = list(zip(enc.lengths, zip(enc.input_ids, enc.token_type_ids)))
            futures = self.submit(slot.batcher, items, p, report=False)
            touched.add(slot.batcher)
            unknown = enc.unknown or [0.0] * len(items)
            for k, fut, (length, payload), cut_, unk in zip(todo, futures, items, enc.truncated, unknown):
                flights[k] = self.flights.start(k, Flight(fut, payload, length, cut_, p.deadline, unk))
        m, hits, joined, fresh = self.metrics, len(found), len(flights) - len(todo), len(todo)
        if look:
            self.tally(m.cache_hits, hits)
            self.tally(m.cache_misses, joined + fresh)
        if folded := len(keys) - hits - joined - fresh:
            self.tally(self._series(m.folded, "request"), folded)
        if joined:
            self.tally(self._series(m.folded, "in_flight"), joined)
        p.waiting = True
        for k, f in flights.items():
            f.waiters += 1
            p.watch(k, f)

    def lookup(
        self, slot: Any, keys: list[Key], look: bool, priority: int, found: dict, flights: dict, admit: bool = True
    ) -> dict[Key, int]:
        """Each distinct key into `found` (the cache's, when `look`), `flights` (in flight already) or the
        returned todo (key -> index of its first pair), which is admitted (unless not `admit`: the caller admits
        it); a high request promotes the flights it joins. Both scoring paths, the awaited one and the frame's,
        start here."""
        todo: dict[Key, int] = {}
        for i, k in enumerate(keys):
            if k in found or k in flights or k in todo:
                continue
            if look and (c := self.cache.get(k)) is not None:
                found[k] = c
            elif (f := self.flights.get(k)) is not None:
                flights[k] = f
            else:
                todo[k] = i
        if flights and priority == HIGH:  # a pair a low-priority request queued now waits for no one
            slot.batcher.promote([f.future for f in flights.values()])
        if todo and admit:
            self._admit(slot, len(todo), priority)
        return todo

    def submit(self, batcher: Batcher, items: list, p: Pending, report: bool = True) -> list:
        try:
            return batcher.submit(items, p.deadline, trace=p.trace, tag=p.tag, priority=p.priority, report=report)
        except Overloaded:
            self.metrics.rejected.labels("overloaded").inc()
            raise

    def answer(self, name: str, model: Any, keys: list[Key], found: dict[Key, Cached], flights: dict) -> Rows:
        """The answer from each pair's row (the cache's, or its flight's: as the model process packed it, never
        unpacked here), counted in the metrics (pairs, levels): a request's pairs read once."""
        rows, lengths, cut = [], [], []
        for k in keys:
            src: Cached | Flight
            if (c := found.get(k)) is not None:
                rows.append(c.row)
                src = c
            else:
                src = f = flights[k]
                rows.append(f.future.result())
            lengths.append(src.length)  # a Cached and a Flight name these alike
            cut.append(src.truncated)
        self.tally(self._series(self.metrics.pairs, name), len(rows))
        levels = model.labels
        series = self._level_series.get(name)
        if series is None or series[0] is not levels:
            series = self._level_series[name] = (levels, [self._series(self.metrics.levels, name, lv) for lv in levels])
        t, by_level = self._tally, series[1]
        if not t:
            asyncio.get_running_loop().call_soon(self._count_tally)
        for r in rows:
            s = by_level[r[0]]  # a row's first byte is its level
            t[s] = t.get(s, 0) + 1
        return b"".join(rows), lengths, cut, levels, name

    def tally(self, series: Any, n: int) -> None:
        """Add `n` to a metric series at the end of this turn of the event loop: one locked increment a
        series for a frame's requests, not one per request (prometheus_client takes a lock each)."""
        if n:
            t = self._tally
            if not t:
                asyncio.get_running_loop().call_soon(self._count_tally)
            t[series] = t.get(series, 0) + n

    def _count_tally(self) -> None:
        t, self._tally = self._tally, {}
        for series, n in t.items():
            series.inc(n)
