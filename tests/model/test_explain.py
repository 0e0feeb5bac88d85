"""Explanations on the tiny checkpoint, each number recomputed here from the plain attention path."""

from __future__ import annotations

import pytest
import torch

from model.explain import PairLayout, explain_pair, term_matching
from model.relevance import RelevanceModel, level_values, pad_batch
from tests.conftest import make_tiny_checkpoint

PAIR = ("cordless drill", "dewalt 20v max cordless drill kit")


def reference(model, query, title):
    """ids, segments and the plain path's per-layer (nh, T, T) attention of one pair."""
    enc = model.encode([(query, title)])
    ids, seg = enc.input_ids[0], enc.token_type_ids[0]
    with torch.inference_mode():
        _, att = model.module(*pad_batch([ids], [seg]), output_attentions=True)
    return ids, seg, [a[0] for a in att]


def score_of(model, ids, seg) -> float:
    return float(model.probs([ids], [seg])[0] @ level_values(model.labels))


def test_shapes_probabilities_and_tokens(model):
    out = explain_pair(model, *PAIR, attention=True)
    ids, seg, _ = reference(model, *PAIR)
    T = len(ids)
    assert [t["token"] for t in out["tokens"]] == model.tokenizer.tokens(ids)
    assert [t["segment"] for t in out["tokens"]] == seg
    special = [i for i, t in enumerate(out["tokens"]) if t["special"]]
    assert special == [0, seg.index(1) - 1, T - 1]
    probs = list(out["probs"].values())
    assert list(out["probs"]) == out["labels"] == model.labels
    assert sum(probs) == pytest.approx(1, abs=1e-5)
    assert out["level"] == model.labels[max(range(5), key=probs.__getitem__)]
    assert out["score"] == pytest.approx(score_of(model, ids, seg), abs=1e-5)
    assert [len(layer["heads"]) for layer in out["layers"]] == [4, 4]
    att = torch.tensor(out["attention"])
    assert att.shape == (2, 4, T, T)
    torch.testing.assert_close(att.sum(-1), torch.ones(2, 4, T), atol=T * 5e-5, rtol=0)
    assert "attention" not in explain_pair(model, *PAIR)  # only on request


def test_attention_and_cross_mass_match_the_plain_path(model):
    out = explain_pair(model, *PAIR, attention=True)
    ids, seg, att = reference(model, *PAIR)
    lay = PairLayout.of(seg)
    q, t = lay.query, lay.title
    for layer, summary in enumerate(out["layers"]):
        for h, head in enumerate(summary["heads"]):
            a = att[layer][h]
            assert head["head"] == h
            assert head["cls"] == pytest.approx(a[0].tolist(), abs=1e-6)
            assert out["attention"][layer][h] == [pytest.approx(row, abs=5e-5) for row in a.tolist()]
            assert head["query_to_title"] == pytest.approx(float(a[q][:, t].sum(1).mean()), abs=1e-6)
            assert head["title_to_query"] == pytest.approx(float(a[t][:, q].sum(1).mean()), abs=1e-6)


def test_occlusion_is_the_score_drop_of_masking_each_token(model):
    out = explain_pair(model, *PAIR)
    ids, seg, _ = reference(model, *PAIR)
    assert out["occlusion"]["replacement"] == "[MASK]"
    mask_id = model.tokenizer.token_id("[MASK]")
    base = score_of(model, ids, seg)
    attribution = out["occlusion"]["attribution"]
    assert len(attribution) == len(ids)
    for i, (a, tok) in enumerate(zip(attribution, out["tokens"])):
        if tok["special"]:
            assert a is None
            continue
        masked = list(ids)
        masked[i] = mask_id
        assert a == pytest.approx(base - score_of(model, masked, seg), abs=1e-5), tok["token"]
    assert max(abs(a) for a in attribution if a is not None) > 1e-3  # the tokens do matter


def test_term_matching_heads_on_a_shared_word(model):
    out = explain_pair(model, "drill", "drill bit", top_heads=3)
    ids, seg, att = reference(model, "drill", "drill bit")
    assert model.tokenizer.tokens(ids) == ["[CLS]", "drill", "[SEP]", "drill", "bit", "[SEP]"]
    # one shared token: query "drill" at 1, title "drill" at 3
    want = sorted(
        ((float(att[L][h][1, 3] + att[L][h][3, 1]) / 2, L, h) for L in range(2) for h in range(4)), reverse=True
    )[:3]
    got = out["term_matching_heads"]
    assert [(g["layer"], g["head"]) for g in got] == [(L, h) for _, L, h in want]
    for g, (s, L, h) in zip(got, want):
        assert g["score"] == pytest.approx(s, abs=1e-6)
        assert g["query_to_title"] == pytest.approx(float(att[L][h][1, 3]), abs=1e-6)
        assert g["title_to_query"] == pytest.approx(float(att[L][h][3, 1]), abs=1e-6)
    assert explain_pair(model, "drill", "garden hose")["term_matching_heads"] == []


def test_term_matching_finds_the_head_that_links_twins():
    # [CLS] a b [SEP] b c a [SEP]: head (1, 2) sends each shared token to its twin, the others are uniform
    ids = [101, 7, 8, 102, 8, 9, 7, 102]
    lay = PairLayout.of([0, 0, 0, 0, 1, 1, 1, 1])
    T = len(ids)
    att = torch.full((2, 3, T, T), 1 / T)
    twin = torch.eye(T) * 0.1
    for i, j in ((1, 6), (2, 4)):
        twin[i, j] = twin[j, i] = 0.9
    att[1, 2] = twin
    q2t, t2q = term_matching(att, ids, lay)
    assert q2t.shape == (2, 3)
    assert float(q2t[1, 2]) == pytest.approx(0.9) and float(t2q[1, 2]) == pytest.approx(0.9)  # c has no twin
    assert float(q2t[0, 0]) == pytest.approx(1 / T)
    assert term_matching(att, [101, 7, 102, 9, 102], PairLayout.of([0, 0, 0, 1, 1])) is None


def test_truncated_pair_and_unpacked_model(tiny_checkpoint):
    m = RelevanceModel.load(tiny_checkpoint, max_length=16, onednn=False, unpadded=False)
    out = explain_pair(m, "drill", "cordless drill " * 20, top_heads=2)
    assert out["truncated"] and len(out["tokens"]) == 16
    assert len(out["occlusion"]["attribution"]) == 16 and len(out["term_matching_heads"]) == 2


def test_pruned_heads_are_left_out(tmp_path):
    m = RelevanceModel.load(make_tiny_checkpoint(tmp_path / "pruned", pruned_heads={0: [1, 3]}))
    out = explain_pair(m, "drill", "drill bit", top_heads=8, attention=True)
    assert [h["head"] for h in out["layers"][0]["heads"]] == [0, 2]
    assert out["attention"][0][1] is None and out["attention"][0][3] is None
    assert len(out["term_matching_heads"]) == 6
    assert (0, 1) not in {(g["layer"], g["head"]) for g in out["term_matching_heads"]}
