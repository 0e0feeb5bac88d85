"""The served models' registry without a server: names, the default, lookups, and the choice between a
reload beside the serving copy and one in place (nothing is started here)."""

from __future__ import annotations

import pytest

from service.metrics import Metrics
from service.runtime import models as models_module
from service.runtime.layout import memory_available
from service.runtime.models import ModelNotFound, Models
from service.runtime.workers.worker import Worker
from service.settings import Settings


def registry(ckpt, **overrides) -> Models:
    one = {} if overrides.get("models") else {"model": str(ckpt)}  # several models replace the one
    s = Settings(device="cpu", dtype="float32", worker="thread", warmup=False, **(one | overrides))
    return Models(s, Metrics())


def test_names_default_and_lookup(tiny_checkpoint):
    one = registry(tiny_checkpoint)
    assert one.names == ["tiny-bert"] and one.get("anything") is one.default  # one model: any name
    two = registry(tiny_checkpoint, models=f"a={tiny_checkpoint},b={tiny_checkpoint}")
    assert two.names == ["a", "b"] and two.get(None) is two.default and two.get("b").name == "b"
    with pytest.raises(ModelNotFound, match="served: a, b"):
        two.get("c")
    with pytest.raises(ModelNotFound):
        one.exact("anything")  # the admin route takes exact names only


@pytest.mark.parametrize(
    ("free", "mode", "beside"),
    [(3e9, "auto", True), (1.5e9, "auto", False), (1.5e9, "beside", True), (9e9, "in_place", False)],
)
def test_a_second_copy_goes_beside_only_when_it_fits(tiny_checkpoint, monkeypatch, free, mode, beside):
    m = registry(tiny_checkpoint, reload=mode)
    monkeypatch.setattr(Worker, "pids", property(lambda self: [1]))
    monkeypatch.setattr(models_module, "_rss", lambda pid: 10**9)  # the serving copy: 1 GB resident
    monkeypatch.setattr(models_module, "memory_available", lambda: free)
    assert m.fits_beside(m.default) is beside  # twice the resident size must fit (warm-up peaks)


def test_memory_available_reads_this_machine():
    free = memory_available()
    assert free is None or free > 0
