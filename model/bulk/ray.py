"""Bulk scoring on a Ray cluster with Ray Data: `qtrel score INPUT --out OUTPUT_DIR --ray ADDRESS`.

Ray Data reads the input as a dataset (`read_csv`, `read_json` for JSON lines, `read_parquet`; the query
and title columns are read as strings), `map_batches` scores it in an actor pool, one `RelevanceModel`
per actor (CPU, or a GPU each with `num_gpus`), and the dataset is written to OUTPUT_DIR as part files of
the input's format. Every row gets the columns of `qtrel score` on one machine (`model.bulk.score`): `level`,
`score` (expected level) and `p_<label>`, from the same scoring code, so the numbers agree with the
single-machine command (to float32 rounding). The part files are in no particular order unless
`preserve_order`; keep a key column in the input to join on.

Ray is an optional extra (`pip install 'qtrel[ray]'`), imported only inside `score_dataset_ray`. On a
cluster, `model_dir` must be readable on every node (shared storage, or the installed package's
built-in models).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from model.bulk.io import check_collision, format_of, pair_or_problem, score_columns
from model.bulk.parquet import append_scores
from model.bulk.score import SOURCES, ScoreOptions, score_names, score_pairs
from model.checkpoint import load_config
from model.data import DataError
from model.relevance import RelevanceModel

__all__ = ["RayCluster", "RayScorer", "score_dataset_ray"]

log = logging.getLogger("qtrel.ray")


class RayScorer:
    """The `map_batches` callable: loads one model when the actor starts, then scores pyarrow batches."""

    def __init__(
        self,
        model_dir: str,
        options: ScoreOptions,
        device: str = "cpu",
        dtype: str = "auto",
        max_length: int = 128,
        threads: int = 0,
    ):
        import torch

        if threads:
            torch.set_num_threads(threads)
        self.model = RelevanceModel.load(model_dir, device=device, dtype=dtype, max_length=max_length)
        self.options = options
        self.names = score_names(self.model.labels, options.prefix, options.max_chunks is not None)

    def __call__(self, batch):
        o = self.options
        pairs: list[tuple[str, str] | None] = []
        qs, ts = batch.column(o.query_column).to_pylist(), batch.column(o.title_column).to_pylist()
        for q, t in zip(qs, ts):
            p = pair_or_problem(q, t, o.query_column, o.title_column)
            if isinstance(p, str) and not o.skip_bad:
                raise DataError(
                    f"bad row ({p}): {o.query_column}={q!r}, {o.title_column}={t!r}; pass skip_bad (--skip-bad) "
                    "to write such rows with empty scores"
                )
            pairs.append(None if isinstance(p, str) else p)
        scored = score_pairs(self.model, pairs, o.max_batch_tokens, o.max_chunks, o.chunk_overlap)
        return append_scores(batch, self.names, *score_columns(scored, self.model.labels))


def _read(ray, path: Path, kind: str, qc: str, tc: str):
    import pyarrow as pa

    strings = {qc: pa.string(), tc: pa.string()}
    if kind == "csv":
        from pyarrow import csv as pacsv

        return ray.data.read_csv(str(path), convert_options=pacsv.ConvertOptions(column_types=strings))
    if kind == "jsonl":
        from pyarrow import json as pajson

        schema = pa.schema(list(strings.items()))
        return ray.data.read_json(  # Arrow's reader: one JSON object per line
            str(path),
            parse_options=pajson.ParseOptions(explicit_schema=schema, unexpected_field_behavior="infer"),
        )
    return ray.data.read_parquet(str(path))


@dataclass(frozen=True)
class RayCluster:
    """Where and how a Ray run scores: the cluster, the actor pool and each actor's resources."""

    address: str = "local"  # local starts a cluster here (or uses ray.init's); else ray.init(address=...)
    num_actors: int = 2  # actors in the pool, each with its own model
    batch_size: int = 1024  # rows per map_batches call
    num_cpus: float = 1.0  # per actor (its torch threads, at least 1)
    num_gpus: float = 0.0  # per actor; > 0 runs the model on cuda
    preserve_order: bool = False  # output rows in input order (slower)


