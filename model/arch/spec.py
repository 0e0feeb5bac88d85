"""What qtrel knows of one architecture: how its Hugging Face checkpoints name their tensors and configs,
which module runs it, and whether the fast CPU path (packed rows, oneDNN linears, fused kernels) covers it.
Chosen once, at load, from config.json's `model_type` (model.arch.architecture)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from model.config import BertConfig

Templates = tuple[tuple[str, str], ...]  # (Hugging Face key, our key); {i} a layer index, {p} weight or bias


def _pattern(template: str) -> re.Pattern[str]:
    rx = re.escape(template).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
    return re.compile(f"^{rx}$")


@dataclass(frozen=True)
class Architecture:
    model_type: str  # config.json's model_type
    hf_class: str  # the transformers sequence-classification class whose checkpoints it loads and writes
    prefix: str  # the encoder's key prefix in that class ("bert.", "roberta.", ...); optional on load
    encoder: Templates  # the encoder's tensors, under `prefix` on their side and `ours` on ours
    head: Templates  # the head's tensors (no prefix on either side)
    read_config: Callable[[dict[str, Any]], BertConfig]  # config.json -> our config (ConfigError when unusable)
    write_config: Callable[[BertConfig], dict[str, Any]]  # and back, for save
    build: Callable[[BertConfig, bool], nn.Module]  # (config, with a pooler / head dense layer) -> the module
    fast: bool  # the packed / oneDNN / fused-kernel CPU path covers it
    ours: str = "bert."  # our encoder's key prefix
    pooler_key: str = "bert.pooler.dense.weight"  # our key whose presence means the head has a dense layer
    aliases: tuple[str, ...] = ()  # other model_types read the same way (roberta for xlm-roberta)
    _tables: dict[str, list[tuple[re.Pattern[str], str]]] = field(default_factory=dict, compare=False, repr=False)

    def _table(self, direction: str) -> list[tuple[re.Pattern[str], str]]:
        if direction not in self._tables:
            enc = [(self.prefix + a, self.ours + b) for a, b in self.encoder]
            pairs = [*enc, *self.head] if direction == "in" else [*self.head, *enc]  # a head's name wins on save
            self._tables[direction] = [(_pattern(a), b) if direction == "in" else (_pattern(b), a) for a, b in pairs]
        return self._tables[direction]

    def to_ours(self, key: str) -> str | None:
        """Our name of a checkpoint's tensor (the encoder prefix optional), or None for one we do not know."""
        for k in dict.fromkeys((key, self.prefix + key)):
            for rx, target in self._table("in"):
                m = rx.match(k)
                if m:
                    return target.format(**m.groupdict())
        return None

    def to_hf(self, key: str) -> str | None:
        """The checkpoint's name of one of our tensors, or None."""
        for rx, target in self._table("out"):
            m = rx.match(key)
            if m:
                return target.format(**m.groupdict())
        return None
