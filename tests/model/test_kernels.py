"""The CPU kernel layer (model.engines.kernels): pre-packed oneDNN linear layers where they pay, fused plain ones
where they do not (float32 without AVX-512), the probe of the private ops oneDNN's rest on, and the plain
fallback when the probe fails. Both kernel kinds are tested on every CPU (`kernels`, tests/model/conftest.py,
forces each)."""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from model.engines import fused, packed
from model.engines import kernels as kernel_layer
from model.engines.kernels import OneDNNLinear, onednn_available, onednn_pays, probe, warm_linear_shapes
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
    return onednn_available(dtype) and onednn_pays(dtype) and probe(dtype) is None


def expected_kernels(dtype: torch.dtype) -> str:
    if not onednn_available(dtype):
        return "plain"
    return "onednn-packed" if onednn_pays(dtype) else "fused"


# --- pre-packed (oneDNN) and fused linear layers -------------------------------------------------------
def test_load_chooses_the_kernels_this_cpu_runs_fastest(model, unpacked):
    """oneDNN's packed layers where they pay (bfloat16, or float32 with AVX-512); with AVX2 only, float32 runs
    on MKL's sgemm, 12-18% faster than oneDNN's there (docs/benchmarks.md), through fused plain layers."""
    assert model.cpu_kernels == expected_kernels(torch.float32)
    assert model.onednn == packs(torch.float32)
    assert not unpacked.onednn and unpacked.cpu_kernels == "plain"
    assert onednn_pays(torch.bfloat16)
    assert onednn_pays(torch.float32) == ("avx512f" in Path("/proc/cpuinfo").read_text())


def test_both_kernel_kinds_fuse_the_projections(kernels):
    *body, last = kernels.module.bert.layers
    for layer in body:
        assert layer.attn.qkv is not None and not hasattr(layer.attn, "query")
    # the last layer keeps q, k and v apart (the packed forward computes q at [CLS] only), each weight once
    a = last.attn
    assert a.qkv is None and a.cls_q is not None and a.cls_k is not None and a.cls_v is not None
    kind = OneDNNLinear if kernels.onednn else torch.nn.Linear
    assert isinstance(a.cls_q, kind) and isinstance(body[0].attn.qkv, kind)


def test_a_kernel_model_keeps_no_second_copy_of_a_linear_weight(kernels, unpacked):
    """Every encoder linear weight lives once, in its packed or fused form: the model holds no more tensor
    bytes than the plain one (model processes share it: issue 20)."""

    def held(m) -> int:
        tensors = {id(t): t for t in [*m.module.parameters(), *m.module.buffers()]}
        for x in m.module.modules():
            if isinstance(x, OneDNNLinear):
                tensors.update({id(x.weight): x.weight, id(x.bias): x.bias})
        return sum(t.numel() * t.element_size() for t in tensors.values())

    if kernels.onednn:
        assert not any(isinstance(x, torch.nn.Linear) for layer in kernels.module.bert.layers for x in layer.modules())
    assert held(kernels) <= held(unpacked)


def test_kernels_and_plain_layers_agree(kernels, unpacked, batch, encoded):
    mask = torch.ones(2, 4)
    mask[0, 2] = mask[1, 0] = 0
    for head_mask in (None, mask):
        for plain in (False, True):
            want, want_probs = run(unpacked, *batch, head_mask, plain=plain)
            got, probs = run(kernels, *batch, head_mask, plain=plain)
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
            if plain:
                for p, q in zip(probs, want_probs, strict=True):
                    torch.testing.assert_close(p, q, atol=ATOL, rtol=0)
        # the packed forward (the last layer at [CLS] only) and the padded one with cls_only
        want = unpacked.logits(encoded.input_ids, encoded.token_type_ids, head_mask)
        got = kernels.logits(encoded.input_ids, encoded.token_type_ids, head_mask)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        with torch.inference_mode():
            cls_only, _ = kernels.module(*batch, head_mask, cls_only=True)
        torch.testing.assert_close(cls_only, run(unpacked, *batch, head_mask)[0], atol=ATOL, rtol=0)


def test_kernel_models_are_not_saved(kernels, unpacked, tmp_path):
    with pytest.raises(ValueError, match="load with onednn=False"):
        kernels.save(tmp_path / "packed")
    unpacked.save(tmp_path / "unpacked")
    assert (tmp_path / "unpacked" / "model.safetensors").is_file()


def test_warm_linear_shapes_covers_each_distinct_layer_once_per_bucket(kernels):
    # qkv, out, up and down, the same in every layer of the tiny model (hidden 32, feed-forward 64): the last
    # layer's q, k and v have out's shape, so they add no kernels (each ~0.7 MB a bucket on Sapphire Rapids)
    assert warm_linear_shapes(kernels.module, 512) == 4 * len(token_buckets(512))


