"""Head masking experiments and real head pruning on the tiny checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from model.checkpoint import load_module, save_checkpoint
from model.data import read_labelled
from model.relevance import RelevanceModel, pad_batch
from model.tokenizer import PairTokenizer
from model.train.heads import gradient_importance, mask_of, prune_heads, prune_order
from model.train.heads_run import run, subset_by_query
from tests.conftest import read_pairs, shared_data


@pytest.fixture(scope="module")
def batch(tiny_checkpoint):
    tok = PairTokenizer.from_dir(tiny_checkpoint)
    pairs = read_pairs(24)
    enc = tok.encode([q for q, _ in pairs], [t for _, t in pairs])
    return enc, pad_batch(enc.input_ids, enc.token_type_ids)


@pytest.mark.parametrize("remove", [[(0, 1)], [(0, 0), (0, 2), (1, 3)], [(1, 0), (1, 1), (1, 2)]])
def test_pruned_model_equals_masked_model(tiny_checkpoint, batch, remove):
    module = load_module(tiny_checkpoint).eval()
    _, (ids, seg, att) = batch
    with torch.no_grad():
        masked, _ = module(ids, seg, att, head_mask=mask_of(2, 4, remove))
        pruned = prune_heads(module, remove).eval()
        fast, _ = pruned(ids, seg, att)
        plain, probs = pruned(ids, seg, att, output_attentions=True)
    assert torch.allclose(masked, fast, atol=1e-5)
    assert torch.allclose(masked, plain, atol=1e-5)
    for la, layer in enumerate(pruned.bert.layers):
        kept = [h for h in range(4) if (la, h) not in remove]
        assert layer.attn.heads == kept and probs[la].shape[1] == len(kept)
        assert layer.attn.query.weight.shape[0] == len(kept) * 8
    # a head mask on a pruned model still uses the original head indices
    extra = [h for h in range(4) if (0, h) not in remove][0]
    with torch.no_grad():
        a, _ = pruned(ids, seg, att, head_mask=mask_of(2, 4, [(0, extra)]))
        b, _ = module(ids, seg, att, head_mask=mask_of(2, 4, remove + [(0, extra)]))
    assert torch.allclose(a, b, atol=1e-5)


def test_pruned_checkpoint_round_trip(tiny_checkpoint, batch, tmp_path):
    module = load_module(tiny_checkpoint).eval()
    enc, (ids, seg, att) = batch
    pruned = prune_heads(module, [(0, 1), (1, 2)])
    save_checkpoint(pruned, PairTokenizer.from_dir(tiny_checkpoint), tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["pruned_heads"] == {"0": [1], "1": [2]}
    loaded = RelevanceModel.load(tmp_path)  # packed fast path
    with torch.no_grad():
        want, _ = pruned.eval()(ids, seg, att)
    got = loaded.logits(enc.input_ids, enc.token_type_ids)
    assert torch.allclose(got, want, atol=1e-5)
    # pruning again accumulates
    again = prune_heads(load_module(tmp_path), [(0, 3)])
    assert again.cfg.pruned_heads == {0: [1, 3], 1: [2]}


def test_cannot_prune_every_head_of_a_layer(tiny_checkpoint):
    with pytest.raises(ValueError, match="every head of layer 1"):
        prune_heads(load_module(tiny_checkpoint), [(1, h) for h in range(4)])


def test_gradient_importance_and_order(tiny_checkpoint, batch):
    module = load_module(tiny_checkpoint)
    enc, _ = batch
    labels = [i % 5 for i in range(len(enc))]
    imp = gradient_importance(module, enc, labels)
    assert imp.shape == (2, 4) and (imp > 0).all()
    pruned = prune_heads(module, [(0, 1)])
    imp2 = gradient_importance(pruned, enc, labels)
    assert imp2[0, 1] == 0 and (imp2[1] > 0).all()
    order = prune_order(imp2, pruned)
    assert (0, 1) not in order and len(order) == 7


def test_experiments_write_json_and_png(tiny_checkpoint, tmp_path):
    dev = shared_data("homedepot", "dev.csv")
    res = run(str(tiny_checkpoint), str(dev), str(tmp_path), limit=60, seeds=2, progress=False)
    for name in ("random", "lower_vs_upper", "whole_layers", "single_heads", "term_matching"):
        assert (tmp_path / f"{name}.json").is_file()
        assert (tmp_path / f"{name}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # no heads masked = the base model, exactly
    zero = res["random"]["points"][0]
    assert zero["fraction"] == 0.0 and all(v == 0 for v in zero["mean_relative_change"].values())
    assert len(res["single_heads"]["relative_change"]["accuracy"]) == 2
    scores = res["term_matching"]["scores"]
    assert len(scores) == 2 and len(scores[0]) == 4 and all(s >= 0 for row in scores for s in row)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["pairs"] >= 60


def test_subset_keeps_whole_queries():
    ds = read_labelled(shared_data("homedepot", "dev.csv"), ["1", "2", "3", "4", "5"])
    sub = subset_by_query(ds, 300)
    qs = {e.query for e in sub.examples}
    assert len(sub) >= 300
    assert sum(1 for e in ds.examples if e.query in qs) == len(sub)


def test_prune_command_removes_the_asked_share_and_keeps_a_head_per_layer(tiny_checkpoint, tmp_path):
    from model.train.heads import prune_checkpoint

    train_csv = shared_data("homedepot", "train.csv")
    out = tmp_path / "pruned"
    assert prune_checkpoint(tiny_checkpoint, train_csv, out, fraction=0.75, limit=40)["removed"] == 6
    cfg = json.loads((out / "config.json").read_text())
    removed = {int(k): v for k, v in cfg["pruned_heads"].items()}
    assert sum(len(v) for v in removed.values()) == 6  # 75% of 8 heads
    assert all(len(v) < 4 for v in removed.values())  # every layer keeps a head
    RelevanceModel.load(out).predict([("drill", "cordless drill")])
