"""`qtrel quantize`: a static int8 plan for the OpenVINO engine, calibrated and selected on training pairs
(the plan's format and its calibration: model.engines.int8)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor

from model.bert import BertForRelevance
from model.checkpoint import load_module
from model.device import resolve_dtype
from model.engines.int8 import Int8Plan, LinearPlan, apply, calibrate, encoder_linears, linear_named, select
from model.engines.openvino import OpenVINOForward
from model.packing import pad_batch
from model.relevance import RelevanceModel


def linear_flops_share(module: BertForRelevance, names: Sequence[str]) -> float:
    """The share of the encoder's linear multiply-adds (per token) that the named linears do."""
    size = {n: linear_named(module, n).weight.numel() for n in encoder_linears(module)}
    return sum(size[n] for n in names) / sum(size.values())


def stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())


def quantize(
    model_dir: str | Path,
    pairs: Sequence[tuple[str, str]],
    target: float = 0.99,
    calibration: int = 512,
    threads: int | None = None,
) -> Int8Plan:
    """Calibrate on the first `calibration` pairs, select on the rest (held out from calibration), and
    write the plan into `model_dir`. Needs OpenVINO: the agreement is measured on its int8 kernels, in the
    float precision this machine runs natively for the layers that stay float."""
    if len(pairs) < calibration + 100:
        raise ValueError(f"need at least {calibration + 100} pairs ({calibration} to calibrate, 100+ to select)")
    threads = threads or torch.get_num_threads()
    ref = RelevanceModel.load(model_dir, dtype="float32")
    precision = resolve_dtype("auto", torch.device("cpu"))
    precision = precision if precision in ("float32", "bfloat16") else "float32"
    fp32 = load_module(model_dir).eval()
    enc = ref.encode(list(pairs[:calibration]))
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    batches = [
        pad_batch([enc.input_ids[i] for i in c], [enc.token_type_ids[i] for i in c], ref.tokenizer.pad_id)
        for c in (order[k : k + 32] for k in range(0, len(order), 32))
    ]
    candidates = calibrate(fp32, batches)
    held = ref.encode(list(pairs[calibration:]))
    want = ref.score(ref.encoded_logits(held)).level

    def levels_with(linears: dict[str, LinearPlan]) -> Tensor:
        ov = OpenVINOForward(apply(fp32, Int8Plan(linears)), precision, threads, ref.tokenizer.pad_id)
        return ref.score(ov.logits(held.input_ids, held.token_type_ids)).level

    chosen, measured = select(candidates, levels_with, want, target)
    about = {
        "made": stamp(),
        "pairs": {"calibration": calibration, "selection": len(held)},
        "target_agreement": target,
        "float_precision": precision,
        "linears": f"{len(chosen)} of {len(candidates)}",
        "linear_flops_share": round(linear_flops_share(fp32, list(chosen)), 4),
        **measured,
    }
    plan = Int8Plan(chosen, about)
    plan.save(model_dir)
    return plan
