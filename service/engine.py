"""The engine joins tokenisation, the batcher and the worker behind one call: score these pairs.

Tokenisation runs on its own thread, so it overlaps with the forward pass of the previous batch on
the worker thread; the event loop only awaits.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from model.classifier import cpu_has_native_bf16, resolve_device
from model.tokenizer import EncodedPairs
from service.batcher import Batcher, Closed, DeadlineExceeded, Overloaded
from service.errors import ErrorKind, ServiceError
from service.metrics import Metrics
from service.settings import Settings
from service.worker import LoadSpec, ModelInfo, PairOutput, Worker, WorkerState

log = logging.getLogger("qtrel.engine")


BUILTIN_MODELS = ("default", "pruned")  # shipped inside the package, under model/<name>


def default_model_dir(name: str = "default") -> Path:
    """A model shipped inside the package: model/default, or model/pruned (the default with 60% of its
    attention heads removed and fine-tuned again, docs/heads.md)."""
    import model

    return Path(model.__file__).resolve().parent / name


def resolve_model_dir(settings: Settings) -> Path:
    """A checkpoint directory, `builtin:<name>` for a model shipped in the package, or nothing for the
    built-in default."""
    if settings.model and not settings.model.startswith("builtin:"):
        return Path(settings.model)
    name = (settings.model or "builtin:default").removeprefix("builtin:")
    if name not in BUILTIN_MODELS:
        raise FileNotFoundError(f"no built-in model {name!r}; the package ships {', '.join(BUILTIN_MODELS)}")
    d = default_model_dir(name)
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"the built-in model {name!r} is missing at {d}")
    return d


def resolve_dtype(settings: Settings, device: torch.device) -> str:
    """`auto`: float16 on cuda; on cpu bfloat16 where the CPU has bfloat16 instructions (measured ~2.7x
    float32 with the predicted level unchanged on >99% of dev pairs, docs/benchmarks.md), else float32."""
    if settings.dtype != "auto":
        return settings.dtype
    if device.type == "cuda":
        return "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def cgroup_cpu_limit(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """The container's CPU quota in cores (cgroup v2 `cpu.max`, or v1 `cfs_quota_us`), None if unlimited."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
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


