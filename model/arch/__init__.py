"""The architectures qtrel loads, chosen once at load from config.json's `model_type`: BERT, XLM-RoBERTa
(and RoBERTa), ELECTRA and DistilBERT on model.bert (its fast CPU path included), ModernBERT on
model.modernbert (model.engines.modern_packed without padding). Each names its checkpoints' tensors and
config keys (model.arch.spec)."""

from __future__ import annotations

from typing import Any

from model.arch.bert import BERT
from model.arch.distilbert import DISTILBERT
from model.arch.electra import ELECTRA
from model.arch.modernbert import MODERNBERT
from model.arch.spec import Architecture
from model.arch.xlmr import XLMR
from model.bert import BertForRelevance
from model.config import BertConfig, ConfigError
from model.modernbert import ModernBertForRelevance

Network = BertForRelevance | ModernBertForRelevance  # a relevance module of any architecture

ARCHITECTURES: dict[str, Architecture] = {
    t: a for a in (BERT, XLMR, ELECTRA, DISTILBERT, MODERNBERT) for t in (a.model_type, *a.aliases)
}

__all__ = ["ARCHITECTURES", "Architecture", "Network", "architecture", "read_config"]


def architecture(model_type: str) -> Architecture:
    try:
        return ARCHITECTURES[model_type]
    except KeyError:
        raise ConfigError(
            f"model_type {model_type!r} is not supported; qtrel runs BERT-family encoders and ModernBERT "
            f"({', '.join(sorted(ARCHITECTURES))})"
        ) from None


def read_config(d: dict[str, Any]) -> BertConfig:
    """Our config of a config.json, read by the architecture its `model_type` names (BERT without one)."""
    named = d.get("architectures") or []
    if not isinstance(named, list) or not all(isinstance(n, str) for n in named):
        raise ConfigError("architectures must be a list of class names")
    if "model_type" not in d:  # an old config: the class it names, else BERT
        found = [a.model_type for n in named for a in ARCHITECTURES.values() if n == a.hf_class]
        d = {**d, "model_type": found[0] if found else "bert"}
    return architecture(str(d["model_type"])).read_config(d)
