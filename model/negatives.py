"""Sampled negatives: catalogue titles paired with a query they were never judged for, labelled level 1.

Judged pairs are candidates a search engine already retrieved, so almost none is unrelated; a service
sees whatever retrieval returns, junk included. Pairing a query with a title judged only for other
queries teaches the model (and tests it on) that end of the scale. The title set for a query excludes
every title judged for that query, compared case- and space-insensitively, so a negative never repeats
a judged pair.
"""

from __future__ import annotations

import random
from collections import defaultdict

from model.data import Dataset, Example


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def judged_titles(ds: Dataset) -> dict[str, set[str]]:
    """Normalised query -> normalised titles judged for it."""
    seen: dict[str, set[str]] = defaultdict(set)
    for e in ds.examples:
        seen[_norm(e.query)].add(_norm(e.title))
    return seen


def sample_negatives(ds: Dataset, ratio: float, seed: int, label: int = 0) -> list[Example]:
    """`round(ratio * len(ds))` negatives. Each picks a judged pair at random (so queries appear as often
    as they are judged) and pairs its query with a random catalogue title not judged for that query.
    The catalogue is the distinct titles of `ds`. Deterministic for a seed."""
    if ratio < 0:
        raise ValueError(f"negatives ratio must be >= 0, got {ratio}")
    n = round(ratio * len(ds))
    if n == 0:
        return []
    rng = random.Random(seed)
    judged = judged_titles(ds)
    catalogue = sorted({e.title for e in ds.examples})
    if len(catalogue) < 2:
        raise ValueError("negatives need a catalogue of at least two distinct titles")
    out = []
    for _ in range(n):
        anchor = ds.examples[rng.randrange(len(ds))]
        own = judged[_norm(anchor.query)]
        if len(own) >= len(catalogue):
            continue  # this query was judged against every title: nothing to sample
        while True:
            title = catalogue[rng.randrange(len(catalogue))]
            if _norm(title) not in own:
                break
        out.append(Example(anchor.query, title, label, relevance=1.0 if anchor.relevance is not None else None))
    return out


def with_negatives(ds: Dataset, ratio: float, seed: int) -> Dataset:
    """`ds` followed by its sampled negatives (level index 0)."""
    return Dataset(ds.examples + sample_negatives(ds, ratio, seed), path=ds.path)
