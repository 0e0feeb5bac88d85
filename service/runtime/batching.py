"""What the batcher (service.runtime.batcher) works with: the items it queues, their classes and the order
batches are formed in, how one batch is planned, its errors, and the hooks it reports to (an observer of the
queue, a tracer of batches, the meter of the model's pace). Like the batcher, it knows nothing of the model."""

from __future__ import annotations

import asyncio
import bisect
import heapq
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Protocol

log = logging.getLogger("qtrel.batcher")

PRIORITIES = ("high", "low")  # the classes, first served first; an item's `priority` is its index here
HIGH, LOW = 0, 1


class Overloaded(Exception):
    """Admission refused: `reason` "pairs" or "tokens" (a queue bound), or "wait" (the queue ahead would take
    longer than max_queue_wait_s)."""

    def __init__(self, reason: str, retry_after: float, detail: str = ""):
        super().__init__(f"queue full ({detail or reason}); retry in {retry_after:.0f}s")
        self.reason = reason
        self.retry_after = retry_after


def priority_of(name: str) -> int:
    """The class index of a priority name ("high" or "low"); ValueError for any other."""
    try:
        return PRIORITIES.index(name)
    except ValueError:
        raise ValueError(f"priority must be one of {', '.join(PRIORITIES)}, got {name!r}") from None


class DeadlineExceeded(Exception):
    pass


class Closed(Exception):
    """The batcher is draining and takes no new work."""


class BatchObserver(Protocol):
    def queued(self, items: int, in_flight: int) -> None: ...
    def dispatched(self, waits: Sequence[float], lengths: Sequence[int]) -> None: ...
    def dropped(self, reason: str, n: int) -> None: ...
    def refused(self, reason: str) -> None: ...
    def depths(self, queued: Sequence[int]) -> None: ...  # items queued per class, in PRIORITIES order


class NoObserver:
    def queued(self, items, in_flight):
        pass

    def dispatched(self, waits, lengths):
        pass

    def dropped(self, reason, n):
        pass

    def refused(self, reason):
        pass

    def depths(self, queued):
        pass


class Meter(Protocol):
    """The model's measured pace (service.runtime.pace.Pace), told every finished batch."""

    def done(self, tokens: int, waiting: bool) -> None: ...
    def idle(self) -> None: ...
    def seconds(self, tokens: float) -> float | None: ...
    def retry_after(self, tokens: float, limit_s: float) -> float: ...
    def batch_tokens(self, seconds: float, most: int) -> int: ...


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


@dataclass(eq=False)  # hashed by identity: the batcher takes a batch out of its queue by a set of them
class Item:
    length: int
    payload: Any
    future: asyncio.Future
    deadline: float | None  # monotonic seconds
    enqueued: float = field(default_factory=time.monotonic)
    trace: Any = None  # the submitter's trace context, for the BatchTracer only
    tag: str | None = None  # the submitter's name for its work (a request id), for logs only
    rank: float = 0.0  # the order batches are formed in: its request's tag (`due`), then arrival
    priority: int = HIGH  # index in PRIORITIES: a lower class waits for the higher one
    work: int = 0  # its request's tokens, every item of it together: a request this big is split across batches


class Gone:
    """How many queued items' futures were cancelled (their callers left) since the batcher last walked its queue:
    it walks the queue for gone work only when there is some (Batcher._prune, asked by every refusal check)."""

    __slots__ = ("n",)

    def __init__(self) -> None:
        self.n = 0


class ItemFuture(asyncio.Future):
    """A queued item's future, which counts its own cancellation in its batcher's `Gone`. Nothing but the batcher
    resolves its futures otherwise, so a queued item that is done was cancelled. (A pair cancelled on the device
    costs one walk that finds nothing.)"""

    __slots__ = ("gone",)
    gone: Gone

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        self.gone.n += 1
        return True


def sweep(pending: Iterable[Item], now: float) -> tuple[deque[Item], list[Item], list[Item], float]:
    """The queue split into the items that stay, the gone ones (future done: the caller left) and the late ones
    (deadline passed: failed here with DeadlineExceeded); and the earliest deadline of those that stay."""
    keep: deque[Item] = deque()
    gone, late = [], []
    earliest = math.inf
    for it in pending:
        if it.future.done():
            gone.append(it)
        elif it.deadline is None:
            keep.append(it)
        elif now >= it.deadline:
            it.future.set_exception(DeadlineExceeded("deadline passed while queued"))
            late.append(it)
        else:
            keep.append(it)
            earliest = min(earliest, it.deadline)
    return keep, gone, late, earliest


order = attrgetter("priority", "rank")  # the order batches form in: C, not a Python call an item (a walk of the queue)
by_length = attrgetter("length")
by_work = attrgetter("work")


def due(clock: float, tokens: int) -> float:
    """The tag every item of a request of `tokens` gets when it arrives at the queue's work `clock` (the tokens
    dispatched so far): the request is due once the queue has served as much work as it brings. A one-pair
    request goes before a big one that came a moment earlier, equal requests are served in arrival order, and
    a big request waits behind small ones at most as long as its own work: nothing starves (fair queueing
    with each request one flow, weighed in tokens)."""
    return clock + tokens


def padded_tokens(lengths: Sequence[int]) -> int:
    return max(lengths) * len(lengths) if lengths else 0


