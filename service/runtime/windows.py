"""Documents in windows for the engine (`Engine.score_windows`): each title longer than the model's window
(what the query leaves of `max_length`) is split by `model.windows.split_pairs` into at most `max_chunks` overlapping
windows; every window is scored with its query as an ordinary pair (so windows share the batcher's token
budget, the cache and single flight with everything else), and each document gets its best window's
scores. No HTTP, no torch."""

from __future__ import annotations

from model.levels import PairScore
from model.windows import Window, best
from service.runtime.results import Scored, WindowPick


class TooManyWindows(ValueError):
    """The request's documents make more windows than a request may hold pairs."""

    def __init__(self, windows: int, limit: int):
        super().__init__(f"the documents make {windows} windows; at most {limit} pairs per request")


def flatten(queries: list[str], docs: list[list[Window]]) -> tuple[list[str], list[str]]:
    """The pairs to score: each window with its document's query, documents in order."""
    qs, ts = [], []
    for q, windows in zip(queries, docs):
        qs += [q] * len(windows)
        ts += [w.text for w in windows]
    return qs, ts


def reduce(
    outputs: list[PairScore],
    lengths: list[int],
    truncated: list[bool],
    docs: list[list[Window]],
    labels: list[str],
    model: str,
    unknown: list[float],
) -> Scored:
    """Each document's best window (the highest expected level, the first of equals), from the windows'
    scores in `flatten`'s order."""
    picks: list[WindowPick] = []
    res = Scored([], [], [], labels, model, [], picks, window_tokens=sum(lengths))
    i = 0
    for windows in docs:
        n = len(windows)
        k = best([o.expected for o in outputs[i : i + n]])
        res.outputs.append(outputs[i + k])
        res.lengths.append(lengths[i + k])
        res.truncated.append(truncated[i + k])
        res.unknown.append(unknown[i + k])
        picks.append(WindowPick(k, n, windows[k].start, windows[k].end))
        i += n
    return res
