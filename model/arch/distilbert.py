"""DistilBERT (DistilBertForSequenceClassification): BERT's post-norm encoder under its own names
(`distilbert.transformer.layer.{i}.attention.q_lin` ...) and config keys (dim, n_layers, n_heads,
hidden_dim), no segments, LayerNorm eps 1e-12, and a head of pre_classifier -> ReLU -> classifier over
[CLS]. It runs on model.bert, fast path included."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.arch.bert import build
from model.arch.spec import Architecture
from model.config import BertConfig

# DistilBERT's config key -> BERT's
KEYS = {
    "dim": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "hidden_dim": "intermediate_size",
    "activation": "hidden_act",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "seq_classif_dropout": "classifier_dropout",
}


def read_config(d: dict[str, Any]) -> BertConfig:
    bert = {KEYS.get(k, k): v for k, v in d.items()}
    cfg = BertConfig.from_dict({**bert, "model_type": "bert", "type_vocab_size": 0, "layer_norm_eps": 1e-12})
    return replace(cfg, model_type="distilbert", pooler_act="relu")


def write_config(cfg: BertConfig) -> dict[str, Any]:
    back = {v: k for k, v in KEYS.items()}
    d = {back.get(k, k): v for k, v in cfg.to_dict().items() if k not in ("type_vocab_size", "layer_norm_eps")}
    d.update(model_type="distilbert", architectures=[DISTILBERT.hf_class])
    return d


DISTILBERT = Architecture(
    model_type="distilbert",
    hf_class="DistilBertForSequenceClassification",
    prefix="distilbert.",
    encoder=(
        ("embeddings.word_embeddings.weight", "embeddings.word.weight"),
        ("embeddings.position_embeddings.weight", "embeddings.position.weight"),
        ("embeddings.LayerNorm.{p}", "embeddings.norm.{p}"),
        ("transformer.layer.{i}.attention.q_lin.{p}", "layers.{i}.attn.query.{p}"),
        ("transformer.layer.{i}.attention.k_lin.{p}", "layers.{i}.attn.key.{p}"),
        ("transformer.layer.{i}.attention.v_lin.{p}", "layers.{i}.attn.value.{p}"),
        ("transformer.layer.{i}.attention.out_lin.{p}", "layers.{i}.attn.out.{p}"),
        ("transformer.layer.{i}.sa_layer_norm.{p}", "layers.{i}.attn_norm.{p}"),
        ("transformer.layer.{i}.ffn.lin1.{p}", "layers.{i}.up.{p}"),
        ("transformer.layer.{i}.ffn.lin2.{p}", "layers.{i}.down.{p}"),
        ("transformer.layer.{i}.output_layer_norm.{p}", "layers.{i}.ffn_norm.{p}"),
    ),
    head=(("pre_classifier.{p}", "bert.pooler.dense.{p}"), ("classifier.{p}", "classifier.{p}")),
    read_config=read_config,
    write_config=write_config,
    build=build,
    fast=True,
)
