"""The batcher's admission (a mixin of service.runtime.batcher.Batcher, which owns the counters it reads): work is
refused when the items or tokens outstanding would pass their bounds, or, once the model's rate is measured, when the
queue ahead of it (what would be served before it, in the fair order of batching.due) would take longer than
`max_queue_wait_s`; a Retry-After comes from the rate. The engine core works out from it, for its fronts, what a
request of k pairs would meet before it is tokenised (`admission`), and does so again only when `admission_state`
says something it reads has changed."""

from __future__ import annotations

import time
from typing import Any

from service.runtime.batching import (
    HIGH,
    LOW,
    BatchObserver,
    Closed,
    Gone,
    Meter,
    Overloaded,
    Queued,
    admission_table,
    due,
)


class Admission:
    """What a new request of some class and size would meet now; reads the batcher's counters, changes none."""

    pace: Meter | None
    max_queue_wait_s: float
    max_queue_items: int
    max_queue_tokens: int
    _obs: BatchObserver
    _items: list[int]  # per class: admitted and not yet resolved (queued + on the device)
    _tokens: list[int]
    _flying: list[int]  # per class: on the device
    _flying_tokens: list[int]
    _queued: Queued
    _clock: int
    _closed: bool
    _gone: Gone
    _earliest: float

    def _prune(self) -> bool:
        raise NotImplementedError

    def admission_state(self) -> tuple[Any, ...]:
        """Changes whenever an answer of `refusal` or `admission` may: the counts and the fair order's clock (every
        submission, batch and resolution), the measured rate, a queued item cancelled, the earliest deadline
        passed (a walk would drop work)."""
        rate = self.pace.seconds(1.0) if self.pace is not None else None
        late = time.monotonic() >= self._earliest
        return (*self._items, *self._tokens, *self._flying, *self._flying_tokens, self._clock, rate, self._gone.n, late)

    def retry_after(self) -> float:
        """Seconds until everything outstanding is worked off, by the measured rate (1 while unknown)."""
        return self.pace.retry_after(sum(self._tokens), 0.0) if self.pace else 1.0

    def _ahead(self, priority: int) -> tuple[int, int]:
        """Items and tokens a new request of this class counts against the bounds: its own class and the higher
        ones, and a lower class's only where it is on the device (queued low work never crowds out high work)."""
        if priority == HIGH:
            return self._items[HIGH] + self._flying[LOW], self._tokens[HIGH] + self._flying_tokens[LOW]
        return sum(self._items), sum(self._tokens)

    def _wait_ahead(self, priority: int, last: float) -> int:
        """Tokens queued ahead of a new request of this class whose tag would be `last`: the higher class's, and its
        own class's due before it. A batch on a model process is not queued: it holds one for ~max_batch_ms at most."""
        ahead = sum(self._tokens[c] - self._flying_tokens[c] for c in range(priority + 1))
        return ahead - self._queued.after(priority, last)

    def refusal(self, items: int = 1, tokens: int = 0, priority: int = HIGH) -> Overloaded | None:
        """Why `items` more of this class (and `tokens`, if known) could not be admitted now; None if they can."""
        if (refused := self._refusal(items, tokens, priority)) is None or not self._prune():
            return refused  # (work whose client has gone, queued until the next batch, is ahead of no one)
        return self._refusal(items, tokens, priority)

    def admission(self, most: int, entries: int = 16) -> tuple[int, list[tuple[int, Overloaded]]]:
        """The refusal of k high pairs before tokenisation, for k = 1..most (batching.admission_table): what
        the engine core tells its fronts, so that they refuse what it would before tokenising."""
        if self.refusal(most) is None:
            return most, []
        return admission_table(lambda k: self._refusal(k, 0, HIGH), most, entries)

    def _refusal(self, items: int, tokens: int, priority: int) -> Overloaded | None:
        n, t = self._ahead(priority)
        if n + items > self.max_queue_items:
            return Overloaded("pairs", self.retry_after())
        if tokens and t + tokens > self.max_queue_tokens:
            return Overloaded("tokens", self.retry_after())
        limit = self.max_queue_wait_s
        if self.pace is None or limit <= 0 or (wait := self.pace.seconds(t)) is None or wait <= limit:
            return None
        mine = tokens or items * max(1, t // max(1, n))  # before tokenisation: the queue's mean length a pair
        t = self._wait_ahead(priority, due(self._clock, mine))
        if (wait := self.pace.seconds(t) or 0.0) <= limit:
            return None
        detail = f"{wait:.1f}s of work ahead, over max_queue_wait_ms={limit * 1000:g}"
        return Overloaded("wait", self.pace.retry_after(t, limit), detail)

    def full(self) -> bool:  # nothing more can be admitted now: not even one high item
        return self.refusal() is not None

    def check_admission(self, items: int, tokens: int = 0, priority: int = HIGH) -> None:
        """Raise Overloaded (or Closed) if `items` more of this class could not be admitted now."""
        if self._closed:
            raise Closed("draining: no new work is accepted")
        if (refused := self.refusal(items, tokens, priority)) is not None:
            self._obs.refused(refused.reason)
            raise refused
