"""Many batches on several cores in one process: workers of one Python thread each, every worker with its
own torch intra-op threads, each forwarding whole batches.

Why: one forward split over two cores (torch's intra-op threads) ran at 0.87-0.96x the best anchor on two
cores of an AMD EPYC Zen 3 in float32; the same two cores as two workers of one thread each forwarded 1.18x
more pairs (1.17-1.26 per round, lab/workers_ab.py, docs/benchmarks.md). It is the server's layout (model
processes of one thread) inside one process: MiniLM's matmuls are too small to split well, and whole
batches need no synchronisation. Every kernel releases the GIL; only the Python between kernels (under a
tenth of a forward) runs one at a time.

Under OpenMP, `torch.set_num_threads` sets the calling thread's team size (and MKL's, per thread) and
torch's default for threads that have not run a torch op yet: each worker sets its own in its initializer,
and the pool puts the default back, so the caller and threads started later keep theirs.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from typing import TypeVar

import torch

from model.batches import BATCHES_PER_WORKER, MAX_WORKERS, MIN_BATCH_TOKENS, batch_budget  # noqa: F401

__all__ = ["MAX_WORKERS", "ForwardWorkers", "batch_budget", "plan", "run_batches", "workers_for"]

T = TypeVar("T")
R = TypeVar("R")


def plan(threads: int, workers: int = 0) -> tuple[int, int]:
    """(workers, intra-op threads each) for `threads` cores: one worker per core up to MAX_WORKERS, the cores
    shared out evenly past that (the remainder unused); `workers` > 0 asks for that many."""
    threads = max(1, threads)
    w = min(workers, threads) if workers > 0 else min(threads, MAX_WORKERS)
    return w, max(1, threads // w)


class ForwardWorkers:
    """A pool of `workers` threads, each running torch ops on `threads_each` intra-op threads. Lives in the
    process that made it: after a fork (`stale`) the threads are gone, make another."""

    def __init__(self, workers: int, threads_each: int):
        if workers < 2:
            raise ValueError(f"a pool needs at least 2 workers, got {workers}")
        self.workers, self.threads_each, self.pid = workers, threads_each, os.getpid()
        caller = torch.get_num_threads()
        ready = threading.Barrier(workers + 1)
        self._pool = ThreadPoolExecutor(
            workers, thread_name_prefix="qtrel-forward", initializer=_own_threads, initargs=(threads_each,)
        )
        # every worker started now: each submit finds no idle thread and starts one (and its initializer)
        started = [self._pool.submit(ready.wait) for _ in range(workers)]
        ready.wait()
        for f in started:
            f.result()
        # the workers' set_num_threads also moved torch's default for threads started later: put it back
        torch.set_num_threads(caller)

    @property
    def stale(self) -> bool:
        return self.pid != os.getpid()

    def map(self, fn: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """fn over items, results in their order; an error is raised once every item has finished, so
        nothing still runs when the caller sees it."""
        futures = [self._pool.submit(fn, x) for x in items]
        wait(futures)
        return [f.result() for f in futures]

    def close(self) -> None:
        self._pool.shutdown(wait=True)


def _own_threads(n: int) -> None:
    # torch sets a thread's team size from its process-wide default on the thread's first parallel call
    # (once): take that first, then set ours, which later calls keep
    torch.get_num_threads()
    torch.set_num_threads(n)


def workers_for(current: ForwardWorkers | None, threads: int, workers: int = 0) -> ForwardWorkers | None:
    """The pool `threads` cores want (None: one worker, the caller's thread), reusing `current` when it fits."""
    w, each = plan(threads, workers)
    if w < 2:
        return None
    if current is not None and not current.stale and (current.workers, current.threads_each) == (w, each):
        return current
    if current is not None and not current.stale:
        current.close()
    return ForwardWorkers(w, each)


def run_batches(pool: ForwardWorkers | None, fn: Callable[[T], R], batches: Sequence[T]) -> list[R]:
    """fn over batches: on the pool where there is one, else in the caller's thread. A lone batch goes to the pool
    too: on the caller's threads its float sums would split otherwise, and a file's bytes would depend on how
    many batches a chunk of it made (`qtrel score` on N cores would differ from a scoring server's job)."""
    if pool is None:
        return [fn(b) for b in batches]
    return pool.map(fn, batches)
