"""XLM-RoBERTa (XLMRobertaForSequenceClassification; RoBERTa too): BERT's encoder under `roberta.`, positions
that start after the padding index (position i of a pair is row pad_token_id + 1 + i: the fairseq
convention), one segment, and a head of dense -> tanh -> out_proj over <s>, which is BERT's pooler and
classifier under other names. It runs on model.bert, fast path included."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from model.arch.bert import DENSE_HEAD, ENCODER, build
from model.arch.spec import Architecture
from model.config import BertConfig


def read_config(d: dict[str, Any]) -> BertConfig:
    cfg = BertConfig.from_dict({**d, "model_type": "bert"})
    return replace(cfg, model_type=str(d["model_type"]), position_offset=cfg.pad_token_id + 1, pooler_act="tanh")


def write_config(cfg: BertConfig) -> dict[str, Any]:
    d = cfg.to_dict()
    d["model_type"] = cfg.model_type
    d["architectures"] = [XLMR.hf_class if cfg.model_type == "xlm-roberta" else "RobertaForSequenceClassification"]
    return d


XLMR = Architecture(
    model_type="xlm-roberta",
    hf_class="XLMRobertaForSequenceClassification",
    prefix="roberta.",
    # the base model's pooler (XLMRobertaModel keeps one) is a tanh layer over <s>, as the head's dense layer
    encoder=(*ENCODER, ("pooler.dense.{p}", "pooler.dense.{p}")),
    head=DENSE_HEAD,
    read_config=read_config,
    write_config=write_config,
    build=build,
    fast=True,
    aliases=("roberta",),
)
