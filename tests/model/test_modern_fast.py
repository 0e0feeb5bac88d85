"""ModernBERT's fast path (model.engines.modern_packed): the C rotary kernel against the reference's rotation,
at head sizes its vector and scalar code take, in float32 and bfloat16; the fused attention (windows as key
ranges per query row) against the per-group torch path on a checkpoint whose pairs outrun the local window;
the torch rotation that serves where the kernel is missing; the operator's switch to torch's kernels."""

from __future__ import annotations

import pytest
import torch

from model.engines import fused
from model.engines.onednn import geglu_probe
from model.modernbert import rotary, rotate
from model.relevance import RelevanceModel
from tests.model.arch_fixtures import INIT, center_head, random_pairs, tiny_wordpiece

pytest.importorskip("transformers")
needs_kernel = pytest.mark.skipif(not fused.rotary_available(), reason="the C kernels are not built")


@needs_kernel
@pytest.mark.parametrize("hs", [64, 12])  # 64: 8-lane vectors; 12: the scalar tail (half = 6)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_kernel_turns_rows_as_the_reference(hs, dtype):
    nh, n = 3, 50
    torch.manual_seed(hs)
    positions = torch.randint(0, 40, (n,))
    x = torch.randn(n, 3 * nh * hs).to(dtype)  # q, k, v columns: only q and k turn
    cos, sin = rotary(torch.arange(64), hs, 160000.0, dtype)
    table = torch.cat((cos, sin), dim=-1).float().contiguous()
    got = fused.rotary_rows(x.clone(), positions, table, 2 * nh, hs)
    heads = x[:, : 2 * nh * hs].view(n, 2 * nh, hs).transpose(0, 1)[:, :, None]  # (2nh, n, 1, hs)
    want = rotate(heads, cos[positions][:, None], sin[positions][:, None]).squeeze(2).transpose(0, 1).reshape(n, -1)
    atol = 1e-6 if dtype == torch.float32 else 1e-2  # bfloat16: at most one rounding apart
    torch.testing.assert_close(got[:, : 2 * nh * hs].float(), want.float(), atol=atol, rtol=atol)
    assert torch.equal(got[:, 2 * nh * hs :], x[:, 2 * nh * hs :])
    with pytest.raises(ValueError, match="outside the table"):
        fused.rotary_rows(x.clone(), positions + 64, table, 2 * nh, hs)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    """A ModernBERT of head size 32 (the kernel's vector code) and a local window of 8 that most pairs outrun."""
    import transformers as tf

    path = tmp_path_factory.mktemp("modern") / "m"
    cfg = tf.ModernBertConfig(
        vocab_size=300, hidden_size=64, num_hidden_layers=4, num_attention_heads=2, intermediate_size=48,
        local_attention=8, max_position_embeddings=256, pad_token_id=0, cls_token_id=2, sep_token_id=3,
    )  # fmt: skip
    cfg.num_labels, cfg.initializer_range = 3, INIT
    torch.manual_seed(7)
    model = tf.ModernBertForSequenceClassification._from_config(cfg, attn_implementation="eager").eval()
    center_head(model, cfg.pad_token_id)
    model.save_pretrained(path)
    tiny_wordpiece().save(str(path / "tokenizer.json"))
    return path


@needs_kernel
def test_fused_path_matches_the_grouped_one(wide):
    ids, segs = random_pairs(40, seed=3)
    model = RelevanceModel.load(wide, dtype="float32")
    eng = model.engine.torch
    assert eng.kernels.attention == "fused" and "rotary in place (C)" in eng.kernels.attention_reason
    fast = model.logits(ids, segs, raw=True)
    eng.packed.rope_kernel = False  # torch's rotation, as where the library lacks the kernel
    torch.testing.assert_close(model.logits(ids, segs, raw=True), fast, atol=1e-5, rtol=0)
    if eng.packed.geglu is not None:  # GeGLU in oneDNN's kernels (where its probe passed) against torch's ops
        assert geglu_probe(torch.float32) is None and "GeGLU in oneDNN's kernels" in eng.kernels.attention_reason
        eng.packed.geglu = None
        torch.testing.assert_close(model.logits(ids, segs, raw=True), fast, atol=1e-5, rtol=0)
    eng.use_attention("sdpa")
    torch.testing.assert_close(model.logits(ids, segs, raw=True), fast, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="fused, math or sdpa"):
        eng.use_attention("flash")


def test_attention_torch_keeps_the_grouped_path(wide):
    model = RelevanceModel.load(wide, dtype="float32", attention="torch")
    assert model.engine.torch.kernels.attention in ("math", "sdpa")
