"""The CPU kernel layer (model.kernels): pre-packed oneDNN linear layers, the probe of the private ops
they rest on, and the plain fallback when the probe fails."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from model.kernels import OneDNNLinear, onednn_available, probe, warm_linear_shapes
from model.packing import token_buckets
from model.relevance import RelevanceModel, pad_batch
from tests.conftest import read_pairs

ATOL = 1e-5


@pytest.fixture(scope="module")
def encoded(model):
    """16 English and 8 Chinese pairs of differing lengths."""
    return model.encode(read_pairs(16) + read_pairs(8, "qbqtc"))


@pytest.fixture(scope="module")
def batch(encoded):
    return pad_batch(encoded.input_ids, encoded.token_type_ids)


def run(model, ids, seg, mask, head_mask=None, plain=False):
    with torch.inference_mode():
        return model.module(ids, seg, mask, head_mask, output_attentions=plain)


def packs(dtype: torch.dtype) -> bool:
    return onednn_available(dtype) and probe(dtype) is None


# --- pre-packed (oneDNN) linear layers ---------------------------------------------------------------
def test_load_packs_where_the_cpu_allows(model, unpacked):
    assert model.onednn == packs(torch.float32)
    assert not unpacked.onednn
    if model.onednn:
        attn = model.module.bert.layers[0].attn
        assert attn.qkv is not None and not hasattr(attn, "query")


def test_a_packed_model_keeps_no_second_copy_of_a_linear_weight(model, unpacked):
    """Every encoder linear weight lives once, in its packed form: no nn.Linear is left inside a layer and
    the model holds no more tensor bytes than the plain one (model processes share it: issue 20)."""
    if not model.onednn:
        pytest.skip("no oneDNN packing on this CPU")

    def held(m) -> int:
        tensors = {id(t): t for t in [*m.module.parameters(), *m.module.buffers()]}
        for x in m.module.modules():
            if isinstance(x, OneDNNLinear):
                tensors.update({id(x.weight): x.weight, id(x.bias): x.bias})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    assert not any(isinstance(x, torch.nn.Linear) for layer in model.module.bert.layers for x in layer.modules())
    assert held(model) <= held(unpacked)


def test_packed_and_unpacked_agree(model, unpacked, batch):
    mask = torch.ones(2, 4)
    mask[0, 2] = mask[1, 0] = 0
    for head_mask in (None, mask):
        for plain in (False, True):
            want, want_probs = run(unpacked, *batch, head_mask, plain=plain)
            got, probs = run(model, *batch, head_mask, plain=plain)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            if plain:
                for p, q in zip(probs, want_probs, strict=True):
                    torch.testing.assert_close(p, q, atol=ATOL, rtol=0)


def test_packed_model_is_not_saved(model, unpacked, tmp_path):
    if model.onednn:
        with pytest.raises(ValueError, match="load with onednn=False"):
            model.save(tmp_path / "packed")
    unpacked.save(tmp_path / "unpacked")
    assert (tmp_path / "unpacked" / "model.safetensors").is_file()


def test_warm_linear_shapes_covers_each_distinct_layer_once_per_bucket(model):
    # qkv, out, up, down: every layer of the tiny model has the same four shapes
    assert warm_linear_shapes(model.module, 512) == 4 * len(token_buckets(512))


# --- the probe ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not onednn_available(torch.float32), reason="torch built without oneDNN")
def test_probe_passes_in_float32_on_this_torch(model):
    assert probe(torch.float32) is None
    assert model.describe()["cpu_kernels"] == "onednn-packed"


@pytest.mark.skipif(not onednn_available(torch.bfloat16), reason="torch built without oneDNN")
def test_bfloat16_packs_exactly_where_the_probe_passes(tiny_checkpoint):
    """oneDNN refuses bfloat16 weights on CPUs without AVX512 (or AVX-NE-CONVERT): there the probe says
    why and the model keeps the plain layers; elsewhere it packs."""
    failure = probe(torch.bfloat16)
    assert failure is None or failure.startswith("RuntimeError: ")
    low = RelevanceModel.load(tiny_checkpoint, dtype="bfloat16")
    assert low.onednn == (failure is None)
    want = "onednn-packed" if failure is None else f"plain (probe failed: {failure})"
    assert low.describe()["cpu_kernels"] == want


def test_describe_says_plain_where_packing_does_not_apply(unpacked):
    assert unpacked.describe()["cpu_kernels"] == "plain"


def _raise(*args, **kwargs):
    raise RuntimeError("oneDNN says no\nsecond line")


def broken_ops(how: str, monkeypatch) -> str:
    """Break the private ops as a torch release might; returns the start of the reason the probe gives."""
    mkldnn = torch.ops.mkldnn
    if how == "missing":  # a release without the ops
        monkeypatch.setattr(torch.ops, "mkldnn", SimpleNamespace())
        return "AttributeError: "
    if how == "raising":
        monkeypatch.setattr(mkldnn, "_reorder_linear_weight", _raise)
        return "RuntimeError: oneDNN says no"
    real = mkldnn._linear_pointwise
    if how == "wrong numbers":
        monkeypatch.setattr(mkldnn, "_linear_pointwise", lambda *a: real(*a) + 0.01)
        return "float32 16->24 none/- on (8, 16): differs from nn.Linear by up to 0.01"
    assert how == "wrong shape"
    monkeypatch.setattr(mkldnn, "_linear_pointwise", lambda *a: real(*a)[..., :-1])
    return "float32 16->24 none/- on (8, 16): got (8, 23)"


@pytest.mark.skipif(not onednn_available(torch.float32), reason="torch built without oneDNN")
@pytest.mark.parametrize("how", ["missing", "raising", "wrong numbers", "wrong shape"])
def test_broken_private_ops_fall_back_to_the_plain_layers(tiny_checkpoint, unpacked, encoded, how, monkeypatch, caplog):
    reason = broken_ops(how, monkeypatch)
    assert probe(torch.float32).startswith(reason)
    with caplog.at_level(logging.WARNING, logger="qtrel.model"):
        fallback = RelevanceModel.load(tiny_checkpoint)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].name == "qtrel.model"
    assert reason in warnings[0].getMessage()
    assert "\n" not in warnings[0].getMessage()

    assert not fallback.onednn and fallback.unpadded
    assert not any(isinstance(m, OneDNNLinear) for m in fallback.module.modules())
    assert fallback.module.bert.layers[0].attn.qkv is None
    kernels = fallback.describe()["cpu_kernels"]
    assert kernels.startswith(f"plain (probe failed: {reason}") and kernels.endswith(")")

    fallback.warm_up(64)  # warms the plain layers without touching the broken ops
    got = fallback.logits(encoded.input_ids, encoded.token_type_ids)
    with torch.inference_mode():  # the plain layers, without padding: the same computation exactly
        same = unpacked.module.forward_packed(encoded.input_ids, encoded.token_type_ids)
    assert torch.equal(got, same.float())
    want = unpacked.logits(encoded.input_ids, encoded.token_type_ids)  # padded, plain
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    scored, plain = fallback.score(got), unpacked.score(want)
    assert torch.equal(scored.level, plain.level)
    torch.testing.assert_close(scored.expected, plain.expected, atol=ATOL, rtol=0)
