"""builtin:zh, the Chinese model: loads from the package on the fast path, grades Chinese pairs sensibly,
reads Chinese where the English default cannot, and reproduces its held-out metrics on a sample."""

from __future__ import annotations

import json

import pytest

from model.builtin import builtin_dir, resolve_model
from model.relevance import RelevanceModel
from model.train.metrics import accuracy, macro_f1
from model.train.qbqtc import merge, split
from tests.conftest import shared_data

# (query, a title it asks for, an unrelated title)
PAIRS = [
    ("苹果手机价格", "苹果iPhone 15手机最新报价_苹果手机价格大全", "离婚协议书怎么写才有效"),
    ("小孩咳嗽感冒", "小孩感冒咳嗽吃什么药好得快", "北京到上海高铁票价查询"),
    ("红烧肉的做法", "红烧肉的家常做法步骤图解", "英雄联盟新版本更新公告"),
]
SAMPLE = 600  # held-out pairs scored here (of 4,449): a few seconds


@pytest.fixture(scope="module")
def zh() -> RelevanceModel:
    return RelevanceModel.load(resolve_model("builtin:zh"), dtype="bfloat16", max_length=64)


def test_builtin_zh_is_small_says_its_languages_and_runs_on_the_fast_path(zh):
    d = builtin_dir("zh")
    assert (d / "model.safetensors").stat().st_size <= 64_000_000
    cfg = json.loads((d / "config.json").read_text(encoding="utf-8"))
    assert cfg["languages"] == ["zh", "en"] and cfg["id2label"] == {"0": "1", "1": "2", "2": "3"}
    assert zh.tokenizer.template.kind == "template" and zh.tokenizer.specials == 4
    assert zh.describe()["inference"] == "torch" and zh.module.training is False


def test_chinese_pairs_grade_sensibly(zh):
    queries = [q for q, _, _ in PAIRS for _ in range(2)]
    titles = [t for _, good, bad in PAIRS for t in (good, bad)]
    got = zh.predict(list(zip(queries, titles)))
    for i, (q, _, _) in enumerate(PAIRS):
        good, bad = got[2 * i], got[2 * i + 1]
        assert good.expected > bad.expected + 0.5, (q, good.expected, bad.expected)
        # QBQTC's titles were retrieved for their queries, so its "poor" pairs are still near the topic: an
        # unrelated title grades 1 or 2 (1.1-1.7 here), a title that answers the query 2-3 (2.4-2.9)
        good_level, bad_level = zh.labels[good.level], zh.labels[bad.level]
        assert good_level in ("2", "3") and bad_level in ("1", "2") and bad.expected < 2.0, (q, good_level, bad_level)
    assert sum(zh.labels[got[i].level] == "1" for i in range(1, len(got), 2)) >= 2
    shares = zh.tokenizer.unknown_shares(queries, titles)
    assert max(shares) == 0.0  # every character here is in its vocabulary


def test_heldout_metrics_are_reproduced_on_a_sample(zh):
    pairs, _ = merge(shared_data("qbqtc"))
    _, held = split(pairs)
    sample = held[:SAMPLE]
    got = zh.predict([(p["query"], p["title"]) for p in sample])
    y, pred = [p["label"] for p in sample], [int(zh.labels[g.level]) - 1 for g in got]
    recorded = json.loads((builtin_dir("zh") / "config.json").read_text(encoding="utf-8"))["qtrel_heldout"]
    assert recorded["pairs"] == len(held) == 4449
    # a sample of 600 moves accuracy by about +-0.02 (one standard error) around the whole split's
    assert accuracy(y, pred) == pytest.approx(recorded["accuracy"], abs=0.06)
    assert macro_f1(y, pred, 3) == pytest.approx(recorded["macro_f1"], abs=0.08)
