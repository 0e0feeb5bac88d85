"""The model's side of the backend contract, the same in either backend: load, warm up, answer a message.

It uses only the model's public contract (`RelevanceModel.load`, `warm_up`, `logits`, `score`,
`describe`). Extra jobs are looked up by name in `JOBS`, so a message names a job and never carries a
callable.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Callable, Sequence

import torch

from model.device import resolve_device
from model.relevance import RelevanceModel
from model.tokenizer import unpack_pair
from service.runtime.workers.backend import Encoded, Error, Forward, Forwarded, Job, LoadSpec, Reply, Result

log = logging.getLogger("qtrel.worker")

# Named jobs a model runs between batches: name -> "module:function", called as function(model, ...).
JOBS: dict[str, str] = {
    "explain": "model.explain:explain_pair",
}


def set_threads(threads: int) -> None:
    if threads and threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def load_model(spec: LoadSpec) -> RelevanceModel:
    set_threads(spec.threads)
    t0 = time.perf_counter()
    m = RelevanceModel.load(
        spec.model_dir,
        device=str(resolve_device(spec.device)),
        dtype=spec.dtype,
        max_length=spec.max_length,
        attention=spec.attention,
    )
    log.info("loaded %s on %s/%s in %.2fs", spec.model_dir, m.device, m.dtype, time.perf_counter() - t0)
    return m


def start_inference(model: RelevanceModel, spec: LoadSpec) -> None:
    """The spec's inference choice (RelevanceModel.use_inference), after the torch threads are set. Never in
    the fork server's template: OpenVINO starts thread pools, and the template must fork with one thread."""
    t0 = time.perf_counter()
    model.use_inference(spec.inference)  # "torch": nothing to build, and OpenVINO is never imported
    if spec.inference != "torch":
        log.info("inference %s (%s) in %.2fs", model.inference, model.inference_reason, time.perf_counter() - t0)


def warm_up(model: RelevanceModel, spec: LoadSpec, kernels: bool = True) -> None:
    """`kernels=False`: a process forked from a template that built them (RelevanceModel.warm_up)."""
    if spec.warmup:
        t0 = time.perf_counter()
        model.warm_up(spec.max_batch_tokens, kernels=kernels)
        log.info("warm-up done in %.2fs", time.perf_counter() - t0)


def forward_in_halves(forward: Callable[[Sequence[Encoded]], torch.Tensor], batch: Sequence[Encoded]) -> torch.Tensor:
    """Run `forward`; on a CUDA out-of-memory error split the batch in two and retry each half."""
    try:
        return forward(batch)
    except torch.cuda.OutOfMemoryError:
        if len(batch) == 1:
            raise
        torch.cuda.empty_cache()
        mid = len(batch) // 2
        log.warning("out of memory on %d pairs; retrying in halves", len(batch))
        return torch.cat([forward_in_halves(forward, batch[:mid]), forward_in_halves(forward, batch[mid:])])


def forward_batch(model: RelevanceModel, batch: Sequence[Encoded]) -> Forwarded:
    """One batch through the model's one scoring call, its rows packed (model.levels.pack_row: the engine keeps
    them as bytes), and the forward's seconds."""
    t0 = time.perf_counter()
    batch = [unpack_pair(x) for x in batch]  # packed by a front process: lists built here, not in the engine core
    logits = forward_in_halves(lambda b: model.logits([x[0] for x in b], [x[1] for x in b]), batch)
    seconds = time.perf_counter() - t0
    return model.score(logits).map(torch.Tensor.numpy).pack(), seconds


def _function(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def resolve_job(name: str) -> Callable:
    target = JOBS.get(name)
    if target is None:
        raise KeyError(f"no job named {name!r}")
    return _function(target)


def handle(model: RelevanceModel, spec: LoadSpec, message: Forward | Job) -> Reply:
    """The reply to one Forward or Job (the backends' default `Answer`); an exception becomes an Error for
    that message only."""
    try:
        if isinstance(message, Forward):
            return Result(forward_batch(model, message.batch))
        return Result(resolve_job(message.name)(model, *message.args, **message.kwargs))
    except Exception as e:
        return Error(type(e).__name__, str(e))
