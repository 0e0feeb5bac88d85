"""Whole passes over the same batches, one per system, each returning the (n, levels) logits in batch
order: qtrel's forwards (padded, unpacked, on its own batches, on its forward workers), transformers,
ONNX Runtime, OpenVINO with each performance hint; and the matmul probe that runs beside them."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from harness.data import Batch
from harness.systems import openvino_compiled, ort_session
from model.config import BertConfig
from model.levels import MAX_BATCH_TOKENS
from model.onednn import OneDNNLinear
from model.parallel import run_batches
from model.relevance import RelevanceModel

PROBE_ROWS = 1024  # tokens per probe matmul: about one batch of 32 dev pairs (~26 tokens each)


Pass = Callable[[], torch.Tensor]


def qtrel_batches(m: RelevanceModel, lists: list[tuple[list, list]], batches: list[Batch], padded: bool) -> Pass:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            if padded:
                return torch.cat([m.module(b.ids, b.seg, b.mask, cls_only=True)[0].float() for b in batches])
            return torch.cat([m.logits(ids, seg) for ids, seg in lists])

    return run


def qtrel_workers(m: RelevanceModel, lists: list[tuple[list, list]]) -> Pass:
    """The batches of 32 shared out over qtrel's forward workers (model.parallel), as encoded_logits does."""

    def run() -> torch.Tensor:
        return torch.cat(run_batches(m.forward_workers(), lambda b: m.logits(*b), lists))

    return run


def qtrel_own(m: RelevanceModel, enc, order: list[int]) -> Pass:
    def run() -> torch.Tensor:
        return m.encoded_logits(enc, MAX_BATCH_TOKENS)[order]

    return run


def hf_pass(hf, batches: list[Batch]) -> Pass:
    def run() -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat(
                [hf(input_ids=b.ids, attention_mask=b.mask, token_type_ids=b.seg).logits.float() for b in batches]
            )

    return run


def ort_pass(path: Path, threads: int, batches: list[Batch]) -> Pass:
    sess, names = ort_session(path, threads)
    feeds = [{k: v for k, v in b.feeds().items() if k in names} for b in batches]

    def run() -> torch.Tensor:
        return torch.from_numpy(np.concatenate([sess.run(None, f)[0] for f in feeds]))

    return run


def openvino_passes(
    onnx_path: Path, threads: int, precision: str, batches: list[Batch]
) -> tuple[Pass, Pass, dict[str, Any]]:
    import openvino as ov

    lat, version = openvino_compiled(onnx_path, threads, precision, "LATENCY")
    thr, _ = openvino_compiled(onnx_path, threads, precision, "THROUGHPUT")
    feeds = [b.feeds() for b in batches]
    lat_req = lat.create_infer_request()
    n_req = thr.get_property("OPTIMAL_NUMBER_OF_INFER_REQUESTS")
    queue = ov.AsyncInferQueue(thr, n_req)
    outs: list[np.ndarray | None] = [None] * len(batches)

    def done(req, i):
        outs[i] = req.get_output_tensor(0).data.copy()

    queue.set_callback(done)

    def latency() -> torch.Tensor:
        return torch.from_numpy(np.concatenate([lat_req.infer(f)[0].copy() for f in feeds]))

    def throughput() -> torch.Tensor:
        for i, f in enumerate(feeds):
            queue.start_async(f, userdata=i)
        queue.wait_all()
        return torch.from_numpy(np.concatenate([o for o in outs if o is not None]))

    info = {
        "version": version,
        "latency": {
            k: str(lat.get_property(k)) for k in ("NUM_STREAMS", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT")
        },
        "throughput": {
            k: str(thr.get_property(k)) for k in ("NUM_STREAMS", "INFERENCE_NUM_THREADS", "INFERENCE_PRECISION_HINT")
        }
        | {"infer_requests": n_req},
    }
    return latency, throughput, info


def probe_pass(cfg: BertConfig, dtype: torch.dtype, seconds: float) -> Callable[[], float]:
    """GFLOP/s of a bare FFN (up and down linear, no activation) on PROBE_ROWS tokens: the best of
    torch's F.linear and a pre-packed oneDNN linear, median over the iterations of a short window."""
    H, inner = cfg.hidden_size, cfg.intermediate_size
    g = torch.Generator().manual_seed(0)
    x = torch.randn(PROBE_ROWS, H, generator=g).to(dtype)
    w1, w2 = (
        (torch.randn(inner, H, generator=g) * 0.05).to(dtype),
        (torch.randn(H, inner, generator=g) * 0.05).to(dtype),
    )
    b1, b2 = torch.zeros(inner, dtype=dtype), torch.zeros(H, dtype=dtype)
    up, down = OneDNNLinear(w1, b1), OneDNNLinear(w2, b2)
    kinds = {"F.linear": lambda: F.linear(F.linear(x, w1, b1), w2, b2), "oneDNN": lambda: down(up(x))}
    flops = 2 * 2 * PROBE_ROWS * H * inner

    def run() -> float:
        best = 0.0
        with torch.inference_mode():
            for fn in kinds.values():
                fn()
                times: list[float] = []
                t_end = time.perf_counter() + seconds / len(kinds)
                while time.perf_counter() < t_end or len(times) < 5:
                    t0 = time.perf_counter()
                    fn()
                    times.append(time.perf_counter() - t0)
                best = max(best, flops / statistics.median(times) / 1e9)
        return best

    return run
