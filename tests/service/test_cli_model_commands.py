"""The model commands through the `qtrel` entry point: it parses and dispatches to model/ functions."""

from __future__ import annotations

import json

from model.relevance import RelevanceModel
from service.cli import main
from tests.conftest import HOMEDEPOT, shared_data


def test_prune_command(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "pruned"
    assert (
        main(
            [
                "prune",
                str(tiny_checkpoint),
                str(shared_data("homedepot", "train.csv")),
                "--out",
                str(out),
                "--fraction",
                "0.5",
                "--limit",
                "40",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["removed"] == 4  # half of 8 heads
    RelevanceModel.load(out).predict([("drill", "cordless drill")])


def test_prune_refuses_a_fraction_out_of_range(tiny_checkpoint, tmp_path, capsys):
    # no data needed: the fraction is refused before the file is read
    assert (
        main(
            [
                "prune",
                str(tiny_checkpoint),
                str(HOMEDEPOT / "train.csv"),
                "--out",
                str(tmp_path / "p"),
                "--fraction",
                "1.0",
            ]
        )
        == 2
    )
    assert "--fraction" in capsys.readouterr().err


def test_train_options_come_from_train_args_with_their_defaults(tiny_checkpoint, tmp_path, capsys):
    from model.train.loop import TrainArgs

    train = shared_data("homedepot", "train.csv")
    small = tmp_path / "train.csv"
    with train.open(encoding="utf-8") as f:
        small.write_text("".join(line for _, line in zip(range(65), f)), encoding="utf-8")
    out = tmp_path / "run"
    assert (
        main(
            [
                "train",
                str(small),
                "--base",
                str(tiny_checkpoint),
                "--out",
                str(out),
                "--max-steps",
                "2",
                "--negatives",
                "0.5",
                "--no-progress",
            ]
        )
        == 0
    )
    saved = json.loads((out / "training_args.json").read_text())
    assert saved["negatives"] == 0.5 and saved["max_steps"] == 2
    assert saved["lr"] == TrainArgs("t", "b", "o").lr and saved["batch_size"] == TrainArgs("t", "b", "o").batch_size
    assert main(["train", str(small), "--base", str(tiny_checkpoint), "--out", str(out), "--select", "f2"]) == 2
    assert "--select must be one of" in capsys.readouterr().err
