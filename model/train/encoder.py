"""A fresh relevance model from a pretrained encoder: where training starts."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from model.bert import BertForRelevance
from model.checkpoint import CheckpointError, load_module
from model.levels import DEFAULT_LEVELS
from model.tokenizer import PairTokenizer


def new_from_encoder(
    path: str | Path, labels: Sequence[str] = DEFAULT_LEVELS, seed: int = 0, max_length: int = 128
) -> tuple[BertForRelevance, PairTokenizer]:
    """A fresh relevance model: pretrained encoder from `path`, new seeded head (and pooler if the
    encoder has none), labelled `labels`."""
    path = Path(path)
    encoder = load_module(path, num_labels_fallback=True)
    cfg = encoder.cfg.with_labels(list(labels))
    module = BertForRelevance(cfg, with_pooler=True)
    module.init_weights(seed)
    src = encoder.state_dict()
    mismatched = [
        f"{k}: {tuple(src[k].shape)} vs {tuple(v.shape)}"
        for k, v in module.state_dict().items()
        if k in src and not k.startswith("classifier.") and src[k].shape != v.shape
    ]
    if mismatched:  # never train a tensor as if it were pretrained when it was not copied
        raise CheckpointError(f"{path}: encoder tensors do not fit the new model: {'; '.join(mismatched)}")
    with torch.no_grad():
        for k, v in module.state_dict().items():
            if k in src and not k.startswith("classifier."):
                v.copy_(src[k])
    tok = PairTokenizer.from_dir(path, max_length=min(max_length, cfg.max_position_embeddings))
    return module, tok
