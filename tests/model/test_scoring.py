"""The one scoring contract: expected level, the level rule (argmax or cut points), cut fitting."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from model.checkpoint import load_module, save_checkpoint
from model.relevance import RelevanceModel
from model.scoring import CONFIG_KEY, LevelRule, fit_cuts, level_values, score_logits
from model.tokenizer import PairTokenizer
from model.train.metrics import quadratic_kappa
from tests.conftest import read_pairs


def test_argmax_rule_and_expected_level():
    logits = torch.tensor([[3.0, 0, 0, 0, 0], [0, 0, 0, 0, 3.0], [0, 0, 1.0, 0, 0]])
    s = score_logits(logits, level_values(list("12345")), LevelRule())
    assert s.level.tolist() == [0, 4, 2]
    assert score_logits(torch.zeros(1, 5), level_values(list("12345")), LevelRule()).expected.item() == pytest.approx(3)
    assert torch.allclose(s.expected, (s.probs * torch.arange(1.0, 6.0)).sum(-1))


def test_cut_rule_is_monotone_in_the_expected_level():
    rule = LevelRule((1.4, 2.0, 3.1, 4.2))
    e = torch.linspace(1, 5, 2001)
    lv = rule.levels(torch.empty(0), e)
    assert (lv[1:] >= lv[:-1]).all() and set(lv.tolist()) == {0, 1, 2, 3, 4}
    # on a cut point the level steps up; just below it, it does not
    assert rule.levels(torch.empty(0), torch.tensor([1.3999, 1.4, 4.2])).tolist() == [0, 1, 4]


def test_cut_points_must_increase_and_match_the_levels():
    with pytest.raises(ValueError, match="increase"):
        LevelRule((2.0, 1.5, 3.0, 4.0))
    with pytest.raises(ValueError, match="need 4"):
        LevelRule.from_extra({CONFIG_KEY: [1.5, 2.5]}, 5)
    assert LevelRule.from_extra({}, 5) == LevelRule()


def test_fit_cuts_beats_midpoints_and_respects_min_share():
    # Scores squeezed towards the middle (as a model trained under a skewed prior gives): midpoints
    # rarely reach the outer levels, fitted cut points do.
    rng = random.Random(0)
    y = [rng.choice([0, 1, 2, 2, 3, 3, 3, 4, 4]) for _ in range(4000)]
    e = [3.2 + 0.35 * (t - 2.5) + rng.gauss(0, 0.3) for t in y]
    mid = LevelRule((1.5, 2.5, 3.5, 4.5)).levels(torch.empty(0), torch.tensor(e)).tolist()
    cuts = fit_cuts(e, y, 5, min_share=0.02)
    fitted = LevelRule(cuts).levels(torch.empty(0), torch.tensor(e)).tolist()
    assert quadratic_kappa(y, fitted, 5) > quadratic_kappa(y, mid, 5) + 0.05
    shares = torch.bincount(torch.tensor(fitted), minlength=5).double() / len(y)
    assert (shares >= 0.02).all(), shares


def test_fit_cuts_keeps_a_pinned_cut_and_fits_the_others_around_it():
    rng = random.Random(1)
    y = [rng.choice([0, 1, 2, 2, 3, 3, 3, 4, 4]) for _ in range(4000)]
    e = [3.2 + 0.35 * (t - 2.5) + rng.gauss(0, 0.3) for t in y]
    free = fit_cuts(e, y, 5, min_share=0.02)
    pinned = fit_cuts(e, y, 5, min_share=0.02, fixed={0: free[0] + 0.2})
    assert pinned[0] == free[0] + 0.2
    assert all(a < b for a, b in zip(pinned, pinned[1:]))
    # a pin above where the next cut was fitted pushes that one up rather than breaking the order
    high = fit_cuts(e, y, 5, min_share=0.0, fixed={0: free[1] + 0.05})
    assert high[0] == free[1] + 0.05 and all(a < b for a, b in zip(high, high[1:]))


def test_level_rule_round_trips_through_save_and_load_and_is_applied(tiny_checkpoint, tmp_path):
    module = load_module(tiny_checkpoint)
    tok = PairTokenizer.from_dir(tiny_checkpoint)
    plain = RelevanceModel(load_module(tiny_checkpoint), tok)
    pairs = read_pairs(40)
    expected = torch.tensor([p.expected for p in plain.predict(pairs)])
    # cut points at the quartiles of this model's scores: every level but one used, in score order
    q = torch.quantile(expected, torch.tensor([0.25, 0.5, 0.75])).tolist()
    cuts = (float(expected.min()) - 1.0, *q)
    module.cfg = replace(module.cfg, extra={**module.cfg.extra, **LevelRule(cuts).to_extra()})
    save_checkpoint(module, tok, tmp_path / "cut")
    for fast in (False, True):
        m = RelevanceModel.load(tmp_path / "cut", onednn=fast, unpadded=fast)
        assert m.rule.cuts == pytest.approx(cuts, abs=1e-6) and m.describe()["level_rule"] != "argmax"
        got = m.predict(pairs)
        want = LevelRule(tuple(m.rule.cuts)).levels(torch.empty(0), torch.tensor([p.expected for p in got]))
        assert [p.level for p in got] == want.tolist()
        assert {m.labels[p.level] for p in got} == {"2", "3", "4", "5"}


@pytest.mark.parametrize("levels", [1, 5])
def test_a_batchs_packed_rows_are_its_pair_scores_bit_for_bit(levels):
    """A model process sends a batch's rows as bytes (ScoredBatch.pack); unpacked, each row is the PairScore that
    `rows` gives, float for float; a row's first byte is its level."""
    from model.levels import pack_row, split_rows, unpack_row, unpack_rows

    g = torch.Generator().manual_seed(levels)
    logits = torch.randn(7, levels, generator=g) * 4
    scored = score_logits(logits, level_values([str(i) for i in range(levels)]), LevelRule())
    want = scored.rows()
    packed = scored.map(torch.Tensor.numpy).pack()
    rows = split_rows(packed, 7)
    assert unpack_rows(packed, 7) == want and [unpack_row(r) for r in rows] == want
    assert [pack_row(o) for o in want] == rows and [r[0] for r in rows] == [o.level for o in want]
    assert all(type(o.level) is int and type(o.expected) is float for o in unpack_rows(packed, 7))
    assert unpack_rows(b"", 0) == [] and split_rows(b"", 0) == []
