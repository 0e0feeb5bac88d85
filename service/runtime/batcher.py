"""Dynamic batcher: the only owner of the queue.

It knows nothing of HTTP or BERT: it batches items that have a token length. Batches are formed under a padded-token
budget (longest x count), a size cap and a short wait for the batch to fill; the items of a window are sorted by
length so that padding stays small, and the batch that holds the item due first goes first. The order is fair between
requests (`batching.due`): a one-pair request goes into the next batch however much a big request just before it
queued; equal requests go in arrival order; nothing starves. Work whose caller has gone or whose deadline has passed
is dropped before it reaches the device.

Two priority classes: "high" (interactive, the default) always goes first; "low" (score jobs, or a request that says
so) forms batches only when no high work is queued, so that it fills the model processes live traffic leaves idle and
yields within one batch. A batch holds one class.

Given a `pace` (service.runtime.pace: the model's measured rate), a batch is also bounded in time while a request
bigger than about `max_batch_s` of one process's work is queued: it holds that much work at most, so that a big
request (or one whose client is gone) holds a process for that long at most before a small one gets its turn. Small
requests alone fill a batch up to max_batch_tokens: each is served whole in its turn, and splitting them would only
add each batch's fixed cost (docs/batcher-bench.md). Admission is bounded by items and tokens outstanding and, once
the rate is measured, by the expected wait: work whose queue ahead (what would be served before it) would take longer
than `max_queue_wait_s` is refused, with a Retry-After from the rate (service.runtime.admission).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from itertools import filterfalse
from typing import Any

from service.runtime.admission import Admission
from service.runtime.batching import (
    HIGH,
    LOW,
    PRIORITIES,
    BatchObserver,
    BatchTracer,
    Closed,
    DeadlineExceeded,
    Gone,
    Item,
    ItemFuture,
    Meter,
    NoObserver,
    Overloaded,
    Queued,
    by_length,
    due,
    fail,
    form_batch,
    padded_tokens,
    plan_batch,
    priority_of,
    settle,
    sweep,
    trace_batch,
)

# the queue's vocabulary (service.runtime.batching), re-exported: its users import it from here
__all__ = ["PRIORITIES", "Batcher", "Closed", "DeadlineExceeded", "Item", "Overloaded", "padded_tokens", "plan_batch"]
__all__ += ["priority_of", "BatchObserver", "BatchTracer", "Meter"]

log = logging.getLogger("qtrel.batcher")


class Batcher(Admission):
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
        pace: Meter | None = None,
        max_queue_wait_s: float = 0.0,
        max_batch_s: float = 0.0,
        on_change: Callable[[], None] | None = None,
    ):
        """`concurrency`: batches handed to `run` at once (one per model replica). The next batch is
        formed only when a slot is free, so that it takes everything that arrived meanwhile. `tracer`:
        told the timings of each batch that holds traced items (None: tracing off, nothing is done).
        `pace`: the model's measured rate, told every finished batch; with it, `max_queue_wait_s` (0: off)
        bounds the expected wait at admission and `max_batch_s` (0: off) a batch's time. `on_change`: told once
        in each turn of the event loop that changed the queue (work queued, a batch formed or finished, work dropped),
        after the gauges."""
        self._on_change = on_change
        self.pace = pace
        self.max_queue_wait_s = max_queue_wait_s
        self.max_batch_s = max_batch_s
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
        self._obs = observer or NoObserver()
        self._pending: deque[Item] = deque()
        self._queued = Queued(len(PRIORITIES))  # its tokens per class and tag
        self._wake = asyncio.Event()
        self._report_due = False
        # Per class (PRIORITIES): admitted and not yet resolved (queued + on the device), and on the device.
        self._items, self._tokens = [0, 0], [0, 0]
        self._flying, self._flying_tokens = [0, 0], [0, 0]
        self._clock = 0  # tokens dispatched so far: the fair order's clock (batching.due)
        # what _prune needs to know without a walk: queued futures cancelled since the last walk, and a deadline
        # no queued item's is before (the earliest at that walk, or a later submission's)
        self._gone, self._earliest = Gone(), math.inf
        self.walks = 0  # the queue's walks for gone or late work (tests count them)
        self._closed = False
        self._task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    # --- admission ----------------------------------------------------------------------------
    @property
    def outstanding(self) -> int:
        return sum(self._items)

    def queued(self, priority: int) -> int:
        """Items of a class waiting for a batch."""
        return self._items[priority] - self._flying[priority]

    @property
    def running(self) -> int:
        """Batches handed to the model processes and not finished (score jobs fill the processes left idle)."""
        return len(self._running)

    def promote(self, futures: Sequence[asyncio.Future]) -> None:
        """Queued lower-class items of these futures move to the first class (a high request joined them)."""
        if not self.queued(LOW):
            return
        wanted = {id(f) for f in futures}
        for it in self._pending:
            if it.priority != HIGH and id(it.future) in wanted:
                self._count(it, -1)
                self._queued.take([it])
                it.priority = HIGH
                self._count(it, 1)
                self._queued.put(HIGH, it.rank, it.length)
        self._report()

    def _count(self, it: Item, sign: int) -> None:
        self._items[it.priority] += sign
        self._tokens[it.priority] += sign * it.length

    def _report(self) -> None:
        # the gauges once per event-loop turn, however many requests it queued (a scrape sees the same)
        if not self._report_due:
            self._report_due = True
            (self._task.get_loop() if self._task else asyncio.get_running_loop()).call_soon(self._report_now)

    def _report_now(self) -> None:
        self._report_due = False
        self._obs.queued(len(self._pending), self.outstanding)
        self._obs.depths([self.queued(c) for c in range(len(PRIORITIES))])
        if self._on_change is not None:
            self._on_change()

    def submit(
        self,
        work: Sequence[tuple[int, Any]],
        deadline: float | None = None,
        trace: Any = None,
        tag: str | None = None,
        priority: int = HIGH,
        report: bool = True,
    ) -> list[asyncio.Future]:
        """Queue (length, payload) items; returns one future per item, resolved with its result. `trace`:
        an opaque context handed back to the tracer with this work's batch timings; `tag` names the work
        in the log line of an item that fails alone; `priority` its class (an index in PRIORITIES).
        `report`: False leaves the queue's gauges to one `report()` after several submissions."""
        if any(length > self.max_batch_tokens for length, _ in work):
            raise ValueError(f"an item is longer than max_batch_tokens ({self.max_batch_tokens})")
        self.check_admission(len(work), sum(length for length, _ in work), priority)
        loop = self._task.get_loop() if self._task else asyncio.get_running_loop()  # get_running_loop: a getpid
        futures: list[asyncio.Future] = []
        gone = self._gone
        if deadline is not None and deadline < self._earliest:
            self._earliest = deadline
        now = time.monotonic()
        tokens = sum(n for n, _ in work)
        rank = due(self._clock, tokens)
        for length, payload in work:
            fut = ItemFuture(loop=loop)
            fut.gone = gone
            it = Item(length, payload, fut, deadline, now, trace, tag, rank, priority, tokens)
            self._pending.append(it)
            self._count(it, 1)
            futures.append(fut)
        self._queued.put(priority, rank, tokens)
        self._idle.clear()
        if report:
            self._report()
        self._wake.set()
        return futures

    def report(self) -> None:  # the queue's depths, after submissions made with report=False
        self._report()

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
        fail(self._pending, Closed("the service is shutting down"))  # as a batch cancelled on the device
        self._pending.clear()
        self._queued = Queued(len(PRIORITIES))

    # --- the loop -----------------------------------------------------------------------------
    def _release(self, items: Sequence[Item]) -> None:
        for it in items:
            self._count(it, -1)
        if self.outstanding == 0:
            self._idle.set()
        self._report()

    def _prune(self) -> bool:
        """Drop items whose caller left or whose deadline passed; they never reach the device. True if any. The
        queue is walked only when a queued future was cancelled or the earliest deadline may have passed."""
        now = time.monotonic()
        if not self._gone.n and now < self._earliest:
            return False
        self.walks += 1
        keep, gone, late, self._earliest = sweep(self._pending, now)
        self._gone.n = 0
        if not gone and not late:
            return False
        self._pending = keep
        self._queued.take(gone + late)
        self._release(gone + late)
        if gone:
            self._obs.dropped("cancelled", len(gone))
        if late:
            self._obs.dropped("deadline", len(late))
        return True

    def batch_tokens(self) -> int:
        """A time-bounded batch's padded tokens now (and the work of a request bigger than one): max_batch_tokens,
        or about max_batch_s of one process's work."""
        if self.pace is None or self.max_batch_s <= 0:
            return self.max_batch_tokens
        return self.pace.batch_tokens(self.max_batch_s, self.max_batch_tokens)

    async def _wait_to_fill(self, budget: int) -> None:
        """Wait until the pending work fills a batch or the oldest item has waited max_wait."""
        while pending := self._pending:
            if len(pending) >= self.max_batch_size or padded_tokens(list(map(by_length, pending))) >= budget:
                return  # (no walk of a queue that holds a batch already: it may hold thousands of items)
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
                budget = self.batch_tokens()
                await self._wait_to_fill(budget)
                self._prune()
            except BaseException:
                self._slots.release()
                raise
            if not self._pending:
                if self.pace is not None:
                    self.pace.idle()
                self._slots.release()
                continue
            batch = form_batch(self._pending, budget, self.max_batch_tokens, self.max_batch_size)
            chosen = set(batch)  # an Item hashes by identity (eq=False): the walk of the queue stays in C
            self._pending = deque(filterfalse(chosen.__contains__, self._pending))
            self._queued.take(batch)
            now = time.monotonic()
            self._clock += sum(it.length for it in batch)
            self._flying[batch[0].priority] += len(batch)
            self._flying_tokens[batch[0].priority] += sum(it.length for it in batch)
            self._obs.dispatched([now - it.enqueued for it in batch], [it.length for it in batch])
            self._report()
            task = asyncio.create_task(self._dispatch(batch))
            self._running.add(task)
            task.add_done_callback(self._running.discard)

    async def _dispatch(self, batch: list[Item]) -> None:
        t0 = time.monotonic()
        error: BaseException | None = None
        try:
            settle(batch, await self._run([it.payload for it in batch]))
        except asyncio.CancelledError as e:
            error = e
            fail(batch, Closed("the service is shutting down"))
            raise
        except Exception as e:  # fails only this batch; the loop keeps serving
            error = e
            log.error("batch of %d failed: %s", len(batch), e, exc_info=e)
            fail(batch, e)
        finally:
            self._slots.release()
            t1 = time.monotonic()
            if self._tracer is not None and any(it.trace is not None for it in batch):
                trace_batch(self._tracer, batch, t0, t1, error)
            tokens = sum(it.length for it in batch)
            self._flying[batch[0].priority] -= len(batch)
            self._flying_tokens[batch[0].priority] -= tokens
            if self.pace is not None and error is None:
                self.pace.done(tokens, waiting=bool(self._pending))
            self._release(batch)
