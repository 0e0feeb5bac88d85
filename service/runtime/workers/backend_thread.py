"""The thread backend: the model lives in the server process and runs on its replica's thread.

For debugging; a forward then shares the GIL with the event loop (docs/design.md). The model cannot die apart
from the server, nor be killed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from model.relevance import RelevanceModel
from service.runtime.workers import runner
from service.runtime.workers.backend import (
    Answer,
    Backend,
    Encoded,
    Forward,
    Forwarded,
    Health,
    Job,
    LoadFailed,
    LoadSpec,
    raise_for,
)


class ThreadBackend(Backend):
    """`answer`: the model side of a message, if not runner.handle."""

    def __init__(self, spec: LoadSpec, name: str = "qtrel-model", answer: Answer | None = None):
        self.spec = spec
        self.name = name
        self.answer: Answer = answer or runner.handle
        self._model: RelevanceModel | None = None

    def load(self) -> dict:
        try:
            self._model = model = runner.load_model(self.spec)
            runner.start_inference(model, self.spec)
        except Exception as e:
            raise LoadFailed(f"{type(e).__name__}: {e}") from e
        return model.describe()

    def warm_up(self) -> None:
        try:
            runner.warm_up(self._loaded(), self.spec)
        except Exception as e:
            raise LoadFailed(f"{type(e).__name__}: {e}") from e

    def forward(self, batch: Sequence[Encoded]) -> Forwarded:
        return raise_for(self.answer(self._loaded(), self.spec, Forward(batch)))

    def job(self, name: str, args: tuple = (), kwargs: dict | None = None) -> Any:
        return raise_for(self.answer(self._loaded(), self.spec, Job(name, args, kwargs or {})))

    def health(self) -> Health:
        return Health(self._model is not None, "" if self._model is not None else "not loaded")

    def close(self) -> None:
        self._model = None

    def _loaded(self) -> RelevanceModel:
        if self._model is None:
            raise LoadFailed("the model is not loaded")
        return self._model
