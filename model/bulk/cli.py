"""`qtrel score`: bulk scoring of a file, on one machine (`model.bulk.score`) or on a Ray cluster (`model.bulk.ray`).
Parsing and dispatch only; heavy imports happen inside the command."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

from model.cli import add_device_options, fail
from model.levels import CHUNK_OVERLAP, MAX_BATCH_TOKENS


def add_commands(sub: argparse._SubParsersAction) -> None:
    """The wing's one command; `qtrel`'s parser (service/cli.py) merges it with the others."""
    add_score(sub)


def add_score(sub) -> None:
    p = sub.add_parser(
        "score",
        help="score every query-title pair of a CSV, JSON lines or Parquet file into a file "
        "of the same format (or, with --ray, on a Ray cluster)",
    )
    p.add_argument(
        "input", help="file with query and title columns (.csv, .jsonl/.json, .parquet); --ray: also a folder"
    )
    p.add_argument("--out", required=True, help="output file (same format); --ray: an output folder of part files")
    p.add_argument(
        "--model", default="builtin:default", help="checkpoint directory or builtin:default / builtin:pruned"
    )
    p.add_argument("--query-column", default="query")
    p.add_argument("--title-column", default="title")
    p.add_argument(
        "--prefix",
        default="",
        help="prefix of the score columns (level, score, p_<label>), e.g. pred_ when the input has a level column",
    )
    add_device_options(p)
    p.add_argument("--max-length", type=int, default=128, help="tokens per pair")
    p.add_argument("--max-batch-tokens", type=int, default=MAX_BATCH_TOKENS, help="padded tokens per forward pass")
    p.add_argument("--threads", type=int, default=0, help="cores to use, as torch threads (0: torch's default)")
    p.add_argument(
        "--workers",
        type=int,
        default=0,
        help="batches forwarded at once, each on threads/workers cores (0: one per core up to 4; 1: each batch on "
        "every thread)",
    )
    p.add_argument("--chunk-rows", type=int, default=20000, help="rows read, scored and written at a time")
    p.add_argument(
        "--max-chunks",
        type=int,
        default=None,
        help="score each title longer than the model's window in at most N overlapping windows of whole words and "
        "give it its best window's scores; adds the columns window, windows, window_start, window_end",
    )
    p.add_argument(
        "--chunk-overlap", type=int, default=CHUNK_OVERLAP, help="--max-chunks: word pieces consecutive windows share"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="keep the rows OUTPUT holds (to the last whole chunk) and "
        "score the rest; use the first run's model and --chunk-rows",
    )
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUTPUT")
    p.add_argument(
        "--skip-bad",
        action="store_true",
        help="write rows with a missing or empty query or title with empty scores instead of stopping",
    )
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="score on a Ray cluster with Ray Data: local, auto or ray://host:port (pip install 'qtrel[ray]')",
    )
    p.add_argument("--num-actors", type=int, default=2, help="--ray: actors, one model each")
    p.add_argument("--batch-size", type=int, default=1024, help="--ray: rows per map_batches call")
    p.add_argument("--num-cpus", type=float, default=1.0, help="--ray: CPUs per actor (= its torch threads)")
    p.add_argument("--num-gpus", type=float, default=0.0, help="--ray: GPUs per actor; > 0 runs the model on cuda")


def cmd_score(a) -> int:
    from model.builtin import resolve_model
    from model.bulk.score import ScoreOptions, score_file

    try:  # the rule of `qtrel serve --model`
        model_dir = resolve_model(a.model)
    except FileNotFoundError as e:
        return fail(a, e)
    try:
        options = ScoreOptions(
            query_column=a.query_column,
            title_column=a.title_column,
            prefix=a.prefix,
            max_batch_tokens=a.max_batch_tokens,
            skip_bad=a.skip_bad,
            overwrite=a.overwrite,
            max_chunks=a.max_chunks,
            chunk_overlap=a.chunk_overlap,
        )
        if a.workers < 0:
            raise ValueError(f"--workers must be 0 (one per core) or more, got {a.workers}")
        if a.ray and a.resume:
            raise ValueError("--resume works on one machine only: a Ray run writes its output folder anew")
        if a.ray:
            from model.bulk.ray import RayCluster, score_dataset_ray

            cluster = RayCluster(a.ray, a.num_actors, a.batch_size, a.num_cpus, a.num_gpus)
            summary = score_dataset_ray(
                a.input, a.out, model_dir, options, cluster, dtype=a.dtype, max_length=a.max_length
            )
        else:
            import torch

            from model.relevance import RelevanceModel

            if a.threads:
                torch.set_num_threads(a.threads)
            model = RelevanceModel.load(model_dir, device=a.device, dtype=a.dtype, max_length=a.max_length)
            model.workers = a.workers
            summary = score_file(
                model, a.input, a.out, options, chunk_rows=a.chunk_rows, resume=a.resume, progress=a.progress
            )
    except ValueError as e:
        return fail(a, e)
    print(json.dumps(summary))
    return 0


COMMANDS: dict[str, Callable[[argparse.Namespace], int]] = {"score": cmd_score}
