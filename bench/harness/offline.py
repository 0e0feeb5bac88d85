"""The offline reference of the serving benchmarks: RelevanceModel.predict over the same pairs on the same
cores, laid out as one process with every thread and as one single-thread process per core."""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any


def offline_share(model_dir: str, dtype: str, threads: int, pairs: list, repeats: int, start, out) -> None:
    """One offline process: load, warm up, wait for the others, then time predict `repeats` times."""
    import torch

    from model.relevance import RelevanceModel

    torch.set_num_threads(threads)
    m = RelevanceModel.load(model_dir, dtype=dtype)
    m.predict(pairs)
    start.wait()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        m.predict(pairs)
        times.append(time.perf_counter() - t0)
    out.put(times)


def offline_pairs_per_s(
    model_dir: Path, pair_sets: dict[str, list], cores: int, repeats: int, dtype: str = "auto"
) -> tuple[dict, dict]:
    """RelevanceModel.predict over each pair set (length-sorted, 8192-token batches), laid out two ways
    on the same cores: one process with `cores` torch threads, and `cores` single-thread processes each
    scoring its share at the same time. The reference is the faster of the two, per pair set.
    Returns ({set: best pairs/s}, {set: {layout: pairs/s}})."""
    import multiprocessing as mp

    import torch

    from model.device import resolve_dtype
    from model.parallel import plan

    dtype = resolve_dtype(dtype, torch.device("cpu"))
    print(f"offline: {dtype}")
    ctx = mp.get_context("spawn")
    best: dict[str, float] = {}
    layouts: dict[str, dict[str, float]] = {}
    for name, pairs in pair_sets.items():
        layouts[name] = {}
        for procs, threads in ((1, cores), (cores, 1)) if cores > 1 else ((1, 1),):
            start, out = ctx.Barrier(procs), ctx.Queue()
            shares = [pairs[i::procs] for i in range(procs)]
            workers = [
                ctx.Process(target=offline_share, args=(str(model_dir), dtype, threads, share, repeats, start, out))
                for share in shares
            ]
            for w in workers:
                w.start()
            times = [out.get() for _ in workers]
            for w in workers:
                w.join()
            # repeat r ends when its slowest process ends; median over repeats
            wall = statistics.median(max(t[r] for t in times) for r in range(repeats))
            layout = f"{procs} process{'es' if procs > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
            if plan(threads)[0] > 1:  # predict forwards its batches on workers (model.parallel)
                layout += f" ({plan(threads)[0]} forward workers)"
            layouts[name][layout] = len(pairs) / wall
            print(f"offline {name}, {layout}: {layouts[name][layout]:.0f} pairs/s over {len(pairs)} pairs")
        best[name] = max(layouts[name].values())
    return best, layouts


def throughput(
    models: dict[str, Any], pairs: list, repeats: int, max_batch_tokens: int = 4096, warmup_pairs: int = 256
) -> dict[str, float]:
    """Pairs/s per model (RelevanceModel.predict), median over repeats, models interleaved (order rotated)
    within each repeat."""
    names = list(models)
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        models[n].predict(pairs[:warmup_pairs])  # warm-up: kernel selection per shape
    for r in range(repeats):
        for n in names[r % len(names) :] + names[: r % len(names)]:
            t0 = time.perf_counter()
            models[n].predict(pairs, max_batch_tokens=max_batch_tokens)
            times[n].append(time.perf_counter() - t0)
    return {n: len(pairs) / statistics.median(ts) for n, ts in times.items()}
