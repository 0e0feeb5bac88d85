"""Single flight: a pair queued or being forwarded is computed once, whoever else asks for it meanwhile.

A `Flight` is one distinct pair submitted to the batcher: its future, what the tokenizer saw (its token
ids, length and truncation flag), the deadline it was queued under and how many requests wait on it. A
request that needs a pair already in flight joins it instead of queueing the pair again. The batcher's
future is cancelled (and the pair dropped before the device) only when the last request waiting on it
leaves; a pair that missed another request's earlier deadline is queued again under the waiter's own.
Event loop only.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from typing import Any

from service.runtime.batcher import Closed, DeadlineExceeded
from service.runtime.cache import Key

log = logging.getLogger("qtrel.flight")


class Flight:
    """One distinct pair submitted to the batcher (a plain class with slots: the engine core makes one a pair)."""

    __slots__ = ("deadline", "future", "length", "payload", "truncated", "unknown", "waiters", "watchers")

    def __init__(
        self,
        future: asyncio.Future,
        payload: Any,  # (input_ids, token_type_ids): what a resubmission queues again
        length: int,
        truncated: bool,
        deadline: float,  # monotonic seconds: the deadline the pair was queued under
        unknown: float = 0.0,  # the share of its text the model cannot read (EncodedPairs.unknown)
        waiters: int = 0,
    ):
        self.future = future
        self.payload = payload
        self.length = length
        self.truncated = truncated
        self.deadline = deadline
        self.unknown = unknown
        self.waiters = waiters
        # told `landed(key, future)` once the pair is done (and cached): the engine core's requests, which
        # wait without a task (service.runtime.scoring)
        self.watchers: list = []


class Flights:
    """The pairs in flight, by key. `on_result(key, flight)` is called once per pair forwarded."""

    def __init__(self, on_result: Callable[[Key, Flight], None]):
        self._in_flight: dict[Key, Flight] = {}
        self._on_result = on_result

    def __len__(self) -> int:
        return len(self._in_flight)

    def get(self, key: Key) -> Flight | None:
        """The pair's flight, if it is queued, being forwarded, or done with a result not yet taken."""
        f = self._in_flight.get(key)
        if f is None or (f.future.done() and (f.future.cancelled() or f.future.exception() is not None)):
            return None
        return f

    def start(self, key: Key, flight: Flight) -> Flight:
        self._in_flight[key] = flight
        flight.future.add_done_callback(partial(self._landed, key, flight))  # no Python frame of its own
        return flight

    def _landed(self, key: Key, flight: Flight, _: Any = None) -> None:
        if self._in_flight.get(key) is flight:
            del self._in_flight[key]
        if not flight.future.cancelled() and flight.future.exception() is None:
            self._on_result(key, flight)
        watchers, flight.watchers = flight.watchers, []  # no cycle left for the GC (a watcher holds the flight)
        for w in watchers:
            try:
                w.landed(key, flight.future)
            except Exception:  # one watcher's failure must not leave the others waiting
                log.exception("a waiter on a pair failed")

    async def wait(
        self,
        flights: dict[Key, Flight],
        deadline: float,
        requeue: Callable[[Key, Flight], Flight],
    ) -> None:
        """Wait until every flight has its result (`flights` is updated in place with requeued ones);
        raise the first failure. Leaving (cancelled, or failed) lets go of every flight waited on."""
        for f in flights.values():
            f.waiters += 1
        try:
            while True:
                await _all_or_failure({f.future for f in flights.values()})
                again = []
                for key, f in flights.items():
                    if not f.future.done():
                        continue
                    if f.future.cancelled():  # only the batcher's shutdown cancels a pair still awaited
                        raise Closed("the service is shutting down")
                    e = f.future.exception()
                    if isinstance(e, DeadlineExceeded) and f.deadline < deadline:
                        again.append(key)  # another request's deadline, not ours
                    elif e is not None:
                        raise e
                if not again:
                    if all(f.future.done() for f in flights.values()):
                        return
                    continue
                for key in again:
                    old = flights[key]
                    old.waiters -= 1
                    new = self.get(key) or self.start(key, requeue(key, old))
                    new.waiters += 1
                    flights[key] = new
        finally:
            for f in flights.values():
                self.leave(f)

    def leave(self, flight: Flight) -> None:
        flight.waiters -= 1
        if flight.future.done():
            if not flight.future.cancelled():
                flight.future.exception()  # a failure the leaving request saw: asyncio need not warn of it
        elif flight.waiters <= 0:
            flight.future.cancel()  # nobody waits for it any more: the batcher drops it


async def _all_or_failure(futures: set[asyncio.Future]) -> None:
    """asyncio.wait(futures, return_when=FIRST_EXCEPTION) without its task-side machinery: one waiter and
    one callback (the engine core runs this once per request; asyncio.wait cost it ~4% of its CPU)."""
    pending = [f for f in futures if not f.done()]
    if len(pending) < len(futures) and any(
        f.done() and not f.cancelled() and f.exception() is not None for f in futures
    ):
        return
    if not pending:
        return
    waiter = asyncio.get_running_loop().create_future()
    left = len(pending)

    def landed(f: asyncio.Future) -> None:
        nonlocal left
        left -= 1
        if not waiter.done() and (left == 0 or (not f.cancelled() and f.exception() is not None)):
            waiter.set_result(None)

    for f in pending:
        f.add_done_callback(landed)
    try:
        await waiter
    finally:
        for f in pending:
            f.remove_done_callback(landed)
