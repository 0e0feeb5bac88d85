"""Bulk scoring: files of pairs (CSV, JSON lines, Parquet) on one machine (`score`) or a Ray cluster (`ray`).

`model.bulk.score_file` is the documented library call; it lives in `model.bulk.score` and is looked up
on first use, so that importing the wing's command line (`qtrel`'s parser) does not load torch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from model.bulk.score import score_file

__all__ = ["score_file"]


def __getattr__(name: str) -> Any:
    if name == "score_file":
        from model.bulk.score import score_file

        return score_file
    raise AttributeError(f"module 'model.bulk' has no attribute {name!r}")
