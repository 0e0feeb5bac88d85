"""ModernBERT (ModernBertForSequenceClassification): config.json in either form transformers writes (the
Hub's `global_attn_every_n_layers` / `global_rope_theta` / `local_rope_theta`, or `layer_types` /
`rope_parameters`), tensors under `model.`; model.modernbert runs it, model.engines.modern_packed on the
fast CPU path."""

from __future__ import annotations

from dataclasses import asdict, fields
from typing import Any

from model.arch.spec import Architecture
from model.config import BertConfig, ConfigError
from model.modernbert import ModernBertConfig, ModernBertForRelevance

KINDS = ("full_attention", "sliding_attention")
# ModernBERT's config key -> ours, where they differ
RENAMED = {"hidden_activation": "hidden_act", "norm_eps": "layer_norm_eps", "classifier_activation": "pooler_act"}
# Defaults of ModernBertConfig in transformers that differ from BertConfig's, for configs that leave them out
HF_DEFAULTS = {
    "vocab_size": 50368,
    "intermediate_size": 1152,
    "num_hidden_layers": 22,
    "max_position_embeddings": 8192,
    "layer_norm_eps": 1e-5,
    "pad_token_id": 50283,
    "pooler_act": "gelu",
    "hidden_act": "gelu",
    "classifier_dropout": 0.0,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}


def _rope_theta(d: dict[str, Any], kind: str, old_key: str, default: float) -> float:
    params = (d.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise ConfigError(f"rope_type {params['rope_type']!r} is not supported (only 'default')")
    return float(params.get("rope_theta", d.get(old_key, default)))


def read_config(d: dict[str, Any]) -> BertConfig:
    base = {**HF_DEFAULTS, **{RENAMED.get(k, k): v for k, v in d.items()}, "model_type": "bert"}
    base["type_vocab_size"] = 0
    cfg = BertConfig.from_dict({k: v for k, v in base.items() if k != "layer_types"})
    n = cfg.num_hidden_layers
    every = int(d.get("global_attn_every_n_layers", 3))
    types = d.get("layer_types") or ["sliding_attention" if i % every else "full_attention" for i in range(n)]
    if len(types) != n or any(t not in KINDS for t in types):
        raise ConfigError(f"layer_types must name {n} layers, each one of {KINDS}")
    if d.get("classifier_pooling", "cls") not in ("cls", "mean"):
        raise ConfigError(f"classifier_pooling {d['classifier_pooling']!r} is not cls or mean")
    own = {f.name for f in fields(ModernBertConfig)} - {f.name for f in fields(BertConfig)}
    kw = {k: d[k] for k in own if k in d and k not in ("layer_types", "global_rope_theta", "local_rope_theta")}
    extra = {k: v for k, v in cfg.extra.items() if k not in own | {"rope_parameters", "global_attn_every_n_layers"}}
    base_fields = {f.name: getattr(cfg, f.name) for f in fields(BertConfig) if f.name != "pooler_act"}
    return ModernBertConfig(
        **{**base_fields, "extra": extra, "model_type": "modernbert"},
        pooler_act=str(d.get("classifier_activation", "gelu")),
        **kw,
        layer_types=tuple(types),
        global_rope_theta=_rope_theta(d, "full_attention", "global_rope_theta", 160_000.0),
        local_rope_theta=_rope_theta(d, "sliding_attention", "local_rope_theta", 10_000.0),
    )


def write_config(cfg: BertConfig) -> dict[str, Any]:
    assert isinstance(cfg, ModernBertConfig)
    back = {v: k for k, v in RENAMED.items()}
    d = {back.get(k, k): v for k, v in cfg.to_dict().items() if k not in ("type_vocab_size", "layer_types")}
    own = {f.name for f in fields(ModernBertConfig)} - {f.name for f in fields(BertConfig)}
    d.update({k: v for k, v in asdict(cfg).items() if k in own})
    d["layer_types"] = list(cfg.layer_types)
    d["rope_parameters"] = {
        "full_attention": {"rope_type": "default", "rope_theta": cfg.global_rope_theta},
        "sliding_attention": {"rope_type": "default", "rope_theta": cfg.local_rope_theta},
    }
    for k in ("global_rope_theta", "local_rope_theta", "hidden_dropout_prob", "attention_probs_dropout_prob"):
        d.pop(k, None)
    d.update(model_type="modernbert", architectures=[MODERNBERT.hf_class])
    return d


def build(cfg: BertConfig, with_pooler: bool) -> ModernBertForRelevance:
    if not isinstance(cfg, ModernBertConfig):
        raise ConfigError("a ModernBERT module needs a ModernBERT config")
    return ModernBertForRelevance(cfg, with_pooler)


MODERNBERT = Architecture(
    model_type="modernbert",
    hf_class="ModernBertForSequenceClassification",
    prefix="model.",
    encoder=(
        ("embeddings.tok_embeddings.weight", "word.weight"),
        ("embeddings.norm.{p}", "embed_norm.{p}"),
        ("layers.{i}.attn_norm.{p}", "layers.{i}.attn_norm.{p}"),
        ("layers.{i}.attn.Wqkv.{p}", "layers.{i}.qkv.{p}"),
        ("layers.{i}.attn.Wo.{p}", "layers.{i}.out.{p}"),
        ("layers.{i}.mlp_norm.{p}", "layers.{i}.mlp_norm.{p}"),
        ("layers.{i}.mlp.Wi.{p}", "layers.{i}.up.{p}"),
        ("layers.{i}.mlp.Wo.{p}", "layers.{i}.down.{p}"),
        ("final_norm.{p}", "final_norm.{p}"),
    ),
    head=(
        ("head.dense.{p}", "dense.{p}"),
        ("head.norm.{p}", "head_norm.{p}"),
        ("classifier.{p}", "classifier.{p}"),
    ),
    read_config=read_config,
    write_config=write_config,
    build=build,
    fast=True,
    ours="encoder.",
    pooler_key="dense.weight",
)
