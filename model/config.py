"""BERT configuration: the subset of a Hugging Face `config.json` that the encoder needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

SUPPORTED_MODEL_TYPES = ("bert",)
SUPPORTED_ACTIVATIONS = ("gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
POOLER_ACTIVATIONS = ("tanh", "gelu", "relu")


# BertConfig's fields that model.arch sets for the BERT-shaped architectures; not BERT's config.json keys
VARIANT_FIELDS = ("model_type", "embedding_size", "position_offset", "pooler_act")


class ConfigError(ValueError):
    """A config.json that this encoder cannot run."""


class CheckpointError(ValueError):
    """A directory or weight file that is not a usable checkpoint; the message says what is wrong. Here, not
    in model.checkpoint, so that catching it loads no torch."""


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int = 30522  # rows of the word-embedding table; must match the tokenizer's vocab
    hidden_size: int = 768  # width of every token vector
    num_hidden_layers: int = 12  # post-norm transformer layers
    num_attention_heads: int = 12  # heads per layer before pruning; head size = hidden / heads
    intermediate_size: int = 3072  # feed-forward inner width
    hidden_act: str = "gelu"  # feed-forward activation
    max_position_embeddings: int = 512  # learned positions: hard upper bound on sequence length
    type_vocab_size: int = 2  # segment ids: 0 = query, 1 = title; 1: every token is segment 0; 0: no table
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1  # training only
    attention_probs_dropout_prob: float = 0.1  # training only
    classifier_dropout: float | None = None  # None: use hidden_dropout_prob
    # The head's classes, in order; class k grades level id2label[k]. The first classes are the levels, each
    # once; a class after them that repeats a level's label is an extra class merged into that level
    # (the "not a candidate" class, trained on sampled negatives, grades level 1: model.scoring.merge_classes).
    id2label: dict[int, str] = field(default_factory=lambda: {i: str(i + 1) for i in range(5)})
    # Heads removed per layer, Hugging Face `pruned_heads` form: {layer: [original head indices]}.
    pruned_heads: dict[int, list[int]] = field(default_factory=dict)
    # The architecture (model.arch) and where its BERT-shaped encoder differs from BERT's
    model_type: str = "bert"  # bert, xlm-roberta, electra, distilbert (model.arch.ARCHITECTURES)
    embedding_size: int | None = None  # ELECTRA: embeddings this wide, projected to hidden_size; None: hidden_size
    position_offset: int = 0  # XLM-R: position i is row pad_token_id + 1 + i of the table
    pooler_act: str = "tanh"  # the head's dense layer over [CLS]: tanh (BERT's pooler, XLM-R), gelu, relu
    # Keys of the original config.json we do not use; written back unchanged on save.
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (choose from {SUPPORTED_ACTIVATIONS})")
        if self.pooler_act not in POOLER_ACTIVATIONS:
            raise ConfigError(f"pooler_act {self.pooler_act!r} is not one of {POOLER_ACTIVATIONS}")
        if not self.id2label:
            raise ConfigError("id2label is empty: the head needs at least one level")
        n = len(self.levels)
        if self.labels[:n] != self.levels:
            raise ConfigError(f"id2label {self.labels}: the levels come first, each once; extra classes after them")
        for layer, heads in self.pruned_heads.items():
            if not 0 <= layer < self.num_hidden_layers:
                raise ConfigError(f"pruned_heads names layer {layer}, model has {self.num_hidden_layers}")
            if len(set(heads)) >= self.num_attention_heads:
                raise ConfigError(f"pruned_heads removes every head of layer {layer}")

    @property
    def embedding_width(self) -> int:
        return self.embedding_size or self.hidden_size

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def num_labels(self) -> int:
        return len(self.id2label)

    @property
    def labels(self) -> list[str]:
        """Each class's level, in class order (an extra class repeats its level's label)."""
        return [self.id2label[i] for i in range(self.num_labels)]

    @property
    def levels(self) -> list[str]:
        """The levels a score grades: the distinct labels, in class order."""
        return list(dict.fromkeys(self.labels))

    @property
    def negative_class(self) -> int:
        """The class sampled negatives train: the extra class of the lowest level ("not a candidate",
        `qtrel train --not-candidate 1`) where the head has one, else the lowest level's class, 0."""
        lowest = self.labels[0]
        return next((c for c in range(len(self.levels), self.num_labels) if self.labels[c] == lowest), 0)

    @property
    def class_levels(self) -> list[int]:
        """Each class's level index (identity without extra classes)."""
        index = {lab: i for i, lab in enumerate(self.levels)}
        return [index[lab] for lab in self.labels]

    def heads_in_layer(self, layer: int) -> list[int]:
        """Original indices of the heads still present in `layer`."""
        gone = set(self.pruned_heads.get(layer, []))
        return [h for h in range(self.num_attention_heads) if h not in gone]

    def with_labels(self, labels: list[str]) -> BertConfig:
        return replace(self, id2label={i: str(lab) for i, lab in enumerate(labels)})

    # --- Hugging Face config.json ---------------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BertConfig:
        model_type = d.get("model_type", "bert")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                f"model_type {model_type!r} is not supported; qtrel runs BERT-family encoders "
                f"({', '.join(SUPPORTED_MODEL_TYPES)})"
            )
        pos_type = d.get("position_embedding_type", "absolute")
        if pos_type != "absolute":
            raise ConfigError(f"position_embedding_type {pos_type!r} is not supported (only 'absolute')")
        known = {f for f in cls.__dataclass_fields__ if f != "extra"}
        kwargs: dict[str, Any] = {k: d[k] for k in known if k in d}
        if "id2label" in d:
            kwargs["id2label"] = {int(k): str(v) for k, v in d["id2label"].items()}
            if sorted(kwargs["id2label"]) != list(range(len(kwargs["id2label"]))):
                raise ConfigError(f"id2label keys must be 0..n-1, got {sorted(kwargs['id2label'])}")
        elif "num_labels" in d:
            kwargs["id2label"] = {i: str(i + 1) for i in range(int(d["num_labels"]))}
        if "pruned_heads" in d:
            kwargs["pruned_heads"] = {int(k): sorted(int(h) for h in v) for k, v in d["pruned_heads"].items()}
        for k in VARIANT_FIELDS:  # set by model.arch from each architecture's own config keys, not read here
            kwargs.pop(k, None)
        skip = known | {"label2id", "num_labels", "model_type"}
        kwargs["extra"] = {k: v for k, v in d.items() if k not in skip}
        try:
            return cls(**kwargs)
        except TypeError as e:  # a field of the wrong type
            raise ConfigError(f"invalid config: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> BertConfig:
        try:
            d = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"cannot read {path}: {e}") from e
        if not isinstance(d, dict):
            raise ConfigError(f"{path} is not a JSON object")
        return cls.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.extra)
        skip = ("extra", "id2label", "pruned_heads", *VARIANT_FIELDS)
        d.update({k: v for k, v in asdict(self).items() if k not in skip})
        d["model_type"] = "bert"
        d["architectures"] = ["BertForSequenceClassification"]
        d["id2label"] = {str(k): v for k, v in self.id2label.items()}
        d["label2id"] = {lab: i for i, lab in reversed(self.id2label.items())}  # a level's first class
        d["pruned_heads"] = {str(k): v for k, v in self.pruned_heads.items()}
        return d
