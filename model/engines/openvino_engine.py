"""The OpenVINO engine, and the choice of it (`inference` auto, torch or openvino) in a model process.

OpenVINO answers the batches it takes; the torch engine it wraps answers head masks, batches OpenVINO
refuses, and any batch it fails on (logged once). `choose` decides once, after the model process has forked
(compiling starts OpenVINO's thread pools), and says why.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.checkpoint import load_module
from model.engines.base import Engine, EngineKind, Ids, TorchForward
from model.int8 import NO_VNNI, PLAN_FILE, Int8Plan, cpu_has_vnni
from model.tokenizer import PairTokenizer

if TYPE_CHECKING:  # imported where OpenVINO is asked for: the torch path never loads it
    from model.openvino_inference import OpenVINOForward

log = logging.getLogger("qtrel.model")


class OpenVINOEngine:
    kind = EngineKind.OPENVINO
    own_threads = True  # OpenVINO's pool: torch's forward workers would only compete with it

    def __init__(self, forward: OpenVINOForward, fallback: TorchForward):
        self.forward, self.torch = forward, fallback
        self._failed = False  # logged once

    def logits(
        self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None, on_device: bool = False
    ) -> Tensor:
        if head_mask is None and self.forward.runs(input_ids, token_type_ids):
            try:
                return self.forward.logits(input_ids, token_type_ids)
            except Exception as e:  # this batch on torch; the model process lives on
                if not self._failed:
                    self._failed = True
                    log.warning(
                        "OpenVINO failed on a batch, torch answered it (logged once): %s: %s", type(e).__name__, e
                    )
        return self.torch.logits(input_ids, token_type_ids, head_mask, on_device)

    def warm_up(self, max_batch_tokens: int) -> None:
        """Nothing: OpenVINO compiled its kernels at load, and only head masks run torch."""


@dataclass(frozen=True)
class Inference:
    """What runs the forward pass, as `describe()` reports it."""

    name: str = "torch"
    reason: str = "RelevanceModel's default"
    probe: dict[str, float] | None = None


def choose(
    engine: TorchForward, choice: str, source: Path | None, dtype: str, tokenizer: PairTokenizer, vocab: int
) -> tuple[Engine, Inference]:
    """The engine for `choice` ("torch", "openvino" or "auto", see `RelevanceModel.use_inference`) over the torch
    `engine`, and why. `source`: the checkpoint directory to convert from; `vocab`: the ids the probe may use."""
    from model import openvino_inference as ovi

    if choice not in ovi.CHOICES:
        raise ValueError(f"inference must be one of {list(ovi.CHOICES)}, got {choice!r}")
    if choice == "torch":
        return engine, Inference("torch", f"inference={choice}")
    device = engine.device
    why = ovi.missing()
    if why is None and device.type != "cpu":
        why = f"OpenVINO serves the cpu here, not {device}"
    if why is None and source is None:
        why = "no checkpoint directory to convert from"
    if why is None and (kind := engine.module.cfg.model_type) != "bert":
        why = f"its conversion serves BERT checkpoints, not {kind}"
    plan = None
    if why is None and dtype == "int8":
        try:
            assert source is not None
            plan = Int8Plan.load(source)
        except ValueError as e:
            why = str(e)
        if why is None and plan is None:
            why = f"int8 on OpenVINO needs the checkpoint's {PLAN_FILE} (qtrel quantize): dynamic int8"
    elif why is None and dtype not in ovi.PRECISION_HINTS:
        why = f"OpenVINO takes float32, bfloat16 or a static int8 plan, not {dtype}"
    forward = None
    if why is None:
        try:
            assert source is not None
            fp32 = load_module(source)  # the float32 weights: the torch engine's are cast and repacked
            precision = dtype if plan is None else plan.about.get("float_precision", "float32")
            forward = ovi.OpenVINOForward(fp32, precision, torch.get_num_threads(), tokenizer.pad_id, plan=plan)
            del fp32
        except Exception as e:  # conversion or compilation: torch serves
            why = f"conversion failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
    if why is not None or forward is None:
        (log.warning if choice == "openvino" or dtype == "int8" else log.info)(
            "inference=%s runs torch: %s", choice, why
        )
        return engine, Inference("torch", f"torch: {why}")
    if plan is not None:  # no probe: torch's int8 is dynamic and moves the grade (docs/benchmarks.md)
        reason = f"inference={choice}, int8: {len(plan.linears)} linears static int8 ({PLAN_FILE})"
        if not cpu_has_vnni():
            reason += f"; {NO_VNNI}"
            log.warning("dtype=int8: %s", NO_VNNI)
        return OpenVINOEngine(forward, engine), Inference("openvino", reason)
    if choice == "openvino":
        return OpenVINOEngine(forward, engine), Inference("openvino", "inference=openvino")
    batches = ovi.probe_batches(tokenizer.max_length, vocab, tokenizer.cls_id, tokenizer.sep_id)
    with torch.inference_mode():
        result = ovi.probe(engine.logits, forward.logits, batches)
    log.info("inference=auto chose %s: %s", result.winner, result.summary())
    inference = Inference(result.winner, f"auto: {result.summary()}", result.figures())
    if result.winner == "torch":
        return engine, inference  # OpenVINO not kept: its weights are a second copy
    return OpenVINOEngine(forward, engine), inference
