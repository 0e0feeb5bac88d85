"""Batches without padding (model.packing): the layout, and the unpadded forward against the padded one."""

from __future__ import annotations

import pytest
import torch

from model.packing import pack, token_bucket, token_buckets, token_slices
from model.relevance import RelevanceModel, pad_batch
from tests.conftest import make_tiny_checkpoint, read_pairs

ATOL = 1e-5


def test_token_buckets_are_few_tight_and_cover_every_count():
    ladder = token_buckets(8192)
    assert len(ladder) <= 80 and ladder[-1] == 8192 and ladder == sorted(set(ladder))
    for n in range(1, 8193):
        b = token_bucket(n)
        assert n <= b <= n * 1.125 + 15 and b in ladder
        if n <= 64:  # small batches: a one-pair forward's rows, the last layer's [CLS] rows
            assert b < 2 * n and b - n < 8
    assert token_bucket(0) == 0


def test_pad_batch_right_pads_every_pair_to_the_longest():
    ids = [[101, 5, 6, 102], [101, 7, 102], [101, 8, 9, 10, 11, 102], [101, 102]]
    seg = [[0, 0, 1, 1], [0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 1]]
    got_ids, got_seg, got_mask = pad_batch(ids, seg, pad_id=7)
    for g in (got_ids, got_seg, got_mask):
        assert g.shape == (4, 6) and g.dtype == torch.long
    for i, (x, s) in enumerate(zip(ids, seg)):
        n = len(x)
        assert got_ids[i].tolist() == x + [7] * (6 - n)
        assert got_seg[i].tolist() == s + [0] * (6 - n)
        assert got_mask[i].tolist() == [1] * n + [0] * (6 - n)
    assert [t.shape for t in pad_batch([], [])] == [(0, 0)] * 3
    with pytest.raises(ValueError, match="as many segment ids"):  # same totals, misaligned pairs
        pad_batch([[101, 5, 102], [101]], [[0, 0], [0, 1]])


def test_pack_lays_pairs_out_without_padding():
    ids = [[101, 5, 6, 102], [101, 7, 102], [101, 8, 9, 10, 11, 102], [101, 102]]
    seg = [[0, 0, 1, 1], [0, 0, 1], [0, 0, 0, 1, 1, 1], [0, 1]]
    p = pack(ids, seg, torch.device("cpu"), torch.float32)
    assert p.order.tolist() == [2, 0, 1, 3]  # longest first
    n = sum(map(len, ids))
    assert p.ids[:n].tolist() == ids[2] + ids[0] + ids[1] + ids[3]
    assert len(p.ids) == n + p.spare and p.spare == 16 - n
    assert p.cls.tolist() == [0, 6, 10, 13]
    assert p.positions[:n].tolist() == list(range(6)) + list(range(4)) + list(range(3)) + list(range(2))
    # Every real row is attended exactly once, by the group of its pair.
    rows = torch.cat(
        [g.gather.view(g.b, g.t).reshape(-1)[g.real] if g.real is not None else g.gather for g in p.groups]
    )
    assert rows.tolist() == list(range(n))
    assert all(
        g.t * 0.8 <= min(len(ids[i]) for i in p.order[sum(x.b for x in p.groups[:k]) :][: g.b].tolist())
        for k, g in enumerate(p.groups)
    )


def test_pack_keeps_ties_in_batch_order_and_refuses_empty_pairs():
    p = pack([[101, 102], [101, 5, 102], [101, 7]], [[0, 1], [0, 0, 1], [0, 1]], torch.device("cpu"), torch.float32)
    assert p.order.tolist() == [1, 0, 2] and p.cls.tolist() == [0, 3, 5]
    assert all(t.dtype == torch.long for t in (p.order, p.ids, p.segments, p.positions, p.cls))
    for bad in ([], [[101], []]):
        with pytest.raises(ValueError, match="at least one token"):
            pack(bad, bad, torch.device("cpu"), torch.float32)


def test_unpadded_batches_equal_padded_ones(tiny_checkpoint, unpacked):
    """The cpu inference path (no padding) against the padded forward, with and without a head mask,
    for pruned layers too, in float32."""
    model = RelevanceModel.load(tiny_checkpoint)
    assert model.unpadded and not unpacked.unpadded
    enc = model.encode(read_pairs(16) + read_pairs(8, "qbqtc"))
    mask = torch.ones(2, 4)
    mask[0, 2] = mask[1, 0] = 0
    for head_mask in (None, mask):
        want = unpacked.logits(enc.input_ids, enc.token_type_ids, head_mask)
        got = model.logits(enc.input_ids, enc.token_type_ids, head_mask)
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    one = model.logits(enc.input_ids[:1], enc.token_type_ids[:1])
    torch.testing.assert_close(one, unpacked.logits(enc.input_ids[:1], enc.token_type_ids[:1]), atol=ATOL, rtol=0)


def test_unpadded_pruned_model_equals_padded(tmp_path):
    path = make_tiny_checkpoint(tmp_path / "pruned", pruned_heads={0: [1], 1: [0, 3]})
    enc = RelevanceModel.load(path).encode(read_pairs(12))
    want = RelevanceModel.load(path, onednn=False, unpadded=False).logits(enc.input_ids, enc.token_type_ids)
    got = RelevanceModel.load(path).logits(enc.input_ids, enc.token_type_ids)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_forward_packed_refuses_training_mode(model):
    model.module.train()
    try:
        with pytest.raises(RuntimeError, match="inference"):
            model.module.forward_packed([[101, 102]], [[0, 0]])
    finally:
        model.module.eval()


def test_token_slices_cut_a_batch_into_consecutive_runs_under_the_budget():
    assert token_slices([3, 3, 3, 3], 6) == [slice(0, 2), slice(2, 4)]
    assert token_slices([5, 9, 1], 6) == [slice(0, 1), slice(1, 2), slice(2, 3)]  # a longer pair alone
    assert token_slices([2, 2], 100) == [slice(0, 2)]


def test_fused_kernels_forward_a_long_batch_in_slices_with_the_same_logits(tiny_checkpoint, monkeypatch):
    from model.engines import eager, kernels

    monkeypatch.setattr(kernels, "onednn_pays", lambda dtype: False)
    fused = RelevanceModel.load(tiny_checkpoint)
    assert fused.cpu_kernels == "fused"
    enc = fused.encode(read_pairs(40))
    whole = fused.logits(enc.input_ids, enc.token_type_ids)
    monkeypatch.setattr(eager, "FUSED_FORWARD_TOKENS", 64)  # several slices of this batch
    assert len(token_slices(enc.lengths, 64)) > 3
    torch.testing.assert_close(fused.logits(enc.input_ids, enc.token_type_ids), whole, atol=1e-5, rtol=0)
