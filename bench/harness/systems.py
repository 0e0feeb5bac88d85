"""The offline anchor systems, built the same way by every benchmark that runs them: transformers, its
ONNX export, ONNX Runtime and OpenVINO on that export. Each may be absent (the `bench` extra); a builder
then raises ImportError and the benchmark notes the system as not measured."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import torch

from harness.data import Batch


def hf_model(path: Path, attn: str) -> Any:
    """The checkpoint as transformers' BertForSequenceClassification, float32, eval mode."""
    from transformers import BertForSequenceClassification
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    return BertForSequenceClassification.from_pretrained(str(path), attn_implementation=attn).float().eval()


def export_onnx(hf: Any, sample: Batch, out: Path, dynamo: bool) -> Path:
    names = ["input_ids", "attention_mask", "token_type_ids"]
    axes = {k: {0: "batch", 1: "seq"} for k in names} | {"logits": {0: "batch"}}
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        kw: dict[str, Any] = {"verbose": False} if dynamo else {"opset_version": 17}
        torch.onnx.export(
            hf,
            (sample.ids, sample.mask, sample.seg),
            str(out),
            input_names=names,
            output_names=["logits"],
            dynamic_axes=axes,
            dynamo=dynamo,
            **kw,
        )
    return out


def ort_session(path: Path | bytes, threads: int) -> tuple[Any, list[str]]:
    """An ONNX Runtime CPU session with `threads` intra-op threads, and its input names."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads, so.inter_op_num_threads = threads, 1
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    src = path if isinstance(path, bytes) else str(path)
    sess = ort.InferenceSession(src, so, providers=["CPUExecutionProvider"])
    return sess, [i.name for i in sess.get_inputs()]


def ort_fused_graph(path: Path, cfg: Any, sample: Batch, work: Path) -> tuple[Path, dict[str, int]]:
    """The eager export run through ONNX Runtime's BERT optimiser (fused Attention, SkipLayerNorm, BiasGelu):
    the strongest ORT set-up we know. The graph written, and its fused operators."""
    from onnxruntime.transformers.optimizer import optimize_model

    raw = export_onnx(hf_model(path, "eager"), sample, work / "model-eager.onnx", dynamo=False)
    opt = optimize_model(str(raw), model_type="bert", num_heads=cfg.num_attention_heads, hidden_size=cfg.hidden_size)
    out = work / "model-fused.onnx"
    opt.save_model_to_file(str(out))
    return out, {k: v for k, v in opt.get_fused_operator_statistics().items() if v}


def openvino_compiled(onnx: Path, threads: int, precision: str, hint: str = "LATENCY") -> tuple[Any, str]:
    """The ONNX graph compiled by OpenVINO for the CPU with a performance hint, in `precision`; and
    OpenVINO's version."""
    import openvino as ov

    core = ov.Core()
    cfg = {
        "PERFORMANCE_HINT": hint,
        "INFERENCE_PRECISION_HINT": {"bfloat16": "bf16", "float32": "f32"}[precision],
        "INFERENCE_NUM_THREADS": threads,
    }
    return core.compile_model(core.read_model(str(onnx)), "CPU", cfg), ov.__version__
