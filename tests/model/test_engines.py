"""The engines: chosen once at load, and the packed form changes nothing of the reference it adopts."""

from __future__ import annotations

import torch

from model.checkpoint import load_module
from model.engines.base import EngineKind
from model.engines.packed import PackedBertForRelevance, packed
from model.relevance import RelevanceModel, pad_batch
from tests.conftest import read_pairs


def test_the_packed_form_adopts_the_reference_weights_and_keeps_its_forward(tiny_checkpoint):
    ref = load_module(tiny_checkpoint).eval()
    fast = packed(ref)
    assert isinstance(fast, PackedBertForRelevance) and packed(fast) is fast
    want = {n: p.data_ptr() for n, p in ref.state_dict().items()}
    assert {n: p.data_ptr() for n, p in fast.state_dict().items()} == want  # the same tensors, no copy
    tok = RelevanceModel.load(tiny_checkpoint, onednn=False, unpadded=False).tokenizer
    enc = tok.encode([q for q, _ in read_pairs(12)], [t for _, t in read_pairs(12)])
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids, tok.pad_id)
    head_mask = torch.ones(2, 4)
    head_mask[1, 2] = 0
    with torch.inference_mode():
        for hm in (None, head_mask):
            a, att_a = ref(ids, seg, mask, hm, output_attentions=True)
            b, att_b = fast(ids, seg, mask, hm, output_attentions=True)
            assert torch.equal(a, b) and att_a is not None and att_b is not None
            assert all(torch.equal(x, y) for x, y in zip(att_a, att_b))
            assert torch.equal(ref(ids, seg, mask, hm, cls_only=True)[0], fast(ids, seg, mask, hm, cls_only=True)[0])


def test_the_load_flags_choose_the_engine_once(tiny_checkpoint):
    packed_model = RelevanceModel.load(tiny_checkpoint)
    assert packed_model.engine.kind == EngineKind.PACKED and packed_model.engine.torch is packed_model.engine
    assert isinstance(packed_model.module, PackedBertForRelevance)
    plain = RelevanceModel.load(tiny_checkpoint, onednn=False, unpadded=False)
    assert plain.engine.kind == EngineKind.PADDED and not isinstance(plain.module, PackedBertForRelevance)
    padded_kernels = RelevanceModel.load(tiny_checkpoint, unpadded=False)
    assert padded_kernels.engine.kind == EngineKind.PADDED and isinstance(padded_kernels.module, PackedBertForRelevance)
    enc = plain.encode(read_pairs(12))
    want = plain.logits(enc.input_ids, enc.token_type_ids)
    for m in (packed_model, padded_kernels):
        torch.testing.assert_close(m.logits(enc.input_ids, enc.token_type_ids), want, atol=1e-5, rtol=0)
    packed_model.use_inference("torch")  # the torch engine stays the one chosen at load
    assert packed_model.engine.kind == EngineKind.PACKED and packed_model.inference == "torch"
