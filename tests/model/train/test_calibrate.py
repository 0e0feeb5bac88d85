"""Temperature scaling: the fit finds a known temperature; folding it changes probabilities, not levels."""

from __future__ import annotations

import pytest
import torch

from model.checkpoint import load_module
from model.relevance import pad_batch
from model.train.calibrate import apply_isotonic, fit_isotonic, fit_temperature, fold_temperature, isotonic_rmse
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
    from model.relevance import RelevanceModel
    from model.train.calibrate import calibrate
    from tests.conftest import shared_data

    data = tmp_path / "dev.csv"
    with shared_data("homedepot", "dev.csv").open(encoding="utf-8") as f:
        data.write_text("".join(line for _, line in zip(range(401), f)), encoding="utf-8")
    report = calibrate(tiny_checkpoint, data, tmp_path / "cal", min_share=0.02)
    assert len(report["level_cuts"]) == 4 and report["qwk_cuts"] >= report["qwk_argmax"]
    m = RelevanceModel.load(tmp_path / "cal")
    assert m.rule.cuts == pytest.approx(report["level_cuts"], abs=1e-6)
    assert m.cfg.extra["qtrel_temperature"] == pytest.approx(report["temperature"], rel=1e-3)


def test_calibrate_can_put_most_unrelated_titles_at_the_lowest_level(tiny_checkpoint, tmp_path):
    from model.train.calibrate import calibrate
    from tests.conftest import shared_data

    data = tmp_path / "dev.csv"
    with shared_data("homedepot", "dev.csv").open(encoding="utf-8") as f:
        data.write_text("".join(line for _, line in zip(range(401), f)), encoding="utf-8")
    report = calibrate(tiny_checkpoint, data, tmp_path / "cal", min_share=0.02, unrelated=0.9)
    assert report["unrelated"]["negatives"] == 100
    assert report["unrelated"]["negatives_at_level_1"] >= 0.89
    with pytest.raises(ValueError, match="unrelated"):
        calibrate(tiny_checkpoint, data, tmp_path / "bad", unrelated=1.5)
    with pytest.raises(ValueError, match="unrelated"):
        calibrate(tiny_checkpoint, data, tmp_path / "bad", cuts=False, unrelated=0.9)


def test_isotonic_fit_pools_violators_and_is_the_least_squares_monotone_fit():
    xs, ys = fit_isotonic([1.0, 2.0, 3.0, 4.0, 5.0], [1.0, 3.0, 2.0, 4.0, 4.0])
    # (3, 2) pools into (2.5, 2.5); the two 4s into one block
    assert xs == [1.0, 2.5, 4.5] and ys == [1.0, 2.5, 4.0]
    with pytest.raises(ValueError, match="as many targets"):
        fit_isotonic([1.0], [])


def test_isotonic_map_is_strictly_increasing_and_hits_the_knots():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(3000, generator=g) * 4 + 1
    y = 1 + (x - 1).sqrt() + torch.randn(3000, generator=g) * 0.3  # monotone truth, noisy
    knots = fit_isotonic(x.tolist(), y.tolist())
    assert all(b > a for a, b in zip(knots[1], knots[1][1:]))
    grid = torch.linspace(0, 6, 5001, dtype=torch.float64)
    mapped = apply_isotonic(knots, grid)
    assert (mapped[1:] > mapped[:-1]).all()  # beyond the knots too: the ranking cannot change
    at_knots = apply_isotonic(knots, torch.tensor(knots[0], dtype=torch.float64))
    assert torch.allclose(at_knots, torch.tensor(knots[1], dtype=torch.float64))
    fitted = apply_isotonic(knots, x)
    assert (fitted - y).pow(2).mean() < ((x - 1) / 2 + 1 - y).pow(2).mean()  # beats a linear guess


def test_isotonic_rmse_reports_in_sample_and_cross_fitted():
    from model.data import Dataset, Example

    g = torch.Generator().manual_seed(1)
    rel = (torch.rand(400, generator=g) * 2 + 1).tolist()
    ds = Dataset([Example(f"q{i % 40}", f"t{i}", 0, relevance=r) for i, r in enumerate(rel)])
    expected = torch.tensor(rel) * 1.5 + torch.randn(400, generator=g) * 0.2  # a score that ranks, off scale
    rep = isotonic_rmse(ds, expected)
    assert rep["pairs"] == 400 and rep["rmse_isotonic"] <= rep["rmse_isotonic_crossfit"] < rep["rmse_linear"]
    ds.examples[0].relevance = None
    with pytest.raises(ValueError, match="relevance on every pair"):
        isotonic_rmse(ds, expected)
