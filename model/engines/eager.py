"""The torch engines: the reference forward on padded batches, and the packed forward on this CPU's kernels.

`torch_engine` makes the module ready once, at load: cast (or dynamically quantised for int8), turned into
its packed form where it runs on the cpu, its linear layers swapped for the fastest this CPU has and its
attention kernel chosen (`model.engines.kernels`). Nothing of that is decided again per batch.
"""

from __future__ import annotations

from dataclasses import replace
from typing import cast

import torch
from torch import Tensor, nn

from model.arch import Network
from model.bert import BertForRelevance
from model.engines.base import EngineKind, Ids, Kernels
from model.engines.kernels import choose_attention, install_cpu_kernels, set_attention, warm_linear_shapes
from model.engines.modern_packed import ModernPackedEngine, modern_engine
from model.engines.packed import PackedBertForRelevance, packed
from model.modernbert import ModernBertForRelevance
from model.packing import pad_batch, token_slices

# float32 on MKL (the fused kernels): a forward over more packed tokens than this ran slower per pair, its
# activations out of cache (AMD EPYC Zen 3: 117 pairs/s at 2,048-4,096 tokens, 99 at 8,192; docs/benchmarks.md)
FUSED_FORWARD_TOKENS = 4096
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": None}


class PaddedEngine:
    """The reference forward on right-padded batches, the last layer at [CLS] only."""

    kind = EngineKind.PADDED
    own_threads = False

    def __init__(self, module: Network, device: torch.device, pad_id: int, kernels: Kernels):
        self.module = module
        self.device, self.pad_id, self.kernels = device, pad_id, kernels
        self.torch = self

    def logits(
        self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None, on_device: bool = False
    ) -> Tensor:
        ids, seg, mask = pad_batch(input_ids, token_type_ids, self.pad_id)
        dev = self.device
        logits, _ = self.module(ids.to(dev), seg.to(dev), mask.to(dev), head_mask, cls_only=True)
        return logits.float() if on_device else logits.float().cpu()

    def use_attention(self, kind: str) -> None:
        """The packed forward's attention kernel, where the module has one (A/Bs)."""
        attention = set_attention(self.module, kind)
        self.kernels = replace(self.kernels, attention=attention, attention_reason="set by use_attention")

    def warm_up(self, max_batch_tokens: int) -> None:
        """Nothing to build ahead: torch's padded kernels are not built per shape."""


class PackedEngine(PaddedEngine):
    """Batches without padding (`model.packing`) through the packed forward (cpu only)."""

    kind = EngineKind.PACKED

    def __init__(self, module: PackedBertForRelevance, device: torch.device, pad_id: int, kernels: Kernels):
        super().__init__(module, device, pad_id, kernels)
        self.packed = module

    def logits(
        self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None, on_device: bool = False
    ) -> Tensor:
        fused = self.kernels.cpu_kernels == "fused"
        parts = token_slices([len(x) for x in input_ids], FUSED_FORWARD_TOKENS) if fused else [slice(None)]
        return torch.cat(
            [self.packed.forward_packed(input_ids[s], token_type_ids[s], head_mask).float().cpu() for s in parts]
        )

    def warm_up(self, max_batch_tokens: int) -> None:
        """Every linear layer at every packed token count up to `max_batch_tokens`: oneDNN builds a kernel per
        shape (MKL's sgemm behind the fused plain layers does not)."""
        if self.kernels.cpu_kernels == "onednn-packed":
            warm_linear_shapes(self.packed, max_batch_tokens)


def torch_engine(
    module: Network,
    device: torch.device,
    dtype: str,
    pad_id: int,
    onednn: bool = False,
    unpadded: bool = False,
    attention: str = "auto",
) -> PaddedEngine | ModernPackedEngine:
    """The torch engine for `module` (consumed: its layers may be swapped) on `device` in `dtype` (a key of
    DTYPES): packed where `unpadded` and on the cpu, else padded; with `onednn` on the cpu, the linear layers
    this CPU runs fastest and the attention kernel `attention` asks for (`model.engines.kernels.choose_attention`)."""
    module = module.eval()
    cpu = device.type == "cpu"
    fast = cpu and (onednn or unpadded)
    if fast and isinstance(module, BertForRelevance):  # the packed classes: where the kernels are swapped in
        module = packed(module)
    torch_dtype = DTYPES[dtype]  # None for int8
    if torch_dtype is None:
        module = cast(BertForRelevance, torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8))
    else:
        module = module.to(device, torch_dtype)
    kernels = Kernels()
    if isinstance(module, ModernBertForRelevance):  # its own packed engine (model.engines.modern_packed)
        if unpadded and cpu and torch_dtype is not None:
            return modern_engine(module, device, torch_dtype, pad_id, onednn, attention)
        return PaddedEngine(module, device, pad_id, kernels)
    if onednn and torch_dtype is not None and cpu and isinstance(module, PackedBertForRelevance):
        cpu_kernels = install_cpu_kernels(module, torch_dtype)
        kernels = Kernels(cpu_kernels, *choose_attention(module, torch_dtype, attention))
    if unpadded and cpu and isinstance(module, PackedBertForRelevance):
        return PackedEngine(module, device, pad_id, kernels)
    return PaddedEngine(module, device, pad_id, kernels)
