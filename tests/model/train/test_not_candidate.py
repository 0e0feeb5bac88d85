"""A head with a "not a candidate" class: the config's levels and extra classes, the merge at scoring, the
class added to a trained head, training that labels negatives with it, and its calibration."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_module
from model.config import BertConfig, ConfigError
from model.data import read_labelled
from model.relevance import RelevanceModel, pad_batch
from model.scoring import merge_classes
from model.train.calibrate import calibrate
from model.train.loop import TrainArgs, add_not_candidate_class, epoch_data, train
from tests.conftest import make_tiny_checkpoint, read_pairs, shared_data

SIX = {i: lab for i, lab in enumerate(["1", "2", "3", "4", "5", "1"])}


def head_lines(src: Path, dst: Path, n: int) -> Path:
    with src.open(encoding="utf-8") as f:
        dst.write_text("".join(line for _, line in zip(range(n + 1), f)), encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def six(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("six") / "tiny-six", seed=3, id2label=SIX)


def test_the_config_tells_levels_from_extra_classes():
    cfg = BertConfig(id2label=SIX)
    assert cfg.num_labels == 6 and cfg.levels == ["1", "2", "3", "4", "5"]
    assert cfg.class_levels == [0, 1, 2, 3, 4, 0] and cfg.negative_class == 5
    d = cfg.to_dict()
    assert d["label2id"] == {"1": 0, "2": 1, "3": 2, "4": 3, "5": 4}  # a level's first class
    back = BertConfig.from_dict(d)
    assert back.labels == cfg.labels and back.negative_class == 5
    plain = BertConfig()
    assert plain.levels == plain.labels and plain.class_levels == [0, 1, 2, 3, 4] and plain.negative_class == 0
    with pytest.raises(ConfigError, match="levels come first"):
        BertConfig(id2label={0: "1", 1: "1", 2: "2"})


def test_merging_sums_each_levels_classes_and_is_the_identity_without_extra_classes():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(7, 6, generator=g) * 3
    merged = merge_classes(logits, [0, 1, 2, 3, 4, 0])
    p = logits.softmax(-1)
    want = torch.cat([p[:, :1] + p[:, 5:], p[:, 1:5]], 1)
    torch.testing.assert_close(merged.softmax(-1), want, atol=1e-6, rtol=0)
    torch.testing.assert_close(merged.exp().sum(-1), torch.ones(7), atol=1e-6, rtol=0)
    five = logits[:, :5]
    assert merge_classes(five, [0, 1, 2, 3, 4]) is five


@pytest.mark.parametrize("fast", [False, True])
def test_a_six_class_checkpoint_scores_five_levels_on_either_path(six, fast):
    m = RelevanceModel.load(six, onednn=fast, unpadded=fast)
    assert m.labels == ["1", "2", "3", "4", "5"] and m.describe()["labels"] == m.labels
    pairs = read_pairs(12)
    enc = m.encode(pairs)
    raw = m.encoded_logits(enc, raw=True)
    assert raw.shape == (12, 6)
    scores = m.predict(pairs)
    probs = torch.tensor([s.probs for s in scores])
    p = raw.softmax(-1)
    torch.testing.assert_close(probs, torch.cat([p[:, :1] + p[:, 5:], p[:, 1:5]], 1), atol=1e-5, rtol=0)
    values = torch.arange(1.0, 6.0)
    torch.testing.assert_close(torch.tensor([s.expected for s in scores]), probs @ values, atol=1e-4, rtol=0)


def test_transformers_reads_the_six_classes_we_merge(six):
    transformers = pytest.importorskip("transformers")
    ref = transformers.BertForSequenceClassification.from_pretrained(six, attn_implementation="eager").eval()
    ours = RelevanceModel.load(six, onednn=False, unpadded=False)
    enc = ours.encode(read_pairs(8))
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids)
    with torch.inference_mode():
        want = ref(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits
    assert want.shape == (8, 6)
    torch.testing.assert_close(ours.encoded_logits(enc, raw=True), want, atol=1e-5, rtol=0)


def test_adding_the_class_to_a_trained_head_changes_no_score(tiny_checkpoint):
    pairs = read_pairs(16)
    before = RelevanceModel.load(tiny_checkpoint).predict(pairs)
    module = load_module(tiny_checkpoint)
    add_not_candidate_class(module)
    assert module.cfg.labels == ["1", "2", "3", "4", "5", "1"] and module.classifier.out_features == 6
    assert "qtrel_level_bias" not in module.cfg.extra  # never calibrated with a bias: nothing to extend
    after = RelevanceModel(module, RelevanceModel.load(tiny_checkpoint).tokenizer).predict(pairs)
    for b, a in zip(before, after):
        assert a.level == b.level and a.expected == pytest.approx(b.expected, abs=1e-5)
        assert a.probs == pytest.approx(b.probs, abs=1e-6)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    return (
        head_lines(shared_data("homedepot", "train.csv"), d / "train.csv", 256),
        head_lines(shared_data("homedepot", "dev.csv"), d / "dev.csv", 400),
    )


def run_args(base: Path, data, out: Path, **kw) -> TrainArgs:
    fields = dict(epochs=1.0, batch_size=16, lr=1e-3, max_steps=8, progress=False, seed=0, negatives=0.5)
    fields.update(kw)
    return TrainArgs(train_file=str(data[0]), base=str(base), output_dir=str(out), dev_file=str(data[1]), **fields)


def test_training_adds_the_class_once_and_labels_the_negatives_with_it(tiny_checkpoint, data, tmp_path):
    args = run_args(tiny_checkpoint, data, tmp_path / "a", not_candidate=1, dev_negatives=0.25)
    summary = train(args)
    assert summary["steps"] == 8 and "neg_level1_share" in summary["history"][-1]
    module = load_module(tmp_path / "a")
    assert module.cfg.labels == ["1", "2", "3", "4", "5", "1"]
    judged = read_labelled(data[0], module.cfg.levels)
    ds = epoch_data(judged, args, 0, label=module.cfg.negative_class)
    extra = ds.labels[len(judged) :]
    assert len(extra) == 128 and set(extra) == {5} and max(judged.labels) <= 4
    # Continuing the six-class checkpoint keeps its six classes; an encoder-only base gets a six-class head.
    train(run_args(tmp_path / "a", data, tmp_path / "b", not_candidate=1, max_steps=2))
    assert load_module(tmp_path / "b").cfg.num_labels == 6
    train(run_args(tmp_path / "a", data, tmp_path / "c", max_steps=2))  # the flag is not needed to keep it
    assert load_module(tmp_path / "c").cfg.negative_class == 5
    # Without the flag a five-class head stays five.
    train(run_args(tiny_checkpoint, data, tmp_path / "d", max_steps=2))
    assert load_module(tmp_path / "d").cfg.num_labels == 5


def test_a_calibrated_heads_bias_record_grows_with_the_class():
    from model.builtin import builtin_dir

    module = load_module(builtin_dir())  # v2.1: calibrated with a bias per level
    before = module.cfg.extra["qtrel_level_bias"]
    add_not_candidate_class(module)
    assert module.cfg.extra["qtrel_level_bias"] == [*before, before[0]]


def test_calibration_fits_the_class_on_sampled_negatives(six, data, tmp_path):
    report = calibrate(six, data[1], tmp_path / "cal", bias=True, unrelated=0.95, negatives_weight=0.5)
    assert report["pairs"] == 400 and report["negatives_in_fit"] == 100
    assert len(report["level_bias"]) == 6 and len(report["level_cuts"]) == 4
    assert report["log_loss_after"] <= report["log_loss_before"] + 1e-6
    m = RelevanceModel.load(tmp_path / "cal")
    assert m.labels == ["1", "2", "3", "4", "5"] and m.cfg.num_labels == 6
    with open(data[1], encoding="utf-8", newline="") as f:
        pairs = [(r["query"], r["title"]) for _, r in zip(range(50), csv.DictReader(f))]
    scores = m.predict(pairs)
    assert all(len(s.probs) == 5 and sum(s.probs) == pytest.approx(1.0, abs=1e-5) for s in scores)
    # Temperature only: one scalar for all six classes.
    plain = calibrate(six, data[1], tmp_path / "t", cuts=False)
    assert plain["negatives_in_fit"] == 100 and "level_bias" not in plain


def test_the_openvino_forward_merges_the_classes_as_torch(six):
    pytest.importorskip("openvino")
    pairs = read_pairs(10)
    torch_path = RelevanceModel.load(six).predict(pairs)
    m = RelevanceModel.load(six)
    m.use_inference("openvino")
    assert m.describe()["inference"] == "openvino"
    for a, b in zip(m.predict(pairs), torch_path):
        assert len(a.probs) == 5 and a.probs == pytest.approx(b.probs, abs=1e-4) and a.level == b.level


def test_an_explanation_of_a_six_class_head_grades_five_levels(six):
    from model.explain import explain_pair

    m = RelevanceModel.load(six)
    (q, t) = read_pairs(1)[0]
    out = explain_pair(m, q, t, attention=True)
    (want,) = m.predict([(q, t)])
    assert out["labels"] == m.labels and len(out["probs"]) == 5
    assert out["score"] == pytest.approx(want.expected, abs=1e-3) and out["level"] == m.labels[want.level]
