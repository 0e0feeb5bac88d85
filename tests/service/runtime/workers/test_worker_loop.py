"""The batches the event loop drives itself, on real model processes of the tiny checkpoint, never block it:
not while a reply far larger than the pipe's buffer is half written by a stopped process, nor while a large
batch waits for a stopped process to read it, nor when a process's pipe ends before its exit code is known.
A ticking coroutine measures how long the loop was held."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from functools import partial

import pytest

from model.levels import unpack_row
from service.runtime.workers.backend import LoadSpec
from service.runtime.workers.worker import Worker
from tests.service.runtime.workers.hooked import (
    PADDING,
    big_reply_stopped_midway,
    close_pipe_and_linger,
    hooked,
    scores,
)
from tests.service.runtime.workers.test_worker import Restarts, three_pairs

HELD_S = 1.5  # how long a test keeps a model process stopped: a loop blocked meanwhile shows as a gap this long


class Ticker:
    """Ticks on the event loop every millisecond; the longest gap between ticks is the longest the loop was held."""

    def __init__(self) -> None:
        self.ticks: list[float] = []
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def _run(self) -> None:
        while True:
            self.ticks.append(time.monotonic())
            await asyncio.sleep(0.001)

    def stop(self) -> float:
        """The longest gap, in seconds."""
        assert self._task is not None
        self._task.cancel()
        return max(b - a for a, b in zip(self.ticks, self.ticks[1:]))


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


class Resumer(threading.Thread):
    """Resumes `pid` `after` seconds once it is stopped (`seen` then), from a thread of its own: a test whose
    event loop is blocked meanwhile fails rather than hangs."""

    def __init__(self, pid: int, after: float = HELD_S):
        super().__init__(daemon=True)
        self.pid, self.after, self.seen = pid, after, threading.Event()
        self.start()

    def run(self) -> None:
        pid, deadline = self.pid, time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if stopped(pid):
                    self.seen.set()
                    break
            except FileNotFoundError:
                return
            time.sleep(0.002)
        time.sleep(self.after)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


async def until(condition, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


def one_pair(w: Worker):
    return three_pairs(w)[:1]


def test_the_loop_serves_on_while_a_reply_is_half_written(tiny_checkpoint, tmp_path):
    """The model process stops itself once its ~16 MB reply has begun to cross the pipe: the loop reads what
    has come and keeps serving; once the process resumes, the rest is read and the batch gets its scores."""
    flag = tmp_path / "fault"
    fault = partial(big_reply_stopped_midway, flag=str(flag))
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs, backend=hooked(fault=fault))

    async def main():
        w.start()
        await w.wait_ready()
        (want,) = scores(await w.run(one_pair(w)))
        pid = w.pids[0]
        flag.touch()
        resumer = Resumer(pid)
        ticker = Ticker()
        ticker.start()
        batch = asyncio.ensure_future(w.run(one_pair(w)))
        await until(resumer.seen.is_set)
        await asyncio.sleep(0.3)
        answered_while_stopped = batch.done()
        (out,) = await asyncio.wait_for(batch, 60)
        longest = ticker.stop()
        resumer.join(10)
        assert longest < 0.25, f"the event loop was held {longest:.3f}s"
        assert not answered_while_stopped  # stopped mid-reply, not after it
        assert unpack_row(out[: -8 * PADDING]) == want and not any(out[-8 * PADDING :])
        assert w.pids == [pid]

    try:
        asyncio.run(main())
    finally:  # a failed assertion must not leave model processes for the interpreter's exit to wait on
        w.stop()
    assert obs.reasons == [] and obs.retried == 0


def test_a_process_killed_mid_reply_is_replaced_and_its_batch_retried(tiny_checkpoint, tmp_path):
    """The watchdog kills the process stopped with its reply half written: the loop, which never waited for
    the rest, sees the pipe end, and the batch is retried on the replacement."""
    flag = tmp_path / "fault"
    fault = partial(big_reply_stopped_midway, flag=str(flag))
    obs = Restarts()
    w = Worker(
        LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs, backend=hooked(fault=fault), batch_timeout_s=1.0
    )

    async def main():
        w.start()
        await w.wait_ready()
        (want,) = scores(await w.run(one_pair(w)))
        first = w.pids[0]
        flag.touch()
        resumer = Resumer(first, after=10)  # only if the watchdog failed
        ticker = Ticker()
        ticker.start()
        (out,) = scores(await asyncio.wait_for(w.run(one_pair(w)), 60))
        longest = ticker.stop()
        assert out.probs == want.probs and out.logits == want.logits  # from the replacement, unpadded
        assert longest < 0.25, f"the event loop was held {longest:.3f}s"
        assert w.pids and first not in w.pids
        resumer.join(0)

    try:
        asyncio.run(main())
    finally:  # a failed assertion must not leave model processes for the interpreter's exit to wait on
        w.stop()
    assert obs.reasons == ["timeout"] and obs.retried == 1 and obs.failed == []


def test_a_large_batch_waits_for_a_stopped_process_without_blocking_the_loop(tiny_checkpoint):
    """A batch several times the pipe's buffer, sent to a stopped process: the loop writes what the buffer
    takes and the rest as the process reads it once resumed; the batch is scored as a small one would be."""
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False))

    async def main():
        w.start()
        await w.wait_ready()
        enc = w.info.tokenizer.encode(["cordless drill " * 20] * 1500, ["a very long product title " * 12] * 1500)
        batch = list(zip(enc.input_ids, enc.token_type_ids))
        assert sum(len(ids) for ids, _ in batch) * 5 > 4 * 212992  # ~5 bytes a token pickled; Linux's buffer
        (want,) = scores(await w.run(batch[:1]))
        pid = w.pids[0]
        os.kill(pid, signal.SIGSTOP)
        resumer = Resumer(pid)
        ticker = Ticker()
        ticker.start()
        outs = scores(await asyncio.wait_for(w.run(batch), 120))
        longest = ticker.stop()
        resumer.join(10)
        assert len(outs) == 1500 and all(o.probs == pytest.approx(want.probs, abs=1e-5) for o in outs)
        assert longest < 0.25, f"the event loop was held {longest:.3f}s"
        assert w.pids == [pid]

    try:
        asyncio.run(main())
    finally:  # a failed assertion must not leave model processes for the interpreter's exit to wait on
        w.stop()
    assert w.restarts == 0


def test_a_pipe_that_ends_before_its_process_exits_fails_the_batch_at_once(tiny_checkpoint, tmp_path):
    """The process closes its pipe and takes a second to exit: the loop reports the death at once, without
    waiting for the exit code, and the batch is retried on the replacement."""
    flag = tmp_path / "fault"
    obs = Restarts()
    fault = partial(close_pipe_and_linger, flag=str(flag))
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs, backend=hooked(fault=fault))

    async def main():
        w.start()
        await w.wait_ready()
        (want,) = scores(await w.run(one_pair(w)))
        first = w.pids[0]
        flag.touch()
        ticker = Ticker()
        ticker.start()
        (out,) = scores(await asyncio.wait_for(w.run(one_pair(w)), 60))
        longest = ticker.stop()
        assert out.probs == want.probs and first not in w.pids
        assert longest < 0.08, f"the event loop was held {longest:.3f}s"  # joining the process held it 0.1 s

    try:
        asyncio.run(main())
    finally:  # a failed assertion must not leave model processes for the interpreter's exit to wait on
        w.stop()
    assert obs.reasons == ["died"] and obs.retried == 1 and obs.failed == []


def test_a_named_job_after_a_batch_the_loop_drove_under_uvloop(tiny_checkpoint):
    """uvloop's add_reader (libuv's uv_poll) turns the pipe non-blocking: the replica thread's own exchange (a
    named job) after a batch the loop drove must still block for its reply, not fail as a dead process."""
    uvloop = pytest.importorskip("uvloop")
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs)

    async def main():
        w.start()
        await w.wait_ready()
        for _ in range(3):
            (scored,) = scores(await w.run(one_pair(w)))  # driven by the loop
            explained = await w.job("explain", "drill", "cordless drill")  # on the replica's thread
            assert len(scored.probs) == 5 and explained

    try:
        uvloop.run(main())
    finally:  # a failed assertion must not leave model processes for the interpreter's exit to wait on
        w.stop()
    assert obs.reasons == [] and obs.retried == 0
