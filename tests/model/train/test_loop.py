"""Fine-tuning end to end on the tiny checkpoint and real Home Depot rows: loss, outputs, resume."""

from __future__ import annotations

import csv
import json
import logging
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.relevance import RelevanceModel, pad_batch
from model.train.loop import TrainArgs, train
from tests.conftest import shared_data


def head_lines(src: Path, dst: Path, n: int) -> Path:
    """The header and the first n rows of a CSV file (no quoted field of these files spans lines)."""
    with src.open(encoding="utf-8") as f:
        dst.write_text("".join(line for _, line in zip(range(n + 1), f)), encoding="utf-8")
    return dst


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    train_file = head_lines(shared_data("homedepot", "train.csv"), d / "train.csv", 256)
    return train_file, head_lines(shared_data("homedepot", "dev.csv"), d / "dev.csv", 64)


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
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "training_args.json",
        "train_summary.json",
        "dev_metrics.json",
    ):
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


def test_negatives_and_the_ordinal_term_train_and_report_negatives(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    summary = train(
        args(
            tiny_checkpoint,
            data,
            out,
            max_steps=12,
            negatives=0.5,
            mse_weight=0.5,
            label_smoothing=0.1,
            dev_negatives=1.0,
            eval_every=6,
        )
    )
    # 256 judged + 128 negatives per epoch, batches of 16
    assert summary["steps"] == 12 and len(summary["losses"]) == 12
    last = summary["history"][-1]
    assert {"neg_level12_share", "neg_auc", "neg_level1_share"} <= set(last)
    # dev negatives share their queries with judged pairs, so the AUC is defined (NaN when none do)
    assert not math.isnan(last["neg_auc"])
    assert last["neg_level1_share"] <= last["neg_level12_share"]


def test_loss_has_the_expected_level_term():
    from model.train.loop import loss_fn

    logits = torch.tensor([[4.0, 0, 0, 0, 0], [0, 0, 0, 0, 4.0]])
    labels = torch.tensor([4, 4])
    values = torch.arange(1.0, 6.0)
    ce = torch.nn.functional.cross_entropy(logits, labels)
    e = logits.softmax(-1) @ values
    want = ce + 0.5 * (e - 5).pow(2).mean()
    got = loss_fn(logits, labels, values, TrainArgs("t", "b", "o", mse_weight=0.5))
    assert torch.allclose(got, want)
    assert torch.allclose(loss_fn(logits, labels, values, TrainArgs("t", "b", "o")), ce)
    targets = torch.tensor([4.34, 4.66])
    got = loss_fn(logits, labels, values, TrainArgs("t", "b", "o", mse_weight=0.5), targets)
    assert torch.allclose(got, ce + 0.5 * (e - targets).pow(2).mean())


def test_the_ordinal_term_can_target_the_raters_mean_relevance():
    from model.data import Dataset, Example
    from model.train.loop import mse_targets

    ds = Dataset([Example("q", "a", 3, relevance=2.67), Example("q", "b", 3, relevance=2.33), Example("q", "c", 1)])
    values = torch.arange(1.0, 6.0)
    assert mse_targets(ds, values, TrainArgs("t", "b", "o")) is None
    got = mse_targets(ds, values, TrainArgs("t", "b", "o", mse_target="relevance"))
    assert torch.allclose(got, torch.tensor([4.34, 3.66, 2.0]))  # both level 4 apart; no relevance: the level


def test_continue_or_new_head_is_decided_by_the_weights_not_an_error_message(
    tiny_checkpoint, data, tmp_path, monkeypatch
):
    import model.checkpoint as ckpt

    # Rewording the load error must not change the decision (it once hinged on the message text).
    real = ckpt.load_module

    def reworded(path, num_labels_fallback=False):
        try:
            return real(path, num_labels_fallback)
        except ckpt.CheckpointError as e:
            raise ckpt.CheckpointError("some other wording") from e

    monkeypatch.setattr("model.train.loop.load_module", reworded)
    base = shutil.copytree(tiny_checkpoint, tmp_path / "encoder")
    state = load_file(str(base / "model.safetensors"))
    del state["classifier.weight"], state["classifier.bias"]
    save_file(state, str(base / "model.safetensors"))
    assert train(args(base, data, tmp_path / "out", max_steps=2))["steps"] == 2


def test_an_encoder_tensor_of_another_shape_is_refused_not_trained_as_pretrained(tmp_path):
    from model.checkpoint import CheckpointError
    from model.train.encoder import new_from_encoder
    from tests.conftest import make_tiny_checkpoint

    base = make_tiny_checkpoint(tmp_path / "enc")
    state = load_file(str(base / "model.safetensors"))
    del state["classifier.weight"], state["classifier.bias"]
    # a pooler of another width than the config says: the encoder cannot be copied as is
    key = next(k for k in state if k.endswith("pooler.dense.weight"))
    state[key] = torch.zeros(16, 16)
    save_file(state, str(base / "model.safetensors"))
    with pytest.raises(CheckpointError):
        new_from_encoder(base)


def test_bfloat16_autocast_hard_and_foreign_negatives_and_a_checkpoint_per_evaluation(tiny_checkpoint, data, tmp_path):
    out = tmp_path / "out"
    kw = dict(max_steps=6, eval_every=3, negatives=0.5, hard_negatives=0.5, foreign_negatives=0.25, dev_negatives=0.0)
    kw.update(mse_weight=0.5, mse_target="relevance")
    summary = train(args(tiny_checkpoint, data, out, autocast="bfloat16", keep_evals=1, **kw))
    assert summary["steps"] == 6 and all(torch.isfinite(torch.tensor(summary["losses"])))
    for step in (3, 6):
        assert (out / f"step-{step}" / "model.safetensors").is_file()
    RelevanceModel.load(out / "step-3")  # a plain checkpoint, float32
    with pytest.raises(ValueError, match="--autocast"):
        train(args(tiny_checkpoint, data, tmp_path / "bad", autocast="float16", max_steps=1))
    with pytest.raises(ValueError, match="--mse-target"):
        train(args(tiny_checkpoint, data, tmp_path / "bad", mse_target="mean", max_steps=1))
    with pytest.raises(ValueError, match="--foreign-negatives"):
        train(args(tiny_checkpoint, data, tmp_path / "bad", hard_negatives=0.8, foreign_negatives=0.3, max_steps=1))
