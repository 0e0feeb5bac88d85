"""The encoder on the tiny checkpoint: both attention paths, padding, head masks, precision modes."""

from __future__ import annotations

import warnings

import pytest
import torch

from model.engines.kernels import onednn_available, probe
from model.relevance import RelevanceModel, pad_batch
from tests.conftest import make_tiny_checkpoint, read_pairs

ATOL = 1e-5


@pytest.fixture(scope="module")
def batch(model):
    """16 real English and 8 Chinese pairs, padded: lengths differ, so padding is exercised."""
    enc = model.encode(read_pairs(16) + read_pairs(8, "qbqtc"))
    assert len(set(enc.lengths)) > 5
    return pad_batch(enc.input_ids, enc.token_type_ids)


def run(model, ids, seg, mask, head_mask=None, plain=False):
    with torch.inference_mode():
        return model.module(ids, seg, mask, head_mask, output_attentions=plain)


def test_fast_and_plain_paths_agree(model, batch):
    fast, no_probs = run(model, *batch)
    plain, probs = run(model, *batch, plain=True)
    assert no_probs is None
    torch.testing.assert_close(plain, fast, atol=ATOL, rtol=0)
    assert fast.shape == (24, 5)
    assert (fast[0] - fast[1]).abs().max() > 1e-3  # different pairs, different logits


def test_attention_probabilities(model, batch):
    _, mask = batch[0], batch[2]
    _, probs = run(model, *batch, plain=True)
    assert len(probs) == 2
    for p in probs:
        assert p.shape == (24, 4, mask.shape[1], mask.shape[1])  # (B, nh, T, T)
        torch.testing.assert_close(p.sum(-1), torch.ones(p.shape[:-1]), atol=1e-5, rtol=0)
        assert (p * (1 - mask[:, None, None, :])).abs().max() == 0  # padded keys get nothing


def test_padding_does_not_change_a_pairs_logits(model):
    short = ("drill", "cordless drill kit")
    long_ = ("lawn mower", " ".join(["self propelled gas walk behind mower with bagger"] * 12))
    enc = model.encode([short, long_])
    assert enc.lengths[1] > 5 * enc.lengths[0]
    alone = pad_batch(enc.input_ids[:1], enc.token_type_ids[:1])
    together = pad_batch(enc.input_ids, enc.token_type_ids)
    for plain in (False, True):
        a, _ = run(model, *alone, plain=plain)
        b, _ = run(model, *together, plain=plain)
        torch.testing.assert_close(b[0], a[0], atol=ATOL, rtol=0)


def test_all_ones_head_mask_equals_no_mask(model, batch):
    ones = torch.ones(2, 4)
    for plain in (False, True):
        want, _ = run(model, *batch, plain=plain)
        got, _ = run(model, *batch, ones, plain=plain)
        torch.testing.assert_close(got, want, atol=0, rtol=0)


@pytest.mark.parametrize("layer,head", [(0, 0), (0, 3), (1, 2)])
def test_masking_a_head_changes_outputs(model, batch, layer, head):
    mask = torch.ones(2, 4)
    mask[layer, head] = 0
    want, _ = run(model, *batch)
    fast, _ = run(model, *batch, mask)
    plain, probs = run(model, *batch, mask, plain=True)
    assert (fast - want).abs().max() > 1e-3
    torch.testing.assert_close(plain, fast, atol=ATOL, rtol=0)  # both paths mask alike
    _, unmasked_probs = run(model, *batch, plain=True)
    # The mask silences the head's output, not its attention pattern (nor that of layers below it).
    torch.testing.assert_close(probs[0], unmasked_probs[0], atol=ATOL, rtol=0)


def test_masking_a_head_equals_zeroing_its_values(tiny_checkpoint, model, batch):
    """A masked head emits zero: the same as a model whose value projection for that head is zero."""
    zeroed = RelevanceModel.load(tiny_checkpoint, onednn=False, unpadded=False)
    value = zeroed.module.bert.layers[1].attn.value
    with torch.no_grad():
        value.weight[8:16] = 0  # head 1 of 4, head size 8
        value.bias[8:16] = 0
    mask = torch.ones(2, 4)
    mask[1, 1] = 0
    want, _ = run(zeroed, *batch)
    for plain in (False, True):
        got, _ = run(model, *batch, mask, plain=plain)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("shape", [(2, 3), (3, 4), (4,), (2, 4, 1)])
