"""Many batches on several cores in one process (model.parallel): workers of one thread each, their torch
threads set per worker and the caller's left as they were, and `encoded_logits` on them giving the numbers
one thread gives, with both kernel kinds and with head masks."""

from __future__ import annotations

import threading

import pytest
import torch

from model.parallel import MAX_WORKERS, MIN_BATCH_TOKENS, ForwardWorkers, batch_budget, plan, run_batches, workers_for
from tests.conftest import read_pairs


@pytest.mark.parametrize(
    "threads, workers, want",
    [(1, 0, (1, 1)), (2, 0, (2, 1)), (3, 0, (3, 1)), (6, 0, (4, 1)), (8, 0, (4, 2)), (8, 2, (2, 4)), (2, 5, (2, 1))],
)
def test_plan_gives_one_worker_per_core_up_to_the_cap(threads, workers, want):
    assert MAX_WORKERS == 4
    assert plan(threads, workers) == want


def test_each_worker_runs_its_own_thread_count_and_the_callers_stay():
    torch.set_num_threads(3)
    try:
        pool = ForwardWorkers(2, 1)
        seen = pool.map(lambda _: (threading.current_thread().name, torch.get_num_threads()), range(8))
        fresh: list[int] = []
        t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 3
        assert fresh == [3]  # a thread started later gets the caller's default, not the workers'
    finally:
        pool.close()
        torch.set_num_threads(1)
    assert {n for _, n in seen} == {1}
    assert all(name.startswith("qtrel-forward") for name, _ in seen)


def test_an_error_is_raised_after_every_item_has_run():
    pool = ForwardWorkers(2, 1)
    done: list[int] = []

    def work(i: int) -> int:
        if i == 0:
            raise ValueError("bad batch")
        threading.Event().wait(0.05)
        done.append(i)
        return i

    with pytest.raises(ValueError, match="bad batch"):
        pool.map(work, range(5))
    assert sorted(done) == [1, 2, 3, 4]
    assert run_batches(pool, lambda i: i * 2, [1, 2, 3]) == [2, 4, 6]
    # a lone batch runs on a worker too, on its threads: the same bits as in a call of many batches
    where = run_batches(pool, lambda i: (threading.current_thread().name, torch.get_num_threads()), [0])
    assert where[0][0].startswith("qtrel-forward") and where[0][1] == pool.threads_each
    pool.close()


def test_a_pool_is_kept_while_the_plan_holds_and_replaced_when_it_changes():
    assert workers_for(None, 1) is None
    a = workers_for(None, 2)
    assert a is not None and (a.workers, a.threads_each) == (2, 1)
    assert workers_for(a, 2) is a
    b = workers_for(a, 4, workers=2)
    assert b is not a and (b.workers, b.threads_each) == (2, 2)
    b.close()
    with pytest.raises(ValueError):
        ForwardWorkers(1, 2)


def test_few_pairs_come_in_smaller_batches_whatever_the_workers():
    assert batch_budget(6_800, 8192) == MIN_BATCH_TOKENS  # 256 dev pairs: several batches for every worker
    assert batch_budget(131_072, 8192) == 8192
    assert batch_budget(65_536, 8192) == 4096  # BATCHES_PER_WORKER x MAX_WORKERS batches
    assert batch_budget(6_800, 96) == 96


@pytest.mark.parametrize("masked", [False, True])
def test_encoded_logits_on_workers_equal_one_thread(kernels, masked):
    enc = kernels.encode(read_pairs(40) + read_pairs(12, "qbqtc"))
    head_mask = None
    if masked:
        head_mask = torch.ones(kernels.cfg.num_hidden_layers, kernels.cfg.num_attention_heads)
        head_mask[0, 1] = 0
    one = kernels.encoded_logits(enc, max_batch_tokens=96, head_mask=head_mask)  # many small batches
    assert kernels.forward_workers() is None  # one torch thread (tests/model/conftest.py)
    torch.set_num_threads(2)
    try:
        pool = kernels.forward_workers()
        assert pool is not None and (pool.workers, pool.threads_each) == (2, 1)
        two = kernels.encoded_logits(enc, max_batch_tokens=96, head_mask=head_mask)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    torch.testing.assert_close(two, one, rtol=0, atol=1e-5)