def resolve_layout(settings: Settings, device: torch.device, cores: int | None = None) -> tuple[int, int]:
    """(model processes, torch threads in each). On cpu, several single-thread processes beat one
    multi-thread process when serving: they do not stall on each other's OpenMP barriers when the HTTP
    server takes a core for a moment (on 2 cores: 1.4x the one-pair throughput, docs/design.md). Above
    4 cores, 4 threads per process keep the latency of one batch low. The thread worker and cuda use
    one replica."""
    cores = cores or usable_cores()
    if settings.worker == "thread" or device.type == "cuda":
        return 1, settings.threads
    threads, replicas = settings.threads, settings.replicas
    if not threads:
        threads = max(1, cores // replicas) if replicas else (1 if cores <= 4 else 4)
    return (replicas or max(1, cores // threads)), threads


# Requests with at most this many pairs are tokenised on the event loop (see Engine.score).
INLINE_PAIRS = 4


@dataclass
class Scored:
    outputs: list[PairOutput]
    enc: EncodedPairs


class Engine:
    def __init__(self, settings: Settings, metrics: Metrics):
        self.settings = settings
        self.metrics = metrics
        self.model_dir = resolve_model_dir(settings)
        self.draining = False
        device = resolve_device(settings.device)
        replicas, threads = resolve_layout(settings, device)
        spec = LoadSpec(str(self.model_dir), device=str(device), dtype=resolve_dtype(settings, device),
                        max_length=settings.max_length, threads=threads, warmup=settings.warmup,
                        max_batch_tokens=settings.max_batch_tokens)
        self.worker = Worker(spec, mode=settings.worker, replicas=replicas,
                             on_batch=metrics.inference_seconds.observe, on_restart=metrics.worker_restarts.inc)
        self.batcher: Batcher | None = None
        self._tok_pool = ThreadPoolExecutor(1, thread_name_prefix="qtrel-tokenize")

    # --- lifecycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        s = self.settings
        self.batcher = Batcher(
            self.worker.run,
            max_batch_tokens=s.max_batch_tokens,
            max_batch_size=s.max_batch_size,
            max_wait_s=s.max_wait_ms / 1000,
            max_queue_items=s.max_queue_pairs,
            max_queue_tokens=s.max_queue_tokens,
            observer=self.metrics,
            concurrency=self.worker.replicas,
        )
        self.batcher.start()
        self.worker.start()
        await self.worker.wait_ready()
        if self.worker.state == WorkerState.READY:
            m = self.model
            self.metrics.model_info.labels(m.name, str(m.device), m.dtype, _version()).set(1)
            self.metrics.ready.set(1)

    @property
    def model(self) -> ModelInfo:
        assert self.worker.info is not None
        return self.worker.info

    @property
    def ready(self) -> bool:
        return self.worker.state == WorkerState.READY and not self.draining

    def readiness(self) -> tuple[bool, str]:
        if self.draining:
            return False, "draining"
        if self.worker.state == WorkerState.FAILED:
            return False, f"model failed to load: {self.worker.error}"
        return self.worker.state == WorkerState.READY, self.worker.state.value

    async def drain(self, timeout: float) -> None:
        """Stop taking work; let admitted work finish (up to `timeout`)."""
        self.draining = True
        self.metrics.ready.set(0)
        if self.batcher and not await self.batcher.drain(timeout):
            log.warning("drain timed out with %d pairs outstanding", self.batcher.outstanding)

    async def stop(self) -> None:
        if self.batcher:
            await self.batcher.stop()
        await asyncio.to_thread(self.worker.stop)
        self._tok_pool.shutdown(wait=False, cancel_futures=True)

    # --- scoring ------------------------------------------------------------------------------
    def _check_ready(self) -> None:
        ok, why = self.readiness()
        if not ok:
            raise ServiceError(ErrorKind.NOT_READY, f"not ready: {why}", retry_after=1)

    async def score(
        self,
        queries: list[str],
        titles: list[str],
        truncation: str = "only_second",
        side: str = "right",
        timeout_ms: int | None = None,
        allow_truncation: bool = True,
    ) -> Scored:
        self._check_ready()
        assert self.batcher is not None
        deadline = time.monotonic() + (timeout_ms or self.settings.request_timeout_ms) / 1000
        try:
            self.batcher.check_admission(len(queries))  # refuse before spending work
        except Overloaded as e:
            self.metrics.rejected.labels("overloaded").inc()
            raise ServiceError(ErrorKind.OVERLOADED, str(e), retry_after=e.retry_after) from None
        except Closed as e:
            raise ServiceError(ErrorKind.NOT_READY, str(e), retry_after=1) from None
        t0 = time.perf_counter()
        loop = asyncio.get_running_loop()
        tok = self.model.tokenizer
        if len(queries) <= INLINE_PAIRS:  # ~50 us: cheaper here than a hop to the tokeniser thread
            enc = tok.encode(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
        else:
            enc = await loop.run_in_executor(
                self._tok_pool, lambda: tok.encode(queries, titles, truncation=truncation, side=side)  # type: ignore[arg-type]
            )
        self.metrics.tokenize_seconds.observe(time.perf_counter() - t0)
        if not allow_truncation and any(enc.truncated):
            i = enc.truncated.index(True)
            raise ServiceError(
                ErrorKind.TOO_LARGE,
                f"input {i} is longer than the model's {self.model.max_length} tokens; set truncate=true",
            )
        try:
            futures = self.batcher.submit(list(zip(enc.lengths, zip(enc.input_ids, enc.token_type_ids))), deadline)
        except Overloaded as e:
            self.metrics.rejected.labels("overloaded").inc()
            raise ServiceError(ErrorKind.OVERLOADED, str(e), retry_after=e.retry_after) from None
        except Closed as e:
            raise ServiceError(ErrorKind.NOT_READY, str(e), retry_after=1) from None
        try:
            outputs = await asyncio.gather(*futures)
        except DeadlineExceeded:
            self.metrics.rejected.labels("deadline").inc()
            raise ServiceError(ErrorKind.TIMEOUT, "the request's deadline passed before it was scored") from None
        except Closed as e:
            raise ServiceError(ErrorKind.NOT_READY, str(e), retry_after=1) from None
        except (asyncio.CancelledError, Exception) as e:
            for f in futures:  # the caller left, or the batch failed: drop what is still queued
                f.cancel()
            if isinstance(e, asyncio.CancelledError):
                raise
            raise ServiceError(ErrorKind.BACKEND, f"inference failed: {type(e).__name__}: {e}") from e
        self.metrics.pairs.inc(len(outputs))
        labels = self.model.labels
        for o in outputs:
            self.metrics.levels.labels(labels[o.level]).inc()
        return Scored(list(outputs), enc)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("qtrel")
    except PackageNotFoundError:
        return "0+unknown"