def plan_batch(window: Sequence[Item], max_tokens: int, max_size: int) -> list[Item]:
    """From a window in rank order (fair-queueing tags), the length-sorted run of items that holds the first
    one and fits `max_tokens` padded tokens and `max_size` items."""
    oldest = window[0]
    cur: list[Item] = []
    held = False  # cur holds the oldest: the batch is cur once it closes
    for it in sorted(window, key=by_length):
        if cur and (it.length * (len(cur) + 1) > max_tokens or len(cur) >= max_size):
            if held:
                return cur
            cur = []
        cur.append(it)
        held = held or it is oldest
    return cur


def form_batch(pending: Sequence[Item], split_tokens: int, max_tokens: int, max_size: int) -> list[Item]:
    """The next batch from the queue, of the class of the item due first. While a big request (more than
    `split_tokens`, one time-bounded batch: `Item.work`) is queued, the batch is time-bounded: `split_tokens`
    padded tokens of the work due within that much of the first item (a big request's items beside a later
    one's of a similar length would make each wait for both). With small requests alone, none waits behind a
    big one: the batch takes them whole up to `max_tokens`, as splitting them would only add fixed costs."""
    n = max_size * 4
    # heapq.nsmallest keeps its heap in Python: sorting in C is faster up to a queue of ~4 windows (Zen 4: 94 against
    # 268 us at 600 items, 560 against 483 at 3,000)
    window = sorted(pending, key=order)[:n] if len(pending) <= 4 * n else heapq.nsmallest(n, pending, key=order)
    first = window[0]
    if window[-1].priority != first.priority:  # in order: the first class is a prefix
        window = [it for it in window if it.priority == first.priority]
    if max(map(by_work, window)) <= split_tokens:
        return plan_batch(window, max_tokens, max_size)
    return plan_batch([it for it in window if it.rank <= first.rank + split_tokens], split_tokens, max_size)


class Queued:
    """The tokens queued per class and tag (a request's items share one), kept as items come and go, so that
    the work of a class due after a tag is a bisection of a sorted copy made once per change of the queue,
    not a walk of the queue (Batcher._wait_ahead: several times a request under overload)."""

    def __init__(self, classes: int):
        self.by_tag: list[dict[float, int]] = [{} for _ in range(classes)]
        self.sorted: list[tuple[list[float], list[int]] | None] = [None] * classes

    def put(self, priority: int, tag: float, tokens: int) -> None:
        d = self.by_tag[priority]
        if left := d.get(tag, 0) + tokens:
            d[tag] = left
        else:
            d.pop(tag, None)
        self.sorted[priority] = None

    def take(self, items: Iterable[Item]) -> None:
        for it in items:
            self.put(it.priority, it.rank, -it.length)

    def after(self, priority: int, tag: float) -> int:
        """The tokens of this class queued with a tag after `tag`."""
        if (got := self.sorted[priority]) is None:
            tags = sorted(self.by_tag[priority])
            after = [0] * (len(tags) + 1)  # after[i]: the tokens of tags[i:]
            for i in range(len(tags) - 1, -1, -1):
                after[i] = after[i + 1] + self.by_tag[priority][tags[i]]
            got = self.sorted[priority] = (tags, after)
        return got[1][bisect.bisect_right(got[0], tag)]


def admission_table(refusal: Callable[[int], Overloaded | None], most: int, entries: int) -> tuple[int, list]:
    """What `refusal(k)` answers for k = 1..most, given that it is monotone (the work ahead of k pairs grows
    with k, and so do the refusal's wait and Retry-After): (end, [(first k, refusal), ...]), each refusal
    standing from its first k to the next one's, the last one's up to `end`; at most `entries` of them (the
    rest, up to most, left out: end < most). (most, []) if none is refused."""
    lo, hi = 1, most + 1  # the first refused k: lo..hi
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if refusal(mid) is not None else (mid + 1, hi)
    table: list[tuple[int, Overloaded]] = []
    k = lo
    while k <= most and len(table) < entries:
        r = refusal(k)
        assert r is not None
        same = (r.reason, r.retry_after, str(r))
        lo, hi = k, most  # the last k with the same refusal
        while lo < hi:
            mid = (lo + hi + 1) // 2
            m = refusal(mid)
            lo, hi = (mid, hi) if m is not None and (m.reason, m.retry_after, str(m)) == same else (lo, mid - 1)
        table.append((k, r))
        k = lo + 1
    return k - 1 if table else most, table


def settle(batch: Sequence[Item], results: Sequence[Any]) -> None:
    """Each item's result from its batch's `run`; a result that is an exception fails its item alone."""
    for it, res in zip(batch, results, strict=True):
        if it.future.done():
            continue
        if isinstance(res, BaseException):  # this item failed alone; the others have results
            log.error("an item of %s failed alone: %s", it.tag or "untagged work", res)
            it.future.set_exception(res)
        else:
            it.future.set_result(res)


def fail(batch: Sequence[Item], error: BaseException) -> None:
    """Fail the items of a batch not resolved yet."""
    for it in batch:
        if not it.future.done():
            it.future.set_exception(error)


def trace_batch(
    tracer: BatchTracer, batch: Sequence[Item], started: float, ended: float, error: BaseException | None
) -> None:
    """Tell the tracer a traced batch's timings; tracing never fails a batch."""
    try:
        lengths = [it.length for it in batch]
        tracer.batch([it.trace for it in batch], [it.enqueued for it in batch], started, ended, lengths, error)
    except Exception as e:
        log.warning("batch tracer failed: %s", e)
