"""Fine-tuning end to end on the tiny checkpoint and real Home Depot rows: loss, outputs, resume."""

from __future__ import annotations

import csv
import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.classifier import RelevanceModel, pad_batch
from model.train import TrainArgs, train
from tests.conftest import HOMEDEPOT


def head_lines(src: Path, dst: Path, n: int) -> Path:
    """The header and the first n rows of a CSV file (no quoted field of these files spans lines)."""
    with src.open(encoding="utf-8") as f:
        dst.write_text("".join(line for _, line in zip(range(n + 1), f)), encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    train_file = head_lines(HOMEDEPOT / "train.csv", d / "train.csv", 256)
    return train_file, head_lines(HOMEDEPOT / "dev.csv", d / "dev.csv", 64)


def args(base: Path, data, out: Path, **kw) -> TrainArgs:
    train_file, dev_file = data
    fields = dict(epochs=2.0, batch_size=16, lr=1e-3, max_steps=30, progress=False, seed=0)
    fields.update(kw)
    return TrainArgs(train_file=str(train_file), base=str(base), output_dir=str(out), dev_file=str(dev_file), **fields)


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, data, tmp_path_factory) -> tuple[dict, Path]:
    out = tmp_path_factory.mktemp("run") / "out"
    return train(args(tiny_checkpoint, data, out)), out


def test_loss_goes_down(trained):
    summary, _ = trained
    losses = summary["losses"]
    assert summary["steps"] == 30 and len(losses) == 30 and summary["train_rows"] == 256
    assert sum(losses[-5:]) / 5 < sum(losses[:5]) / 5, losses


def test_output_directory(trained, tiny_checkpoint):
    summary, out = trained
    for name in ("config.json", "model.safetensors", "tokenizer.json", "training_args.json",
                 "train_summary.json", "dev_metrics.json"):
        assert (out / name).is_file(), name
    saved = json.loads((out / "training_args.json").read_text())
    assert saved["lr"] == 1e-3 and saved["max_steps"] == 30
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 30
    # Dev evaluations at the end of the 16-step epoch and at the end; the better by QWK was kept.
    history = summary["history"]
    assert [h["step"] for h in history] == [16, 30]
    best = max(history, key=lambda h: h["qwk"])
    dev = json.loads((out / "dev_metrics.json").read_text())
    assert dev["step"] == best["step"] and dev["n"] == 64 and dev["qwk"] == summary["best"] == best["qwk"]
    # Training changed the weights it started from.
    before = load_file(str(tiny_checkpoint / "model.safetensors"))["classifier.weight"]
    after = load_file(str(out / "model.safetensors"))["classifier.weight"]
    assert (before - after).abs().max() > 1e-3


def test_output_loads_here_and_in_transformers_alike(trained, data):
    transformers = pytest.importorskip("transformers")
    _, out = trained
    ours = RelevanceModel.load(out)
    ref = transformers.BertForSequenceClassification.from_pretrained(out, attn_implementation="eager").eval()
    with open(data[1], encoding="utf-8", newline="") as f:
        pairs = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    enc = ours.encode(pairs)
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids)
    with torch.inference_mode():
        want = ref(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits
        got, _ = ours.module(ids, seg, mask)
    assert len(pairs) == 64
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_resume_continues_from_the_last_snapshot(tiny_checkpoint, data, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="qtrel.train")
    out = tmp_path / "out"
    first = train(args(tiny_checkpoint, data, out, max_steps=10))
    assert first["steps"] == 10 and (out / "last" / "trainer_state.pt").is_file()
    assert not any("resuming" in r.getMessage() for r in caplog.records)

    second = train(args(tiny_checkpoint, data, out, max_steps=20))
    assert any(r.getMessage() == "resuming at step 10 of 20" for r in caplog.records)
    assert second["steps"] == 20
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 20
    # The state came along: the first run's losses and its dev evaluation at step 10 are still there
    # (then one at the end of the 16-step epoch, and one at the end); a fresh start would have [16, 20].
    assert second["losses"][:10] == first["losses"] and len(second["losses"]) == 20
    assert [h["step"] for h in second["history"]] == [10, 16, 20]
    state = torch.load(out / "last" / "trainer_state.pt", weights_only=True)
    assert state["state"]["step"] == 20


def test_a_new_head_is_built_on_an_encoder_only_base(tiny_checkpoint, data, tmp_path):
    base = shutil.copytree(tiny_checkpoint, tmp_path / "encoder")
    state = load_file(str(base / "model.safetensors"))
    del state["classifier.weight"], state["classifier.bias"]
    save_file(state, str(base / "model.safetensors"))
    out = tmp_path / "out"
    summary = train(args(base, data, out, max_steps=3))
    assert summary["steps"] == 3
    assert RelevanceModel.load(out).labels == ["1", "2", "3", "4", "5"]


def test_a_head_with_other_labels_is_refused(tiny_checkpoint, data, tmp_path):
    with pytest.raises(ValueError, match="train from its encoder instead"):
        train(args(tiny_checkpoint, data, tmp_path / "out", labels=["1", "2", "3"], label_map={"4": "3", "5": "3"}))


def test_unknown_selection_metric(tiny_checkpoint, data, tmp_path):
    with pytest.raises(ValueError, match="--select must be one of"):
        train(args(tiny_checkpoint, data, tmp_path / "out", select="f2"))