def test_head_mask_of_the_wrong_shape_raises(model, batch, shape):
    with pytest.raises(ValueError, match=r"head_mask must have shape \(2, 4\)"):
        run(model, *batch, torch.ones(shape))


def test_pruned_heads_keep_original_indices(tmp_path, batch):
    """Head masks name heads by their original index, also in a layer with pruned heads."""
    path = make_tiny_checkpoint(tmp_path / "pruned", pruned_heads={0: [1]})
    unpacked = RelevanceModel.load(path, onednn=False, unpadded=False)
    assert unpacked.module.bert.layers[0].attn.heads == [0, 2, 3]
    assert unpacked.module.bert.layers[0].attn.query.out_features == 24
    gone = torch.ones(2, 4)
    gone[0, 1] = 0  # a pruned head: masking it changes nothing
    kept = torch.ones(2, 4)
    kept[0, 2] = 0
    reference, _ = run(unpacked, *batch)
    for model in (unpacked, RelevanceModel.load(path)):
        for plain in (False, True):
            want, _ = run(model, *batch, plain=plain)
            torch.testing.assert_close(want, reference, atol=ATOL, rtol=0)
            got, _ = run(model, *batch, gone, plain=plain)
            torch.testing.assert_close(got, want, atol=0, rtol=0)
            got, _ = run(model, *batch, kept, plain=plain)
            assert (got - want).abs().max() > 1e-3


def test_eval_is_deterministic_and_train_mode_drops_out(unpacked, batch):
    a, _ = run(unpacked, *batch)
    b, _ = run(unpacked, *batch)
    assert torch.equal(a, b)
    unpacked.module.train()
    try:
        torch.manual_seed(0)
        c, _ = run(unpacked, *batch)
    finally:
        unpacked.module.eval()
    assert (c - a).abs().max() > 1e-3


# --- precision modes ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def encoded(model):
    return model.encode(read_pairs(48) + read_pairs(16, "qbqtc"))


@pytest.mark.parametrize("dtype,atol", [("bfloat16", 0.03), ("int8", 0.1)])
def test_reduced_precision_on_cpu_is_close_to_float32(tiny_checkpoint, model, encoded, dtype, atol):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.ao.quantization announces its move
        warnings.simplefilter("ignore", UserWarning)
        low = RelevanceModel.load(tiny_checkpoint, dtype=dtype)
        want = model.probs(encoded.input_ids, encoded.token_type_ids)
        got = low.probs(encoded.input_ids, encoded.token_type_ids)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got.sum(-1), torch.ones(len(encoded)), atol=1e-5, rtol=0)
    torch.testing.assert_close(got, want, atol=atol, rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.85
    if dtype == "bfloat16":
        assert low.module.classifier.weight.dtype == torch.bfloat16
        assert low.onednn == (onednn_available(torch.bfloat16) and probe(torch.bfloat16) is None)
    else:  # every Linear became a dynamically quantised one
        linears = [type(m) for m in low.module.modules() if type(m).__name__ == "Linear"]
        assert len(linears) == 2 * 6 + 2  # per layer q, k, v, out, up, down; pooler; classifier
        assert all(".quantized.dynamic." in t.__module__ for t in linears), linears
        assert (got - want).abs().max() > 0  # really ran in reduced precision
        assert not low.onednn


def test_float16_on_cpu_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="float16 runs on cuda only"):
        RelevanceModel.load(tiny_checkpoint, dtype="float16")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_cuda_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="CUDA is not available"):
        RelevanceModel.load(tiny_checkpoint, device="cuda")


@pytest.mark.parametrize("dtype", ["float64", "fp16", ""])
def test_unknown_dtype_is_refused(tiny_checkpoint, dtype):
    with pytest.raises(ValueError, match="dtype must be one of"):
        RelevanceModel.load(tiny_checkpoint, dtype=dtype)


def test_unknown_device_is_refused(tiny_checkpoint):
    with pytest.raises(ValueError, match="unsupported device 'meta'"):
        RelevanceModel.load(tiny_checkpoint, device="meta")
