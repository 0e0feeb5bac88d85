"""Settings shared by the model tests."""

from __future__ import annotations

import pytest
import torch

from model.engines import kernels as kernel_layer
from model.engines.kernels import onednn_available
from model.relevance import RelevanceModel


@pytest.fixture(scope="package", autouse=True)
def one_torch_thread():
    """One torch thread: the model tests run small batches, and on a 2-core machine shared with other
    work a second OpenMP thread mostly waits for the first (measured: about 3x slower with two)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tiny_checkpoint) -> RelevanceModel:
    """As the service loads it: linear layers pre-packed for oneDNN where the CPU allows."""
    return RelevanceModel.load(tiny_checkpoint)


@pytest.fixture(scope="module")
def unpacked(tiny_checkpoint) -> RelevanceModel:
    """Plain layers, padded batches: the reference path."""
    return RelevanceModel.load(tiny_checkpoint, onednn=False, unpadded=False)


@pytest.fixture(scope="module", params=["onednn-packed", "fused"])
def kernels(request, tiny_checkpoint) -> RelevanceModel:
    """The tiny model with each kernel kind, whichever this CPU would choose."""
    if not onednn_available(torch.float32):
        pytest.skip("torch built without oneDNN")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernel_layer, "onednn_pays", lambda dtype: request.param == "onednn-packed")
        m = RelevanceModel.load(tiny_checkpoint)
    assert m.cpu_kernels == request.param
    return m
