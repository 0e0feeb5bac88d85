"""The runtime, resolved once from the settings and the machine: model directory, dtype, process layout."""

from __future__ import annotations

from pathlib import Path

import pytest

from service.runtime.layout import Runtime, resolve_runtime
from service.runtime.workers.backend import LoadSpec
from service.settings import Settings


def test_the_runtime_is_resolved_once_into_what_the_worker_loads(tmp_path):
    s = Settings(
        model=str(tmp_path),
        device="cpu",
        dtype="float32",
        threads=1,
        replicas=2,
        max_length=64,
        warmup=False,
        max_batch_tokens=2048,
        inference="openvino",
    )
    rt = resolve_runtime(s, cores=2)
    assert rt == Runtime(Path(tmp_path), "cpu", "float32", "process", 2, 1)
    assert rt.load_spec(s) == LoadSpec(
        str(tmp_path),
        device="cpu",
        dtype="float32",
        max_length=64,
        threads=1,
        warmup=False,
        max_batch_tokens=2048,
        inference="openvino",
    )
    thread = resolve_runtime(Settings(model=str(tmp_path), device="cpu", worker="thread"), cores=8)
    assert (thread.worker, thread.replicas) == ("thread", 1) and thread.dtype in ("float32", "bfloat16")


# --- where the model runs: processes x threads --------------------------------------------------
@pytest.mark.parametrize(
    ("env", "cores", "want"),
    [
        ({}, 2, (2, 1)),  # small cpu: one single-thread process per core
        ({}, 4, (4, 1)),
        ({}, 16, (4, 4)),  # larger: 4 threads each keeps one batch's latency low
        ({"threads": 2}, 2, (1, 2)),
        ({"replicas": 1}, 2, (1, 2)),
        ({"replicas": 3, "threads": 2}, 2, (3, 2)),  # explicit values win
        ({"worker": "thread"}, 8, (1, 0)),
    ],
)
def test_worker_layout(env, cores, want):

    from service.runtime.layout import resolve_layout

    assert resolve_layout(Settings(**env), "cpu", cores) == want


def test_worker_layout_on_cuda_is_one_process():

    from service.runtime.layout import resolve_layout

    assert resolve_layout(Settings(), "cuda", 16) == (1, 0)


def test_cgroup_cpu_quota_is_read(tmp_path):
    from service.runtime.layout import cgroup_cpu_limit

    assert cgroup_cpu_limit(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 2.0
