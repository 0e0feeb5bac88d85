"""`qtrel train --teacher`: reading per-pair teacher targets, blending them into the loss's targets
(negatives untouched), and a run that follows its teacher."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from model.data import DataError, Dataset, Example, read_labelled
from model.relevance import RelevanceModel, level_values
from model.train.loop import TrainArgs, loss_fn, train
from model.train.negatives import with_negatives
from model.train.teacher import read_teacher, teacher_targets
from tests.conftest import shared_data

LEVELS = ["1", "2", "3", "4", "5"]


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    with path.open("w", encoding="utf-8", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def small_ds() -> Dataset:
    return Dataset(
        [
            Example("drill", "DEWALT drill kit", 4, 3.0),
            Example("drill", "garden hose", 0, 1.0),
            Example("deck screws", "deck screw 2 in.", 3, 2.33),
            Example("deck screws", "wood glue", 2, 2.0),
        ]
    )


def test_targets_blend_matched_pairs_only(tmp_path):
    path = write_csv(
        tmp_path / "t.csv",
        ["query", "title", "relevance", *[f"p_{x}" for x in LEVELS]],
        [
            ["drill", "DEWALT drill kit", 2.0, 0, 0, 1, 0, 0],  # relevance only would be 3 (level value)
            ["drill", "garden hose", "", 0.5, 0.5, 0, 0, 0],  # a distribution without a relevance
        ],
    )
    teacher = read_teacher(path, LEVELS)
    ds = small_ds()
    values = level_values(LEVELS)
    base = torch.tensor([5.0, 1.0, 4.0, 3.0])  # what mse_targets gives with --mse-target relevance
    soft, target, matched = teacher_targets(ds, teacher, values, 0.25, base)
    assert matched == 2
    assert torch.allclose(soft[0], torch.tensor([0, 0, 0.25, 0, 0.75]))
    assert torch.allclose(soft[1], torch.tensor([0.875, 0.125, 0, 0, 0]))
    assert torch.equal(soft[2:], F.one_hot(torch.tensor([3, 2]), 5).float())  # unmatched: one-hot
    assert target.tolist() == pytest.approx([0.75 * 5 + 0.25 * 3, 1.0, 4.0, 3.0])  # no relevance: kept
    assert base.tolist() == [5.0, 1.0, 4.0, 3.0]  # not modified in place
    # Without an ordinal target of its own, the level's value is blended.
    _, target, _ = teacher_targets(ds, teacher, values, 1.0, None)
    assert target.tolist() == pytest.approx([3.0, 1.0, 4.0, 3.0])


def test_negatives_keep_their_targets(tmp_path):
    ds = small_ds()
    rows = [[e.query, e.title, 3.0] for e in ds.examples]
    teacher = read_teacher(write_csv(tmp_path / "t.csv", ["query", "title", "relevance"], rows), LEVELS)
    mixed = with_negatives(ds, 1.0, seed=0)
    values = level_values(LEVELS)
    soft, target, matched = teacher_targets(mixed, teacher, values, 0.5, None)
    assert matched == len(ds) < len(mixed)
    neg = slice(len(ds), None)
    assert (soft[neg, 0] == 1).all() and (target[neg] == 1).all()


def test_bad_teacher_rows_are_reported(tmp_path):
    header = ["query", "title", *[f"p_{x}" for x in LEVELS]]
    bad = write_csv(tmp_path / "bad.csv", header, [["a", "b", 0.5, 0.5, 0.5, 0, 0], ["c", "d", 1, 0, 0, 0, ""]])
    with pytest.raises(DataError, match=r"2 bad teacher rows[\s\S]*bad.csv:2[\s\S]*bad.csv:3"):
        read_teacher(bad, LEVELS)
    with pytest.raises(DataError, match="needs a finite relevance"):
        read_teacher(write_csv(tmp_path / "empty.csv", ["query", "title", "relevance"], [["a", "b", ""]]), LEVELS)


def test_one_hot_soft_targets_give_the_plain_loss():
    torch.manual_seed(0)
    logits, labels = torch.randn(6, 5), torch.tensor([0, 1, 2, 3, 4, 4])
    values = level_values(LEVELS)
    args = TrainArgs(train_file="", base="", output_dir="", mse_weight=0.5, label_smoothing=0.1)
    plain = loss_fn(logits, labels, values, args)
    assert torch.allclose(loss_fn(logits, labels, values, args, soft=F.one_hot(labels, 5).float()), plain)
    uniform = torch.full((6, 5), 0.2)
    assert not torch.allclose(loss_fn(logits, labels, values, args, soft=uniform), plain)


def test_a_run_follows_its_teacher(tiny_checkpoint, tmp_path, caplog):
    """The same seeded run with and without a teacher that calls every judged pair level 1: with it (weight
    1), the model's expected level on those pairs ends far lower; the plain run learns the labels (mostly 4-5)."""
    src = shared_data("homedepot", "train.csv")
    with src.open(encoding="utf-8") as f:
        train_file = tmp_path / "train.csv"
        train_file.write_text("".join(line for _, line in zip(range(97), f)), encoding="utf-8")
    ds = read_labelled(train_file, LEVELS)
    rows = [[e.query, e.title, 1.0, 1, 0, 0, 0, 0] for e in ds.examples]
    teacher = write_csv(tmp_path / "teacher.csv", ["query", "title", "relevance", *[f"p_{x}" for x in LEVELS]], rows)

    def run(out: str, **kw) -> float:
        args = TrainArgs(
            train_file=str(train_file),
            base=str(tiny_checkpoint),
            output_dir=str(tmp_path / out),
            epochs=3.0,
            batch_size=16,
            lr=2e-3,
            progress=False,
            seed=0,
            negatives=0.25,
            mse_weight=0.5,
            mse_target="relevance",
            **kw,
        )
        train(args)
        m = RelevanceModel.load(tmp_path / out)
        return m.encoded_logits(m.encode(ds.pairs)).softmax(-1).matmul(m.values).mean().item()

    plain = run("plain")
    with caplog.at_level("INFO", logger="qtrel.train"):
        taught = run("taught", teacher=str(teacher), teacher_weight=1.0)
    assert "teacher targets for 96 of 120 pairs" in caplog.text
    assert plain > 3.0 and taught < 2.0, (plain, taught)
