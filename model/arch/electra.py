"""ELECTRA (ElectraForSequenceClassification): BERT's encoder under `electra.`, embeddings `embedding_size`
wide projected to the layers' width where it differs (`embeddings_project`), no pooler, and a head of
dense -> gelu -> out_proj over [CLS]. It runs on model.bert, fast path included."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.arch.bert import DENSE_HEAD, ENCODER, build
from model.arch.spec import Architecture
from model.config import BertConfig


def read_config(d: dict[str, Any]) -> BertConfig:
    cfg = BertConfig.from_dict({**d, "model_type": "bert"})
    width = int(d.get("embedding_size") or cfg.hidden_size)
    return replace(cfg, model_type="electra", embedding_size=width, pooler_act="gelu")


def write_config(cfg: BertConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    d.update(model_type="electra", architectures=[ELECTRA.hf_class], embedding_size=cfg.embedding_width)
    return d


ELECTRA = Architecture(
    model_type="electra",
    hf_class="ElectraForSequenceClassification",
    prefix="electra.",
    encoder=(*ENCODER, ("embeddings_project.{p}", "embeddings.project.{p}")),
    head=DENSE_HEAD,
    read_config=read_config,
    write_config=write_config,
    build=build,
    fast=True,
)
