"""What the worker hands to its callers beside scored pairs (model.levels.PairScore): the model's description,
and the observer it reports faults and timings to (service.runtime.workers.worker re-exports these)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from model.tokenizer import PairTokenizer


@dataclass(frozen=True)
class ModelInfo:
    """What the server process knows of the model: metadata and the tokenizer, no weights."""

    name: str
    labels: list[str]
    max_length: int
    device: str
    dtype: str
    tokenizer: PairTokenizer
    details: dict  # RelevanceModel.describe(): everything /info shows about the model

    @classmethod
    def of(cls, described: dict, tokenizer: PairTokenizer) -> ModelInfo:
        keys = ("name", "labels", "max_length", "device", "dtype")
        return cls(**{k: described[k] for k in keys}, tokenizer=tokenizer, details=described)


class WorkerObserver(Protocol):
    def forwarded(self, seconds: float) -> None: ...
    def restarted(self, reason: str) -> None: ...
    def batch_retried(self) -> None: ...
    def batch_failed(self, reason: str) -> None: ...
    def batch_split(self, reason: str) -> None: ...


class NoObserver:
    def forwarded(self, seconds: float) -> None:
        pass

    def restarted(self, reason: str) -> None:
        pass

    def batch_retried(self) -> None:
        pass

    def batch_failed(self, reason: str) -> None:
        pass

    def batch_split(self, reason: str) -> None:
        pass
