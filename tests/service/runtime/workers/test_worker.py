"""The worker's out-of-memory policy, and the worker on the real tiny model: jobs, crashes, the watchdog
(a stopped model process) and the retry of a batch whose process died."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest
import torch

from model.relevance import RelevanceModel
from service.runtime.workers.backend import LoadSpec, ModelError, ProcessDied
from service.runtime.workers.backend import State as WorkerState
from service.runtime.workers.runner import forward_in_halves
from service.runtime.workers.worker import Worker
from tests.conftest import read_pairs
from tests.service.runtime.workers.hooked import POISON, die_on_poison, hooked, scores


def test_out_of_memory_retries_in_halves():
    calls = []

    def forward(batch):  # a device that holds at most 3 pairs at once
        calls.append(len(batch))
        if len(batch) > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return torch.tensor([[float(x)] for x in batch])

    out = forward_in_halves(forward, list(range(10)))
    assert out.squeeze(1).tolist() == list(range(10))  # order kept
    assert calls[0] == 10 and max(c for c in calls if c <= 3) <= 3


def test_out_of_memory_on_a_single_pair_is_raised():
    def forward(batch):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        forward_in_halves(forward, [1, 2])


class Restarts:  # the worker's observer, recording what it is told
    def __init__(self):
        self.seen = []
        self.reasons = []
        self.retried = 0
        self.failed = []
        self.split = []

    def forwarded(self, seconds):
        pass

    def restarted(self, reason):
        self.seen.append(1)
        self.reasons.append(reason)

    def batch_retried(self):
        self.retried += 1

    def batch_failed(self, reason):
        self.failed.append(reason)

    def batch_split(self, reason):
        self.split.append(reason)


@pytest.mark.parametrize("mode", ["process", "thread"])
def test_worker_loads_warms_and_scores(tiny_checkpoint, mode):
    pairs = read_pairs(5)  # before a process starts: a skip (no data) must not leave it running
    w = Worker(LoadSpec(str(tiny_checkpoint)), mode=mode, backend=hooked(mode))
    ref = RelevanceModel.load(tiny_checkpoint)

    async def main():
        w.start()
        await w.wait_ready()
        assert w.state == WorkerState.READY
        assert w.info.labels == ["1", "2", "3", "4", "5"] and w.info.dtype == "float32"
        enc = w.info.tokenizer.encode(*zip(*pairs))
        outs = scores(await w.run(list(zip(enc.input_ids, enc.token_type_ids))))
        want = ref.probs(enc.input_ids, enc.token_type_ids)
        assert torch.allclose(torch.tensor([o.probs for o in outs]), want, atol=1e-6)
        assert [o.level for o in outs] == want.argmax(-1).tolist()
        assert await w.job("labels_of") == ["1", "2", "3", "4", "5"]
        # A job that raises fails alone: a token id beyond the vocabulary, then a raising call.
        (bad,) = scores(await w.run([([101, 10**6, 102], [0, 0, 0])]))
        assert isinstance(bad, ModelError) and "index" in str(bad)
        with pytest.raises(Exception, match="boom"):
            await w.job("raise_value_error", "boom")
        again = scores(await w.run(list(zip(enc.input_ids, enc.token_type_ids))))
        assert [o.probs for o in again] == [o.probs for o in outs]

    asyncio.run(main())
    w.stop()
    assert w.state == WorkerState.STOPPED
    assert w.restarts == 0


def test_model_process_killed_mid_batch_fails_that_batch_and_restarts(tiny_checkpoint):
    """A real crash: SIGKILL the model process while it holds a job. That job fails, the next child
    is started and warmed, and a batch queued behind it is served by the new child."""
    restarts = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint)), observer=restarts, backend=hooked())

    async def main():
        w.start()
        await w.wait_ready()
        first = w.pids[0]
        enc = w.info.tokenizer.encode(["q"] * 3, ["a title"] * 3)
        held = asyncio.ensure_future(w.job("sleep_on_model", 30))
        queued = asyncio.ensure_future(w.run(list(zip(enc.input_ids, enc.token_type_ids))))
        await asyncio.sleep(0.5)  # the child is inside the sleeping job now
        os.kill(first, signal.SIGKILL)
        with pytest.raises(ProcessDied):
            await held
        outs = await queued  # waited for the new child instead of failing
        assert len(outs) == 3 and w.state == WorkerState.READY and w.pids[0] != first

    asyncio.run(main())
    w.stop()
    assert restarts.seen == [1] and w.restarts == 1


def test_worker_reports_a_failed_load(tmp_path):
    w = Worker(LoadSpec(str(tmp_path)))  # not a checkpoint

    async def main():
        w.start()
        await w.wait_ready()
        with pytest.raises(RuntimeError, match="not ready"):
            scores(await w.run([([101, 102], [0, 0])]))

    asyncio.run(main())
    assert w.state == WorkerState.FAILED and "config.json" in w.error


def three_pairs(w):
    enc = w.info.tokenizer.encode(["cordless drill"] * 3, ["a drill", "a saw", "deck stain"])
    return list(zip(enc.input_ids, enc.token_type_ids))


def test_a_stopped_model_process_is_killed_by_the_watchdog_and_its_batch_retried(tiny_checkpoint):
    """SIGSTOP the model process: the batch it is handed is held past batch_timeout_s, the watchdog
    kills the process (SIGKILL works on a stopped one), a new one is started and the batch is served
    by it. Nobody sees an error."""
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs, batch_timeout_s=1.0)

    async def main():
        w.start()
        await w.wait_ready()
        first = w.pids[0]
        want = [o.probs for o in scores(await w.run(three_pairs(w)))]
        os.kill(first, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            outs = scores(await asyncio.wait_for(w.run(three_pairs(w)), 60))
        finally:
            if first in w.pids:  # the watchdog did not act: do not leave a stopped process behind
                os.kill(first, signal.SIGKILL)
        assert time.monotonic() - t0 >= 1.0
        assert [o.probs for o in outs] == want
        assert w.state == WorkerState.READY and w.pids[0] != first

    asyncio.run(main())
    w.stop()
    assert obs.reasons == ["timeout"] and obs.retried == 1 and obs.failed == []
    assert w.describe()["batch_timeout_s"] == 1.0


def test_a_cancelled_batch_still_frees_its_model_process_for_the_next(tiny_checkpoint):
    """The event loop drives a free model process's batch itself: when the awaiting task is cancelled, the
    exchange still ends (its reply read and dropped), so the next batch gets its own scores, from the same
    process, with no restart."""
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs)

    async def main():
        w.start()
        await w.wait_ready()
        pairs = three_pairs(w)
        want = [o.probs for o in scores(await w.run(pairs))]
        first = w.pids[0]
        os.kill(first, signal.SIGSTOP)  # so that the batch is surely in flight when it is cancelled
        try:
            held = asyncio.ensure_future(w.run(pairs[:1]))
            await asyncio.sleep(0.3)
            held.cancel()
        finally:
            os.kill(first, signal.SIGCONT)
        outs = scores(await asyncio.wait_for(w.run(pairs), 30))
        assert [o.probs for o in outs] == want and w.pids == [first]
        assert held.cancelled()

    asyncio.run(main())
    w.stop()
    assert obs.reasons == [] and obs.retried == 0 and obs.failed == []


def test_a_batch_whose_process_is_killed_is_retried_on_a_new_one(tiny_checkpoint):
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs)  # no watchdog

    async def main():
        w.start()
        await w.wait_ready()
        first = w.pids[0]
        os.kill(first, signal.SIGSTOP)  # so that the batch is surely held when the process dies
        held = asyncio.ensure_future(w.run(three_pairs(w)))
        await asyncio.sleep(0.5)
        os.kill(first, signal.SIGKILL)
        outs = await asyncio.wait_for(held, 60)
        assert len(outs) == 3 and w.pids[0] != first

    asyncio.run(main())
    w.stop()
    assert obs.reasons == ["died"] and obs.retried == 1 and obs.failed == []


def test_a_poison_pair_fails_after_its_retry_and_the_worker_serves_on(tiny_checkpoint):
    """A pair that kills every process it reaches is retried once, then fails alone (its entry is the
    ProcessDied); a pair the model raises for fails at once (no retry). Other batches are served throughout."""
    obs = Restarts()
    w = Worker(LoadSpec(str(tiny_checkpoint), warmup=False), observer=obs, backend=hooked(fault=die_on_poison))

    async def main():
        w.start()
        await w.wait_ready()
        (died,) = scores(await asyncio.wait_for(w.run([([101, POISON, 102], [0, 0, 0])]), 60))
        assert isinstance(died, ProcessDied) and "died" in str(died)
        (raised,) = scores(await w.run([([101, 10**6, 102], [0, 0, 0])]))
        assert isinstance(raised, ModelError) and "index" in str(raised)
        assert len(scores(await w.run(three_pairs(w)))) == 3
        assert w.state == WorkerState.READY

    asyncio.run(main())
    w.stop()
    assert obs.reasons == ["died", "died"] and obs.retried == 1
    assert obs.failed == ["process_died", "error"]


def test_a_restarted_model_process_keeps_the_first_ones_inference_choice(tiny_checkpoint):
    """inference=auto probes in the first model process; a replacement starts with that choice pinned
    (no second OpenVINO export and probe while the server is short of a replica)."""
    w = Worker(LoadSpec(str(tiny_checkpoint), inference="auto"), backend=hooked())

    async def main():
        w.start()
        await w.wait_ready()
        chosen, why = await w.job("inference_of")
        assert w.info is not None
        probed = w.info.details["inference_reason"]
        assert probed.startswith(("auto:", "torch:")), probed  # the probe ran, or OpenVINO is missing here
        # where the probe kept torch, a fresh process with torch pinned replaced the one that probed
        assert why == probed or (probed.startswith("auto:") and why == "inference=torch" == f"inference={chosen}")
        assert w.start_spec.inference == chosen
        templated = (await w.job("state"))["template"]
        first = w.pids[0]
        os.kill(first, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while (w.state != WorkerState.READY or w.pids[:1] in ([], [first])) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        again, why_again = await w.job("inference_of")
        assert again == chosen and why_again == f"inference={chosen}", why_again
        assert (await w.job("state"))["template"] == templated  # the pinned spec still takes the template

    asyncio.run(main())
    w.stop()
    assert w.restarts == 1


def test_every_model_process_serves_the_first_ones_inference_choice(tiny_checkpoint):
    """inference=auto: only the first model process probes and the others start with its choice pinned;
    two processes probing apart could choose differently near the margin, and a pair would then score
    differently by which one took it (seen in CI: 3.9184 against 3.9139 for one pair of the tiny model)."""
    w = Worker(LoadSpec(str(tiny_checkpoint), inference="auto"), replicas=2, backend=hooked())

    async def main():
        w.start()
        await w.wait_ready()
        while w.state != WorkerState.READY or len(w.pids) < 2:
            await asyncio.sleep(0.05)
        await asyncio.sleep(1)  # both replicas up and idle
        assert w.info is not None
        return w.info.details["inference_reason"], await asyncio.gather(w.job("engine"), w.job("engine"))

    probed, answers = asyncio.run(main())
    w.stop()
    assert len({pid for pid, _, _ in answers}) == 2, answers  # one job on each model process
    assert len({engine for _, engine, _ in answers}) == 1, answers
    reasons = [why for _, _, why in answers]
    if probed.startswith("auto:") and answers[0][1] == "torch":  # the prober was replaced by a pinned process
        assert reasons == ["inference=torch"] * 2, reasons
    else:  # OpenVINO won and the prober serves it, or OpenVINO is missing (no probe)
        assert sorted(why == f"inference={answers[0][1]}" for why in reasons) == [False, True], reasons
