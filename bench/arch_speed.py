"""Per-FLOP speed of each architecture on the path it serves on, against BERT of the same shape.

Random checkpoints of one shape (transformers builds them: MiniLM's width, 384 hidden, 12 heads, 1536 FFN, 4
layers; ModernBERT with the FFN that gives it BERT's parameter count per layer), each loaded as the service
loads it (bfloat16 where the CPU runs it natively, else float32; one thread), timed on the same batch of 32
random pairs (12-72 tokens) in interleaved rounds: the best of each. FLOPs are the full forward's multiply-adds
x 2 (projections, feed-forward, attention scores and context), so a faster path on less work does not count
as faster per FLOP. Prints one line per architecture; nothing is written.

    python bench/arch_speed.py            # 15 rounds
    python bench/arch_speed.py --quick    # 2 rounds, a smoke run
"""

from __future__ import annotations

import argparse
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from model.device import cpu_flags
from model.relevance import RelevanceModel
from tests.model.arch_fixtures import VOCAB, random_pairs, tiny_wordpiece

SHAPE: dict[str, Any] = dict(vocab_size=VOCAB, hidden_size=384, num_hidden_layers=4, num_attention_heads=12)


def build(name: str, path: Path) -> None:
    import transformers as tf

    cfg: Any
    cls: Any
    if name == "bert":
        cfg = tf.BertConfig(**SHAPE, intermediate_size=1536)
        cls = tf.BertForSequenceClassification
    elif name == "xlm-roberta":
        cfg = tf.XLMRobertaConfig(**SHAPE, intermediate_size=1536, max_position_embeddings=514, type_vocab_size=1)
        cls = tf.XLMRobertaForSequenceClassification
    elif name == "electra":
        cfg = tf.ElectraConfig(**SHAPE, intermediate_size=1536, embedding_size=128)
        cls = tf.ElectraForSequenceClassification
    elif name == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=384, n_layers=4, n_heads=12, hidden_dim=1536)
        cls = tf.DistilBertForSequenceClassification
    else:  # GeGLU: 3 matrices of H x I; I = 1024 gives BERT's 2 x 384 x 1536 per layer
        cfg = tf.ModernBertConfig(**SHAPE, intermediate_size=1024, pad_token_id=0, max_position_embeddings=512)
        cls = tf.ModernBertForSequenceClassification
    cfg.num_labels = 1
    cls(cfg).eval().save_pretrained(path)
    tiny_wordpiece().save(str(path / "tokenizer.json"))


def flops(m: RelevanceModel, ids: list[list[int]]) -> float:
    c = m.cfg
    h, n = c.hidden_size, sum(map(len, ids))
    ffn = 3 * c.intermediate_size if c.model_type == "modernbert" else 2 * c.intermediate_size
    attention = 2 * sum(len(x) ** 2 for x in ids) * h  # scores and context
    return 2.0 * c.num_hidden_layers * (n * (4 * h * h + ffn * h) + attention)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--dtype", default="auto")
    a = ap.parse_args()
    torch.set_num_threads(1)
    names = ["bert", "xlm-roberta", "electra", "distilbert", "modernbert"]
    ids, segs = random_pairs(32, seed=1)
    with tempfile.TemporaryDirectory() as tmp:
        models = {}
        for name in names:
            build(name, Path(tmp) / name)
            models[name] = RelevanceModel.load(Path(tmp) / name, dtype=a.dtype)
            models[name].warm_up(256 if a.quick else 4096)  # --quick: a smoke run, not a timing
        best = dict.fromkeys(names, float("inf"))
        for _ in range(2 if a.quick else 15):
            for name, m in models.items():
                t0 = time.perf_counter()
                m.logits(ids, segs)
                best[name] = min(best[name], time.perf_counter() - t0)
    rate = {k: flops(models[k], ids) / best[k] / 1e9 for k in names}
    isa = [f for f in ("avx512_bf16", "amx_bf16") if f in cpu_flags()]
    print(f"# {platform.processor() or platform.machine()} {'+'.join(isa)}, 1 thread, {models['bert'].dtype}")
    for k in names:
        m = models[k]
        print(
            f"{k:12s} {best[k] * 1e3:7.2f} ms  {rate[k]:6.1f} GFLOP/s  BERT's per-FLOP rate / this: "
            f"{rate['bert'] / rate[k]:.2f}x  ({m.path})"
        )


if __name__ == "__main__":
    main()