# --- the probe ----------------------------------------------------------------------------------------
@pytest.mark.skipif(not onednn_available(torch.float32), reason="torch built without oneDNN")
def test_probe_passes_in_float32_on_this_torch(model):
    assert probe(torch.float32) is None
    assert model.describe()["cpu_kernels"] == expected_kernels(torch.float32)


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
    monkeypatch.setattr(kernel_layer, "onednn_pays", lambda dtype: True)  # where oneDNN would serve
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
    fallback.use_attention(unpacked.attention)  # the attention kernel does not depend on the linears' probe
    assert fallback.fused_norm == fused.available()[0]  # nor do the fused norms; the reference runs torch's
    for layer in fallback.module.bert.blocks:
        layer.fused_norm = False
    got = fallback.logits(encoded.input_ids, encoded.token_type_ids)
    with torch.inference_mode():  # the plain layers, without padding: the same computation exactly
        same = packed.packed(unpacked.module).forward_packed(encoded.input_ids, encoded.token_type_ids)
    assert torch.equal(got, same.float())
    want = unpacked.logits(encoded.input_ids, encoded.token_type_ids)  # padded, plain
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    scored, plain = fallback.score(got), unpacked.score(want)
    assert torch.equal(scored.level, plain.level)
    torch.testing.assert_close(scored.expected, plain.expected, atol=ATOL, rtol=0)


# --- the packed forward's attention kernel ------------------------------------------------------------
def test_math_attention_pays_only_for_native_bfloat16_without_amx(monkeypatch):
    """Plain matmuls instead of torch's flash kernel where an A/B measured them faster: bfloat16 on
    AVX512-BF16 without AMX (Zen 4); flash with AMX, in float32 and where bfloat16 is emulated."""
    for flags, native, want in (
        ({"avx2", "avx512f", "avx512_bf16"}, True, True),
        ({"avx2", "avx512f", "avx512_bf16", "amx_bf16"}, True, False),
        ({"avx2"}, False, False),
    ):
        monkeypatch.setattr(kernel_layer, "cpu_flags", lambda f=flags: frozenset(f))
        monkeypatch.setattr(kernel_layer, "cpu_runs_bf16_natively", lambda n=native: n)
        assert kernel_layer.math_attention_pays(torch.bfloat16) is want
        assert kernel_layer.math_attention_pays(torch.float32) is False


@pytest.mark.parametrize("dtype, atol", [("float32", ATOL), ("bfloat16", 0.08)])
def test_math_attention_and_flash_agree(tiny_checkpoint, unpacked, encoded, dtype, atol):
    """The model describes the kernel this CPU chose (the per-group one by `math_attention_pays`, or the fused
    one where its probe won: tests/model/test_fused_attention.py); both per-group kernels, forced in turn, give
    the reference's logits (bfloat16: to its rounding), with and without a head mask."""
    m = RelevanceModel.load(tiny_checkpoint, dtype=dtype)
    grouped = "math" if kernel_layer.math_attention_pays(getattr(torch, dtype)) else "sdpa"
    assert m.describe()["attention"] in (grouped, "fused")
    mask = torch.ones(2, 4)
    mask[1, 0] = 0
    for head_mask in (None, mask):
        want = unpacked.logits(encoded.input_ids, encoded.token_type_ids, head_mask)
        for kind in ("math", "sdpa"):
            m.use_attention(kind)
            assert m.describe()["attention"] == kind
            got = m.logits(encoded.input_ids, encoded.token_type_ids, head_mask)
            torch.testing.assert_close(got, want, atol=atol, rtol=0)
    with pytest.raises(ValueError, match="one of .*'sdpa', 'math', 'fused'"):
        m.use_attention("flash")


def test_math_attention_only_on_blocks_shorter_than_64_keys(tiny_checkpoint, unpacked, monkeypatch):
    """Per group, the plain matmuls serve blocks of fewer than 64 keys (MATH_MAX_TOKENS); a group of longer
    pairs goes to torch's flash kernel, measured 1.2-2.2x faster there. The logits stay the reference's."""
    m = RelevanceModel.load(tiny_checkpoint, dtype="float32")
    m.use_attention("math")
    keys: list[int] = []
    real = packed.math_attention
    monkeypatch.setattr(packed, "math_attention", lambda q, k, v, b: keys.append(k.shape[-2]) or real(q, k, v, b))
    vocab = m.module.bert.embeddings.word.num_embeddings
    gen = torch.Generator().manual_seed(0)

    def pair(n: int) -> tuple[list[int], list[int]]:
        return torch.randint(5, vocab, (n,), generator=gen).tolist(), [0] * 4 + [1] * (n - 4)

    short, long = [pair(n) for n in (20, 24, 30)], [pair(n) for n in (90, 100)]
    for pairs, want in ((short, True), (long, False), (long + short, True)):
        keys.clear()
        ids, seg = [p[0] for p in pairs], [p[1] for p in pairs]
        got = m.logits(ids, seg)
        assert bool(keys) is want and all(k <= packed.MATH_MAX_TOKENS for k in keys)
        torch.testing.assert_close(got, unpacked.logits(ids, seg), atol=ATOL, rtol=0)
