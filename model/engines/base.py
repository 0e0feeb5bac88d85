"""What every engine offers `RelevanceModel`, and the names of the engines."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Protocol

import torch
from torch import Tensor

from model.arch import Network

Ids = Sequence[Sequence[int]]  # a batch of encoded pairs' token (or segment) ids


class EngineKind(str, Enum):
    """Which engine runs the forward pass."""

    PADDED = "padded"  # the reference forward on right-padded batches (cuda, or asked for)
    PACKED = "packed"  # batches without padding on this CPU's kernels (model.engines.packed)
    OPENVINO = "openvino"  # the checkpoint compiled by OpenVINO, torch answering what it cannot


@dataclass(frozen=True)
class Kernels:
    """What the torch engines run on the CPU, as `RelevanceModel.describe()` reports it."""

    cpu_kernels: str = "plain"  # or onednn-packed, fused, plain (probe failed: ...)
    attention: str = "sdpa"  # the packed forward's attention kernel (model.engines.kernels.choose_attention)
    attention_probe: dict[str, float] | None = None  # its start-up timings, where it ran
    attention_reason: str = "RelevanceModel's default"
    fused_norm: bool = False  # the packed forward's residual add + LayerNorm in one pass


class Engine(Protocol):
    kind: EngineKind
    own_threads: bool  # runs on threads of its own, not torch's (no forward workers)

    @property
    def torch(self) -> TorchForward:
        """The torch engine behind this one (itself for a torch engine): head masks and explanations run there."""
        ...

    def logits(
        self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None, on_device: bool = False
    ) -> Tensor:
        """(B, classes) float32 logits in input order, on cpu (`on_device`: left on the model's device)."""
        ...

    def warm_up(self, max_batch_tokens: int) -> None:
        """Build what the first request would otherwise build (kernels per shape)."""
        ...


class TorchForward(Engine, Protocol):
    """A torch engine: the module it runs and its kernels. Head masks and explanations always run on one."""

    module: Network  # BERT-shaped where the fast path runs (model.arch)
    kernels: Kernels
    device: torch.device

    def use_attention(self, kind: str) -> None:
        """Set the packed forward's attention kernel, "sdpa", "math" or "fused" (A/Bs)."""
        ...
