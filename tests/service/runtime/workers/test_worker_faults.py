"""The worker under repeated faults, on real model processes of the tiny checkpoint: a process killed
while it warms up after a restart is simply started again, restarts back off in a crash loop that
liveness reports, and a poison pair is isolated from the pairs that shared its batch."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time

import pytest

from service.runtime.workers.backend import LoadFailed, LoadSpec, ModelError, ProcessDied
from service.runtime.workers.backend import State as WorkerState
from service.runtime.workers.worker import RestartPolicy, Worker
from tests.service.runtime.workers.hooked import POISON, die_on_poison, hooked, scores
from tests.service.runtime.workers.test_worker import Restarts, three_pairs


async def new_pid(w: Worker, old: set[int], timeout: float = 30) -> int:
    """The pid of a model process started after `old` were seen."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fresh = set(w.pids) - old
        if fresh:
            return fresh.pop()
        await asyncio.sleep(0.002)
    raise AssertionError("no new model process started")


async def until(condition, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.02)


def test_restart_delay_is_free_then_doubles_to_its_cap():
    p = RestartPolicy(free=3, max_backoff_s=5)
    assert [p.delay(n) for n in range(1, 9)] == [0, 0, 0, 1, 2, 4, 5, 5]


def test_a_replacement_killed_while_it_starts_is_started_again(tiny_checkpoint):
    """The kill storm's second blow: SIGKILL the model process, then its replacement as soon as it
    exists (loading or warming up). The worker never turns failed; a batch queued meanwhile is served."""
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint)), observer=obs)

    async def main():
        w.start()
        await w.wait_ready()
        first = w.pids[0]
        pending = asyncio.ensure_future(w.run(three_pairs(w)))
        os.kill(first, signal.SIGKILL)
        second = await new_pid(w, {first})
        os.kill(second, signal.SIGKILL)
        outs = await asyncio.wait_for(pending, 60)
        assert len(outs) == 3 and not any(isinstance(o, Exception) for o in outs)
        assert w.state == WorkerState.READY and w.alive()
        assert set(w.pids).isdisjoint({first, second})
        assert len(scores(await w.run(three_pairs(w)))) == 3

    asyncio.run(main())
    w.stop()
    assert len(obs.reasons) >= 2 and set(obs.reasons) == {"died"} and obs.failed == []


def test_one_replica_serves_while_the_other_restarts(tiny_checkpoint):
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), replicas=2)

    async def main():
        w.start()
        await w.wait_ready()
        a, b = w.pids
        os.kill(a, signal.SIGKILL)
        replacement = await new_pid(w, {a, b})
        os.kill(replacement, signal.SIGKILL)
        assert w.state == WorkerState.READY  # b lives throughout: readiness holds
        for _ in range(5):
            assert len(scores(await asyncio.wait_for(w.run(three_pairs(w)), 60))) == 3

    asyncio.run(main())
    w.stop()


def test_a_crash_loop_backs_off_and_shows_in_liveness_until_it_ends(tiny_checkpoint, tmp_path):
    """The checkpoint vanishes under a running server: each replacement cannot load. Restarts go on
    with backoff (counted as load_failed), liveness turns false past the policy's limit, and the worker
    neither fails nor spins. Once the checkpoint is back, a replacement loads and serves; liveness
    recovers when the loop's restarts have aged out of the window."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, ckpt)
    obs = Restarts()
    policy = RestartPolicy(window_s=300, free=1, max_backoff_s=0.5, crash_loop=3)  # a window no slow run outlives
    w = Worker(LoadSpec(str(ckpt), warmup=False), observer=obs, restarts=policy)

    async def main():
        w.start()
        await w.wait_ready()
        (ckpt / "config.json").rename(tmp_path / "config.json")
        os.kill(w.pids[0], signal.SIGKILL)
        await until(lambda: not w.alive())
        assert w.crash_loops() == [0]
        assert w.state == WorkerState.RESTARTING
        assert "load_failed" in obs.reasons and "config.json" in (w.error or "")
        (tmp_path / "config.json").rename(ckpt / "config.json")
        await until(lambda: w.state == WorkerState.READY)
        assert w.alive() is False  # the window still holds the loop's restarts
        assert len(scores(await w.run(three_pairs(w)))) == 3

    asyncio.run(main())
    w.stop()


@pytest.mark.parametrize("fault", ["dies", "raises"])
def test_a_poison_pair_fails_alone_and_its_batch_mates_are_scored(tiny_checkpoint, fault):
    """A batch of 8 pairs holds one that kills the model process every time (or that the model raises
    for). It is retried, then split until the poison pair is alone: only it fails; the other seven get
    the scores they get without it, and the model process is restarted a bounded number of times."""
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs, backend=hooked(fault=die_on_poison))
    bad_id = POISON if fault == "dies" else 10**6
    deaths = 5 if fault == "dies" else 0  # the batch twice, then one per split level

    async def main():
        w.start()
        await w.wait_ready()
        clean = three_pairs(w) + three_pairs(w)[:2] + three_pairs(w)[:2]
        want = [o.probs for o in scores(await w.run(clean))]
        batch = clean[:5] + [([101, bad_id, 102], [0, 0, 0])] + clean[5:]
        outs = scores(await asyncio.wait_for(w.run(batch), 120))
        assert isinstance(outs[5], ProcessDied if fault == "dies" else ModelError)
        got = [o.probs for i, o in enumerate(outs) if i != 5]
        assert all(abs(a - b) < 1e-5 for x, y in zip(got, want) for a, b in zip(x, y))
        # The last death's replacement: its restart may be recorded only after the batch's answer.
        await until(lambda: len(obs.reasons) == deaths and w.state == WorkerState.READY)

    asyncio.run(main())
    w.stop()
    reason = "process_died" if fault == "dies" else "error"
    assert obs.failed == [reason]
    assert obs.split == [reason] * 3  # 8 -> 4 -> 2 -> 1: log2 of the batch
    assert len(obs.reasons) == deaths


class DiesWhileLoading:
    """A backend whose model process dies while loading, every time (the replica's policy in isolation)."""

    def __init__(self, index):
        self.pid = None

    def load(self):
        raise LoadFailed("the model process exited while loading (exit code -9)", crashed=True)

    def close(self):
        pass


def test_a_model_that_never_comes_up_fails_after_the_crash_loop_limit():
    """A process killed while loading is restarted, but one that never once came up stops at the crash
    loop's limit and fails its replica (and so the start: the server exits), instead of looping for ever."""
    import queue

    from service.runtime.workers.backend import State
    from service.runtime.workers.replica import Replica

    restarts = []
    policy = RestartPolicy(window_s=30, free=1, max_backoff_s=0.05, crash_loop=3)
    r = Replica(0, DiesWhileLoading, queue.Queue(), lambda: None, lambda d: None, restarts.append, policy)
    r.thread.start()
    r.thread.join(30)
    assert not r.thread.is_alive() and r.state == State.FAILED and r.crash_looping  # 3 restarts in the window
    assert len(restarts) == 2 and "exited while loading" in r.error and "3 tries" in r.error  # start + 2 restarts