def score_dataset_ray(
    input: str | Path,
    output: str | Path,
    model_dir: str | Path,
    options: ScoreOptions | None = None,
    cluster: RayCluster | None = None,
    *,
    dtype: str = "auto",
    max_length: int = 128,
) -> dict:
    """Score INPUT (a file or a folder of files of one format) into the folder OUTPUT on a Ray cluster.

    `cluster.address`: `local` starts a local cluster on this machine (or uses the one `ray.init` already
    started in this process); anything else is passed to `ray.init(address=...)`, e.g. `auto` or
    `ray://head:10001`. Each `map_batches` call of `cluster.batch_size` rows forwards its rows in
    length-sorted batches of at most `options.max_batch_tokens` padded tokens. With num_gpus > 0 the model
    runs on cuda, else on cpu with int(num_cpus) torch threads (at least 1). On a small local cluster give
    each actor a fraction of a CPU
    (num_cpus=0.5): Ray Data budgets the CPUs between the read, map and write steps, and on 2 CPUs one
    actor asking for a whole CPU was seen to wait for ever behind the read task. Returns a summary:
    output, files written, seconds."""
    options, cluster = options or ScoreOptions(), cluster or RayCluster()
    try:
        import ray
        import ray.data
    except ImportError:
        raise ValueError("--ray needs Ray Data: pip install 'qtrel[ray]'") from None
    input, output = Path(input), Path(output)
    kind = format_of(next(iter(sorted(input.iterdir()))) if input.is_dir() else input)
    if output.exists() and any(output.iterdir()) and not options.overwrite:
        raise ValueError(f"{output} exists and is not empty: remove it or pass --overwrite")
    if cluster.num_actors < 1 or cluster.batch_size < 1:
        raise ValueError("num_actors and batch_size must be at least 1")
    names = score_names(load_config(Path(model_dir)).levels, options.prefix, options.max_chunks is not None)
    if input.is_file() and kind != "jsonl":  # before a cluster starts: the header says it
        check_collision(names, SOURCES[kind](input, options.query_column, options.title_column).columns or [], input)
    if not ray.is_initialized():
        ray.init(address=None if cluster.address == "local" else cluster.address, log_to_driver=False)
    cpus = ray.cluster_resources().get("CPU", 0.0)
    if cluster.num_actors * cluster.num_cpus > cpus - 1:  # reading and writing need a CPU too, or it stalls
        message = (
            f"{cluster.num_actors} actors x {cluster.num_cpus} CPUs leave less than one of the cluster's {cpus:g} "
            "CPUs for reading and writing: use fewer actors or a fraction of a CPU each (num_cpus=0.5)"
        )
        if cluster.address == "local":
            raise ValueError(message)
        log.warning("%s (going on: a cluster that scales up may find them)", message)
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = cluster.preserve_order
    ds = _read(ray, input, kind, options.query_column, options.title_column)
    check_collision(names, ds.schema().names, input)
    scorer_args = dict(
        model_dir=str(model_dir),
        options=options,
        device="cuda" if cluster.num_gpus > 0 else "cpu",
        dtype=dtype,
        max_length=max_length,
        threads=0 if cluster.num_gpus > 0 else max(1, int(cluster.num_cpus)),
    )
    t0 = time.perf_counter()
    scored = ds.map_batches(
        RayScorer,
        fn_constructor_kwargs=scorer_args,
        batch_size=cluster.batch_size,
        batch_format="pyarrow",
        compute=ray.data.ActorPoolStrategy(size=cluster.num_actors),
        num_cpus=cluster.num_cpus,
        num_gpus=cluster.num_gpus or None,
    )
    from ray.data import SaveMode

    write = {"csv": scored.write_csv, "jsonl": scored.write_json, "parquet": scored.write_parquet}[kind]
    write(str(output), mode=SaveMode.OVERWRITE if options.overwrite else SaveMode.APPEND)
    files = sorted(p for p in output.iterdir() if p.is_file()) if output.is_dir() else []
    return {
        "input": str(input),
        "output": str(output),
        "files": len(files),
        "actors": cluster.num_actors,
        "seconds": round(time.perf_counter() - t0, 3),
    }
