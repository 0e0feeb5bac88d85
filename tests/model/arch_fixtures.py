"""Small randomly initialised checkpoints of each architecture, built and saved by `transformers` itself,
and random pairs of token ids to feed them: the references the parity tests compare against."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordPiece
from tokenizers.pre_tokenizers import WhitespaceSplit

VOCAB = 300
TITLE = 60  # longest random title
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
INIT = 0.2  # larger than the usual 0.02, so that pairs get distinct logits and levels


def spec(name: str, num_labels: int) -> tuple[Any, Any]:
    """(config, model class) of a small `name` checkpoint in transformers."""
    import transformers as tf

    if name == "xlm-roberta":  # positions from pad + 1: 130 rows hold 128 tokens
        cfg = tf.XLMRobertaConfig(**SMALL, max_position_embeddings=130, type_vocab_size=1, pad_token_id=1)
        return cfg, tf.XLMRobertaForSequenceClassification
    if name == "electra":  # embeddings half the layers' width: the projection runs
        cfg = tf.ElectraConfig(**SMALL, embedding_size=16, max_position_embeddings=128)
        return cfg, tf.ElectraForSequenceClassification
    if name == "distilbert":
        cfg = tf.DistilBertConfig(vocab_size=VOCAB, dim=32, n_layers=2, n_heads=4, hidden_dim=64)
        return cfg, tf.DistilBertForSequenceClassification
    if name.startswith("modernbert"):  # 4 layers: global, local, local, global; a window of 8 that pairs exceed
        cfg = tf.ModernBertConfig(
            **{**SMALL, "num_hidden_layers": 4, "intermediate_size": 48},
            local_attention=8,
            max_position_embeddings=256,
            pad_token_id=0,
            cls_token_id=2,
            sep_token_id=3,
            bos_token_id=2,
            eos_token_id=3,
            classifier_pooling="mean" if name == "modernbert-mean" else "cls",
        )
        return cfg, tf.ModernBertForSequenceClassification
    raise ValueError(name)


def build_reference(name: str, path: Path, num_labels: int, seed: int = 0):
    """A seeded `name` model from transformers, saved (safetensors) to `path` with a small WordPiece
    tokenizer.json; returns the model in eval mode."""
    cfg, cls = spec(name, num_labels)
    cfg.num_labels = num_labels
    cfg.initializer_range = INIT
    torch.manual_seed(seed)
    model = cls._from_config(cfg, attn_implementation="eager").eval()  # eager: it returns the probabilities
    center_head(model, cfg.pad_token_id)
    model.save_pretrained(path)
    tiny_wordpiece().save(str(path / "tokenizer.json"))
    return model


@torch.inference_mode()
def center_head(model, pad: int) -> None:
    """Point the classifier at the directions in which random pairs' features vary most, each logit scaled to
    unit spread and centred: a random head grades almost every pair alike (its features differ little from
    pair to pair), and levels that never vary would make their agreement meaningless."""
    out = model.classifier.out_proj if hasattr(model.classifier, "out_proj") else model.classifier
    seen: list[torch.Tensor] = []
    hook = out.register_forward_hook(lambda m, args, y: seen.append(args[0]))
    x, mask = padded(random_pairs(300, seed=99)[0], pad)
    model(input_ids=x, attention_mask=mask)
    hook.remove()
    feats = seen[0]
    mean = feats.mean(0)
    _, s, v = torch.linalg.svd(feats - mean, full_matrices=False)
    k = out.weight.shape[0]
    w = v[:k] / (s[:k, None] / len(feats) ** 0.5)  # (k, H): unit spread along each top direction
    out.weight.copy_(w)
    out.bias.copy_(-w @ mean)


def tiny_wordpiece() -> Tokenizer:
    words = [f"w{i}" for i in range(VOCAB - len(SPECIALS))]
    tok = Tokenizer(WordPiece({t: i for i, t in enumerate(SPECIALS + words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    return tok


def random_pairs(n: int, seed: int = 0, cls: int = 2, sep: int = 3) -> tuple[list[list[int]], list[list[int]]]:
    """n framed pairs `[CLS] q [SEP] t [SEP]` of random ids (2-10 query and 3-60 title tokens), with segments."""
    rng = random.Random(seed)
    ids, segs = [], []
    for _ in range(n):
        q = [rng.randrange(len(SPECIALS), VOCAB) for _ in range(rng.randint(2, 10))]
        t = [rng.randrange(len(SPECIALS), VOCAB) for _ in range(rng.randint(3, TITLE))]
        ids.append([cls, *q, sep, *t, sep])
        segs.append([0] * (len(q) + 2) + [1] * (len(t) + 1))
    return ids, segs


def padded(ids: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) ids and attention mask."""
    T = max(map(len, ids))
    x = torch.full((len(ids), T), pad, dtype=torch.long)
    mask = torch.zeros(len(ids), T, dtype=torch.long)
    for i, row in enumerate(ids):
        x[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return x, mask
