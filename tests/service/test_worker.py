"""The worker's out-of-memory policy, and the worker on the real tiny model."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model.classifier import RelevanceModel
from service.worker import Worker, WorkerState, forward_in_halves
from tests.conftest import read_pairs


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


def test_worker_loads_warms_and_scores(tiny_checkpoint):
    w = Worker(lambda: RelevanceModel.load(tiny_checkpoint))

    async def main():
        w.start()
        await w.wait_ready()
        assert w.state == WorkerState.READY
        m = w.model
        enc = m.encode(read_pairs(5))
        outs = await w.run(list(zip(enc.input_ids, enc.token_type_ids)))
        want = m.probs(enc.input_ids, enc.token_type_ids)
        assert torch.allclose(torch.tensor([o.probs for o in outs]), want, atol=1e-6)
        assert await w.call(lambda model: model.labels) == ["1", "2", "3", "4", "5"]

    asyncio.run(main())
    w.stop()
    assert w.state == WorkerState.STOPPED


def test_worker_reports_a_failed_load(tmp_path):
    w = Worker(lambda: RelevanceModel.load(tmp_path))  # not a checkpoint

    async def main():
        w.start()
        await w.wait_ready()
        with pytest.raises(RuntimeError, match="not ready"):
            await w.run([([101, 102], [0, 0])])

    asyncio.run(main())
    assert w.state == WorkerState.FAILED and "config.json" in w.error
