"""Bulk scoring: files of pairs (CSV, JSON lines, Parquet) on one machine (`score`) or a Ray cluster (`ray`).

`model.bulk.score_file` is the documented library call; it lives in `model.bulk.score`."""

from model.bulk.score import score_file

__all__ = ["score_file"]
