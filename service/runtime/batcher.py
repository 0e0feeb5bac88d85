"""Dynamic batcher: the only owner of the queue.

It knows nothing of HTTP or BERT: it batches items that have a token length. Batches are formed under
a padded-token budget (longest x count), a size cap and a short wait for the batch to fill; the items
of a window are sorted by length so that padding stays small, and the batch that holds the oldest item
goes first, so nothing starves. Small requests go first: an item counts as having arrived later by
SMALL_FIRST_S per pair of the request it came with (at most SMALL_FIRST_MAX_S later), so a one-pair
request does not queue behind a 200-pair one that arrived a moment before it (and, if that one's client
hangs up, its pairs are dropped before they take the model). Work whose caller has gone (cancelled
future) or whose deadline has passed is dropped before it reaches the device. Admission is bounded by
items and tokens outstanding.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

log = logging.getLogger("qtrel.batcher")

SMALL_FIRST_S = 0.002  # seconds of precedence lost per pair of the submitting request
SMALL_FIRST_MAX_S = 0.4  # the most a big request's items are held back: nothing starves


class Overloaded(Exception):
    def __init__(self, reason: str, retry_after: float):
        super().__init__(f"queue full ({reason}); retry in {retry_after:.0f}s")
        self.reason = reason
        self.retry_after = retry_after


class DeadlineExceeded(Exception):
    pass


class Closed(Exception):
    """The batcher is draining and takes no new work."""


class BatchObserver(Protocol):
    def queued(self, items: int, in_flight: int) -> None: ...
    def dispatched(self, waits: Sequence[float], lengths: Sequence[int]) -> None: ...
    def dropped(self, reason: str, n: int) -> None: ...


class _NoObserver:
    def queued(self, items, in_flight):
        pass

    def dispatched(self, waits, lengths):
        pass

    def dropped(self, reason, n):
        pass


class BatchTracer(Protocol):
    """Told each traced batch's timings (monotonic seconds) after it ran; `traces` are the opaque contexts
    given to `submit`, aligned with `enqueued` and `lengths`. service.tracing turns them into spans."""

    def batch(
        self,
        traces: Sequence[Any],
        enqueued: Sequence[float],
        started: float,
        ended: float,
        lengths: Sequence[int],
        error: BaseException | None,
    ) -> None: ...


@dataclass(eq=False)
class Item:
    length: int
    payload: Any
    future: asyncio.Future
    deadline: float | None  # monotonic seconds
    enqueued: float = field(default_factory=time.monotonic)
    trace: Any = None  # the submitter's trace context, for the BatchTracer only
    tag: str | None = None  # the submitter's name for its work (a request id), for logs only
    rank: float = 0.0  # the order batches are formed in: arrival, later for items of bigger requests


def padded_tokens(lengths: Sequence[int]) -> int:
    return max(lengths) * len(lengths) if lengths else 0


def plan_batch(window: Sequence[Item], max_tokens: int, max_size: int) -> list[Item]:
    """From a window in rank order (arrival, small requests first), the length-sorted run of items that
    holds the first one and
    fits `max_tokens` padded tokens and `max_size` items."""
    oldest = window[0]
    ordered = sorted(window, key=lambda it: it.length)
    batches: list[list[Item]] = [[]]
    for it in ordered:
        cur = batches[-1]
        if cur and (it.length * (len(cur) + 1) > max_tokens or len(cur) >= max_size):
            batches.append([])
        batches[-1].append(it)
    return next(b for b in batches if any(it is oldest for it in b))


class Batcher:
    """`run` returns one result per item, in order; a result that is an exception fails its item alone."""

    def __init__(
        self,
        run: Callable[[list[Any]], Awaitable[list[Any]]],
        max_batch_tokens: int,
        max_batch_size: int,
        max_wait_s: float,
        max_queue_items: int,
        max_queue_tokens: int,
        observer: BatchObserver | None = None,
        concurrency: int = 1,
        tracer: BatchTracer | None = None,
    ):
        """`concurrency`: batches handed to `run` at once (one per model replica). The next batch is
        formed only when a slot is free, so that it takes everything that arrived meanwhile. `tracer`:
        told the timings of each batch that holds traced items (None: tracing off, nothing is done)."""
        self._tracer = tracer
        self._run = run
        self.concurrency = concurrency
        self._slots = asyncio.Semaphore(concurrency)
        self._running: set[asyncio.Task] = set()
        self.max_batch_tokens = max_batch_tokens
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue_items = max_queue_items
        self.max_queue_tokens = max_queue_tokens
        self._obs = observer or _NoObserver()
        self._pending: deque[Item] = deque()
        self._wake = asyncio.Event()
        self._outstanding_items = 0  # admitted and not yet resolved: queued + on the device
        self._outstanding_tokens = 0
        self._closed = False
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        self._rate = 0.0  # items per second, moving average, for Retry-After

    # --- admission ----------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return self._outstanding_items

    def retry_after(self) -> float:
        backlog = self._outstanding_items
        return max(1.0, math.ceil(backlog / self._rate)) if self._rate > 0 else 1.0

    def full(self) -> bool:
        """Nothing more can be admitted now: not even one item."""
        return self._outstanding_items >= self.max_queue_items or self._outstanding_tokens >= self.max_queue_tokens

    def check_admission(self, items: int, tokens: int = 0) -> None:
        """Raise Overloaded (or Closed) if `items` more could not be admitted now."""
        if self._closed:
            raise Closed("draining: no new work is accepted")
        if self._outstanding_items + items > self.max_queue_items:
            raise Overloaded("pairs", self.retry_after())
        if tokens and self._outstanding_tokens + tokens > self.max_queue_tokens:
            raise Overloaded("tokens", self.retry_after())

    def submit(
        self,
        work: Sequence[tuple[int, Any]],
        deadline: float | None = None,
        trace: Any = None,
        tag: str | None = None,
    ) -> list[asyncio.Future]:
        """Queue (length, payload) items; returns one future per item, resolved with its result. `trace`:
        an opaque context handed back to the tracer with this work's batch timings; `tag` names the work
        in the log line of an item that fails alone."""
        if any(length > self.max_batch_tokens for length, _ in work):
            raise ValueError(f"an item is longer than max_batch_tokens ({self.max_batch_tokens})")
        self.check_admission(len(work), sum(length for length, _ in work))
        loop = asyncio.get_running_loop()
        futures = []
        now = time.monotonic()
        rank = now + min(SMALL_FIRST_MAX_S, SMALL_FIRST_S * len(work))
        for length, payload in work:
            fut = loop.create_future()
            self._pending.append(Item(length, payload, fut, deadline, now, trace, tag, rank))
            futures.append(fut)
        self._outstanding_items += len(work)
        self._outstanding_tokens += sum(length for length, _ in work)
        self._idle.clear()
        self._obs.queued(len(self._pending), self._outstanding_items)
        self._wake.set()
        return futures

    # --- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="qtrel-batcher")

    async def drain(self, timeout: float | None = None) -> bool:
        """Stop admitting; wait until every admitted item is resolved. True if drained in time."""
        self._closed = True
        self._wake.set()
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
            return True
        except TimeoutError:
            return False

    async def stop(self) -> None:
        self._closed = True
        for task in [self._task, *self._running]:
            if task:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        for it in self._pending:
            if not it.future.done():
                it.future.set_exception(Closed("the service is shutting down"))
        self._pending.clear()

    # --- the loop -----------------------------------------------------------------------------
    def _release(self, items: Sequence[Item]) -> None:
        self._outstanding_items -= len(items)
        self._outstanding_tokens -= sum(it.length for it in items)
        if self._outstanding_items == 0:
            self._idle.set()
        self._obs.queued(len(self._pending), self._outstanding_items)

    def _prune(self) -> None:
        """Drop items whose caller left or whose deadline passed; they never reach the device."""
        now = time.monotonic()
        keep: deque[Item] = deque()
        gone, late = [], []
        for it in self._pending:
            if it.future.done():
                gone.append(it)
            elif it.deadline is not None and now >= it.deadline:
                it.future.set_exception(DeadlineExceeded("deadline passed while queued"))
                late.append(it)
            else:
                keep.append(it)
        if gone or late:
            self._pending = keep
            self._release(gone + late)
            if gone:
                self._obs.dropped("cancelled", len(gone))
            if late:
                self._obs.dropped("deadline", len(late))

    async def _wait_to_fill(self) -> None:
        """Wait until the pending work fills a batch or the oldest item has waited max_wait."""
        while self._pending:
            lengths = [it.length for it in self._pending]
            if padded_tokens(lengths) >= self.max_batch_tokens or len(lengths) >= self.max_batch_size:
                return
            left = self._pending[0].enqueued + self.max_wait_s - time.monotonic()
            if left <= 0 or self._closed:
                return
            self._wake.clear()
            try:
                await asyncio.wait_for(self._wake.wait(), left)
            except TimeoutError:
                return

    async def _loop(self) -> None:
        while True:
            if not self._pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            await self._slots.acquire()  # a replica is free: now form the batch
            try:
                await self._wait_to_fill()
                self._prune()
            except BaseException:
                self._slots.release()
                raise
            if not self._pending:
                self._slots.release()
                continue
            window = heapq.nsmallest(self.max_batch_size * 4, self._pending, key=lambda it: it.rank)
            batch = plan_batch(window, self.max_batch_tokens, self.max_batch_size)
            chosen = set(map(id, batch))
            self._pending = deque(it for it in self._pending if id(it) not in chosen)
            now = time.monotonic()
            self._obs.dispatched([now - it.enqueued for it in batch], [it.length for it in batch])
            self._obs.queued(len(self._pending), self._outstanding_items)
            task = asyncio.create_task(self._dispatch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _dispatch(self, batch: list[Item]) -> None:
        t0 = time.monotonic()
        error: BaseException | None = None
        try:
            results = await self._run([it.payload for it in batch])
            for it, res in zip(batch, results, strict=True):
                if it.future.done():
                    continue
                if isinstance(res, BaseException):  # this item failed alone; the others have results
                    log.error("an item of %s failed alone: %s", it.tag or "untagged work", res)
                    it.future.set_exception(res)
                else:
                    it.future.set_result(res)
        except asyncio.CancelledError as e:
            error = e
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(Closed("the service is shutting down"))
            raise
        except Exception as e:  # fails only this batch; the loop keeps serving
            error = e
            log.error("batch of %d failed: %s", len(batch), e, exc_info=e)
            for it in batch:
                if not it.future.done():
                    it.future.set_exception(e)
        finally:
            self._slots.release()
            t1 = time.monotonic()
            dt = t1 - t0
            if self._tracer is not None and any(it.trace is not None for it in batch):
                self._trace(batch, t0, t1, error)
            if dt > 0:  # items per second over all slots, for Retry-After
                inst = len(batch) / dt * self.concurrency
                self._rate = inst if self._rate == 0 else 0.8 * self._rate + 0.2 * inst
            self._release(batch)

    def _trace(self, batch: list[Item], started: float, ended: float, error: BaseException | None) -> None:
        assert self._tracer is not None
        try:
            self._tracer.batch(
                [it.trace for it in batch],
                [it.enqueued for it in batch],
                started,
                ended,
                [it.length for it in batch],
                error,
            )
        except Exception as e:  # tracing never fails a batch
            log.warning("batch tracer failed: %s", e)
