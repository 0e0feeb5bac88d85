"""What the service runs, decided once from the settings and the machine: the model directory, the
device and precision, and the process layout (model processes x torch threads each). The composition
root (`service.app`) resolves a `Runtime` at start-up and hands its parts to the worker and the engine;
nothing else decides these. Also the process-level tuning both the server and its model processes use.
"""

from __future__ import annotations

import ctypes
import gc
import os
from dataclasses import dataclass
from pathlib import Path

from model.builtin import resolve_model
from model.device import resolve_device_name, resolve_dtype
from service.runtime.workers.backend import LoadSpec
from service.settings import Settings


@dataclass(frozen=True)
class Runtime:
    model_dir: Path
    device: str  # resolved: cpu, cuda, cuda:N
    dtype: str  # resolved: never "auto"
    worker: str  # process or thread
    replicas: int  # model processes (1 for the thread worker)
    threads: int  # torch intra-op threads per model; 0 = torch's default

    def load_spec(self, settings: Settings) -> LoadSpec:
        return LoadSpec(
            str(self.model_dir),
            device=self.device,
            dtype=self.dtype,
            max_length=settings.max_length,
            threads=self.threads,
            warmup=settings.warmup,
            max_batch_tokens=settings.max_batch_tokens,
            start=settings.process_start,
            inference=settings.inference,
            attention=settings.attention,
        )


def resolve_runtime(settings: Settings, cores: int | None = None, model: str | None = None) -> Runtime:
    """`cores`: this model's share (several models split the machine); `model`: its path (else the settings')."""
    device = resolve_device_name(settings.device)
    replicas, threads = resolve_layout(settings, device, cores)
    return Runtime(
        resolve_model(model if model is not None else settings.model),
        device,
        resolve_dtype(settings.dtype, device),
        settings.worker,
        replicas,
        threads,
    )


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The container's CPU quota in cores (cgroup v2 `cpu.max`, or v1 `cfs_quota_us`), None if unlimited."""
    try:
        limit, every = (root / "cpu.max").read_text().split()[:2]
        return None if limit == "max" else int(limit) / int(every)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cores() -> int:
    """Cores this process may use: its CPU affinity, capped by a container's CPU quota (Kubernetes
    limits are quotas, and a pod sees all of the node's cores)."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cores = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    return max(1, min(cores, int(limit))) if limit else cores


def memory_available(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes a new process could still take: the kernel's MemAvailable, capped by the container's
    memory limit (cgroup v2 memory.max - memory.current); None when neither can be read."""
    free = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                free = int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit != "max":
            left = int(limit) - int((root / "memory.current").read_text())
            free = left if free is None else min(free, left)
    except (OSError, ValueError):
        pass
    return free


def resolve_layout(settings: Settings, device: str, cores: int | None = None) -> tuple[int, int]:
    """(model processes, torch threads in each). On cpu, several single-thread processes beat one
    multi-thread process when serving: they do not stall on each other's OpenMP barriers when the HTTP
    server takes a core for a moment (on 2 cores: 1.4x the one-pair throughput, docs/design.md). Above
    4 cores, 4 threads per process keep the latency of one batch low. The thread worker and cuda use
    one replica."""
    cores = cores or usable_cores()
    if settings.worker == "thread" or device.startswith("cuda"):
        return 1, settings.threads
    threads, replicas = settings.threads, settings.replicas
    if not threads:
        threads = max(1, cores // replicas) if replicas else (1 if cores <= 4 else 4)
    return (replicas or max(1, cores // threads)), threads


def resolve_job_processes(settings: Settings, runtime: Runtime) -> tuple[str, str]:
    """Where score jobs' batches run, and why: "idle" (model processes of their own at the OS's idle priority,
    service.runtime.background) or "shared" (the live model processes, while free). Idle needs model processes
    on cpu; `auto` also keeps shared under a CPU quota below the cores this process sees (a Kubernetes limit):
    idle work spends the quota too, on cores the live processes do not use, and once it is spent the kernel
    throttles every process of the container, the live ones with it."""
    if settings.job_processes == "shared":
        return "shared", "set"
    if runtime.worker != "process" or runtime.device != "cpu":
        return "shared", f"the {runtime.worker} worker on {runtime.device}"
    if settings.job_processes == "idle":
        return "idle", "set"
    try:
        seen = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        seen = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None and limit < seen:
        return "shared", f"auto: a CPU quota of {limit:g} cores, below the {seen} cores seen"
    return "idle", "auto"


def resolve_http_workers(settings: Settings) -> tuple[int, str]:
    """The front processes to run, and why. `auto`: on a GPU the model needs few host cores, so half the
    cores serve HTTP; on a CPU the model processes need the cores, and a second front only pays where
    they have at least 8 (measured on 2 vCPUs: docs/fronts-bench.md), then one front per 8 cores."""
    if settings.http_workers != "auto":
        return int(settings.http_workers), "set"
    cores = usable_cores()
    if resolve_device_name(settings.device).startswith("cuda"):
        return max(1, min(8, cores // 2)), f"auto: cuda, {cores} cores"
    return max(1, min(4, cores // 8)), f"auto: cpu, {cores} cores"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qtrel")
    except PackageNotFoundError:
        return "0+unknown"


def quiet_gc() -> None:
    """For a process that is qtrel's alone, after start-up: move every object alive now (torch, the
    app, the model) out of the cyclic garbage collector's sight, and collect the youngest generation
    less often. Full collections otherwise rescan hundreds of thousands of start-up objects while
    requests wait; this was worth 8-17% more one-pair requests per second (docs/design.md)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 50, 100)


def release_free_memory() -> None:
    """Hand memory freed by the warm-up back to the OS (glibc keeps it otherwise): warming every kernel
    shape up to 8192 tokens peaks at ~690 MB RSS in the process that warms up (the fork server's template,
    or a spawned model process), ~470 MB after this."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
