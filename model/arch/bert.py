"""BERT (BertForSequenceClassification): the reference layout; model.bert runs it."""

from __future__ import annotations

from typing import Any

from model.arch.spec import Architecture
from model.bert import BertForRelevance
from model.config import BertConfig

# The post-norm encoder's tensors, shared by every BERT-shaped architecture that keeps BERT's names
ENCODER = (
    ("embeddings.word_embeddings.weight", "embeddings.word.weight"),
    ("embeddings.position_embeddings.weight", "embeddings.position.weight"),
    ("embeddings.token_type_embeddings.weight", "embeddings.token_type.weight"),
    ("embeddings.LayerNorm.{p}", "embeddings.norm.{p}"),
    ("encoder.layer.{i}.attention.self.query.{p}", "layers.{i}.attn.query.{p}"),
    ("encoder.layer.{i}.attention.self.key.{p}", "layers.{i}.attn.key.{p}"),
    ("encoder.layer.{i}.attention.self.value.{p}", "layers.{i}.attn.value.{p}"),
    ("encoder.layer.{i}.attention.output.dense.{p}", "layers.{i}.attn.out.{p}"),
    ("encoder.layer.{i}.attention.output.LayerNorm.{p}", "layers.{i}.attn_norm.{p}"),
    ("encoder.layer.{i}.intermediate.dense.{p}", "layers.{i}.up.{p}"),
    ("encoder.layer.{i}.output.dense.{p}", "layers.{i}.down.{p}"),
    ("encoder.layer.{i}.output.LayerNorm.{p}", "layers.{i}.ffn_norm.{p}"),
)
# The dense layer over [CLS] of the RoBERTa-style heads (XLM-R, ELECTRA): classifier.dense -> out_proj
DENSE_HEAD = (("classifier.dense.{p}", "bert.pooler.dense.{p}"), ("classifier.out_proj.{p}", "classifier.{p}"))


def build(cfg: BertConfig, with_pooler: bool) -> BertForRelevance:
    return BertForRelevance(cfg, with_pooler=with_pooler)


def write_config(cfg: BertConfig) -> dict[str, Any]:
    return cfg.to_dict()


BERT = Architecture(
    model_type="bert",
    hf_class="BertForSequenceClassification",
    prefix="bert.",
    encoder=(*ENCODER, ("pooler.dense.{p}", "pooler.dense.{p}")),
    head=(("classifier.{p}", "classifier.{p}"),),
    read_config=BertConfig.from_dict,
    write_config=write_config,
    build=build,
    fast=True,
)
