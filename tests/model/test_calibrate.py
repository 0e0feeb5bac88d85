"""Temperature scaling: the fit finds a known temperature; folding it changes probabilities, not levels."""

from __future__ import annotations

import pytest
import torch

from model.calibrate import fit_temperature, fold_temperature
from model.checkpoint import load_module
from model.classifier import pad_batch
from tests.conftest import read_pairs


def test_fit_recovers_a_known_temperature():
    g = torch.Generator().manual_seed(0)
    true_logits = torch.randn(20000, 5, generator=g) * 2
    labels = torch.multinomial(true_logits.softmax(-1), 1, generator=g).squeeze(1)
    # a model 1.7x too confident: its logits are the true ones times 1.7
    t = fit_temperature(true_logits * 1.7, labels)
    assert abs(t - 1.7) < 0.06
    nll = torch.nn.functional.cross_entropy
    assert nll(true_logits * 1.7 / t, labels) <= nll(true_logits * 1.7, labels)


def test_folding_divides_logits_and_keeps_levels(tiny_checkpoint):
    from model.tokenizer import PairTokenizer

    module = load_module(tiny_checkpoint).eval()
    tok = PairTokenizer.from_dir(tiny_checkpoint)
    enc = tok.encode(*zip(*read_pairs(30)))
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids)
    with torch.no_grad():
        before, _ = module(ids, seg, mask)
        fold_temperature(module, 1.5)
        after, _ = module(ids, seg, mask)
        fold_temperature(module, 2.0)
    assert torch.allclose(after, before / 1.5, atol=1e-5)
    assert torch.equal(after.argmax(-1), before.argmax(-1))
    assert module.cfg.extra["qtrel_temperature"] == 3.0


def test_calibrate_fits_temperature_and_cut_points_in_one_checkpoint(tiny_checkpoint, tmp_path):
    from model.calibrate import calibrate
    from model.classifier import RelevanceModel
    from tests.conftest import shared_data

    data = tmp_path / "dev.csv"
    with shared_data("homedepot", "dev.csv").open(encoding="utf-8") as f:
        data.write_text("".join(line for _, line in zip(range(401), f)), encoding="utf-8")
    report = calibrate(tiny_checkpoint, data, tmp_path / "cal", min_share=0.02)
    assert len(report["level_cuts"]) == 4 and report["qwk_cuts"] >= report["qwk_argmax"]
    m = RelevanceModel.load(tmp_path / "cal")
    assert m.rule.cuts == pytest.approx(report["level_cuts"], abs=1e-6)
    assert m.cfg.extra["qtrel_temperature"] == pytest.approx(report["temperature"], rel=1e-3)
