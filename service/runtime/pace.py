"""How fast a model's processes work through its queue, measured, not configured: the batcher's admission
by expected wait and its batches bounded in time read it (service.runtime.batcher takes it as its `pace`).

The rate is the tokens of finished batches over the time they took to finish, counted only while work
waited (no model process sat idle with an empty queue), so that it is the model's capacity, not the
traffic's: a slow CPU and a fast GPU measure their own. The sums decay, so that the rate follows a
machine that slows (a co-tenant) within a few dozen batches. Until it has measured a few intervals it
knows nothing (rate 0), and its users fall back to their fixed bounds.
"""

from __future__ import annotations

import math
import time

DECAY = 0.95  # per finished batch: the rate is about the last 20 batches'
MIN_SAMPLES = 3  # intervals measured before the rate is trusted
# A batch bounded in time still holds at least this share of max_batch_tokens (768 of 8192, ~24 dev pairs). Below it
# a forward's fixed cost (the pipe, Python, the kernels' start) shows: on a 2-vCPU Zen 4 the built-in model takes
# 3.0 ms a pair in batches of 16 and 2.7-2.8 from 24 on. Batches that small also lower the measured rate, which
# shrinks them further: under a load average of 10, batches fell to one pair and the served rate to 0.56x; and
# with the floor at 512 tokens, overload's batches (at the floor) were smaller than the capacity phase's, so
# goodput fell with them (docs/batcher-bench.md). At the floor a batch's size no longer follows the rate.
MIN_BATCH_SHARE = 3 / 32


class Pace:
    """Told each finished batch (`done`) and each time a model process is left idle (`idle`), by the one
    batcher that owns the queue; event loop only."""

    def __init__(self, concurrency: int = 1):
        self.concurrency = max(1, concurrency)
        self._tokens = 0.0  # decayed sums over the saturated intervals
        self._seconds = 0.0
        self._samples = 0
        self._last: float | None = None  # when the last batch finished
        self._idled = True  # a process idled since then: the interval measures the traffic, not the model

    @property
    def rate(self) -> float:
        """Tokens a second, every process together; 0 until measured."""
        if self._samples < MIN_SAMPLES or self._seconds <= 0:
            return 0.0
        return self._tokens / self._seconds

    def done(self, tokens: int, waiting: bool, now: float | None = None) -> None:
        """A batch of `tokens` finished; `waiting`: work is queued behind it."""
        now = time.monotonic() if now is None else now
        if self._last is not None and not self._idled and now > self._last:
            self._tokens = self._tokens * DECAY + tokens
            self._seconds = self._seconds * DECAY + (now - self._last)
            self._samples += 1
        self._last = now
        self._idled = not waiting

    def idle(self) -> None:
        """A model process is free and nothing is queued."""
        self._idled = True

    def seconds(self, tokens: float) -> float | None:
        """Expected seconds to work off `tokens` queued ahead; None while the rate is unknown."""
        rate = self.rate
        return tokens / rate if rate > 0 else None

    def retry_after(self, tokens: float, limit_s: float) -> float:
        """Whole seconds until `tokens` ahead are worked down to `limit_s` of work (at least 1)."""
        rate = self.rate
        if rate <= 0:
            return 1.0
        return float(max(1, math.ceil(tokens / rate - limit_s)))

    def batch_tokens(self, seconds: float, most: int) -> int:
        """Padded tokens one process forwards in about `seconds`, between MIN_BATCH_SHARE of `most` and `most`
        (`most` while the rate is unknown)."""
        rate = self.rate
        if rate <= 0 or seconds <= 0:
            return most
        least = max(1, int(most * MIN_BATCH_SHARE))
        return max(least, min(most, int(rate / self.concurrency * seconds)))

    def describe(self) -> dict:
        return {"tokens_per_s": round(self.rate, 1), "samples": self._samples}
