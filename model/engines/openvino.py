"""The OpenVINO engine: the checkpoint compiled by OpenVINO, the probe that decides whether it serves, and the
choice (`inference` auto, torch or openvino) made once in a model process.

On some CPUs OpenVINO's compiled BERT beats the torch path (oneDNN-packed linears, unpadded batches):
issue 20 measured torch at 0.79x OpenVINO bf16 on a Zen 4 (docs/benchmarks.md). The torch path stays:
head masks and explanations need it, and it takes any batch OpenVINO refuses.

The float32 checkpoint's padded forward `module(ids, segments, mask)` is exported to ONNX in memory
(dynamic batch and sequence axes), read by OpenVINO's runtime and compiled for the CPU in the model's
precision, with the LATENCY hint and torch's thread count. Not `ov.convert_model`: it sends usage
telemetry to Google Analytics unless a consent file in $HOME says no, and a model process must not call
out. Compiling starts OpenVINO's thread pools, so a process that forks (the model template) must never
build an `OpenVINOForward`; a model process builds its own after the fork. `openvino` is an optional
dependency (`pip install 'qtrel[openvino]'`, with `onnx` for torch's exporter): `missing()` says why it
cannot be used, and everything else works without it.
"""

from __future__ import annotations

import importlib
import io
import logging
import random
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from model.bert import BertForRelevance
from model.checkpoint import load_module
from model.engines import int8
from model.engines.base import Engine, EngineKind, Ids, TorchForward
from model.engines.int8 import NO_VNNI, PLAN_FILE, Int8Plan, cpu_has_vnni
from model.packing import pad_batch
from model.tokenizer import PairTokenizer

log = logging.getLogger("qtrel.model")

CHOICES = ("auto", "torch", "openvino")  # what runs the forward pass: the `inference` setting
PRECISION_HINTS = {"float32": "f32", "bfloat16": "bf16"}  # the model's dtypes OpenVINO can take
# OpenVINO serves only when the probe finds it this much faster: it costs ~0.2 GB and ~6 s of start-up per model
# process, and on a machine where the two are within noise (Zen 4: 0.95-1.00x, docs/benchmarks.md) a coin flip
# between them buys nothing.
MARGIN = 1.1
FILL = 0.8  # a pair joins a group whose longest pair it fills to this share at least (padding <= 20%)


def missing() -> str | None:
    """Why OpenVINO cannot be used here (it or `onnx` not installed, or failing to import), or None."""
    for name in ("openvino", "onnx"):
        try:
            importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install raising anything while loading its libraries
            return f"{name} not importable ({type(e).__name__}: {(str(e).splitlines() or [''])[0][:160]})"
    return None


class _Padded(nn.Module):
    """The padded forward with logits only, the last layer at [CLS] only: what is exported."""

    def __init__(self, module: BertForRelevance):
        super().__init__()
        self.module = module

    def forward(self, input_ids: Tensor, token_type_ids: Tensor, attention_mask: Tensor) -> Tensor:
        return self.module(input_ids, token_type_ids, attention_mask, cls_only=True)[0]


class OpenVINOForward:
    """A float32 `BertForRelevance` compiled by OpenVINO for the CPU; one caller at a time (one infer request).

    `precision`: the model's dtype ("float32" or "bfloat16", the inference precision hint); `threads`: as
    torch's intra-op threads. CPU pinning is off: several single-thread model processes share the cores, and
    pinned they could all land on the same one."""

    def __init__(
        self, module: BertForRelevance, precision: str, threads: int, pad_id: int = 0, plan: Int8Plan | None = None
    ):
        """`plan`: the linears to run in static int8 (model.engines.int8); the rest runs in `precision`."""
        import openvino as ov

        if precision not in PRECISION_HINTS:
            raise ValueError(f"OpenVINO runs float32 or bfloat16, not {precision}")
        if next(module.parameters()).dtype != torch.float32:
            raise ValueError("convert the float32 module (OpenVINO lowers the precision itself)")
        if plan is not None:
            module = int8.apply(module, plan)  # QuantizeLinear / DequantizeLinear pairs: OpenVINO's int8 matmuls
        self.int8_linears = 0 if plan is None else len(plan.linears)
        self.pad_id = pad_id
        self.max_positions = module.cfg.max_position_embeddings
        self.vocab, self.segments = module.cfg.vocab_size, module.cfg.type_vocab_size
        ids = torch.tensor([[101, 2000, 102], [101, 2001, 102]])
        example = (ids, torch.zeros_like(ids), torch.ones_like(ids))
        names = ["input_ids", "token_type_ids", "attention_mask"]
        onnx = io.BytesIO()
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")  # tracer warnings about Python values in the graph
            torch.onnx.export(
                _Padded(module.eval()),
                example,
                onnx,  # type: ignore[arg-type]  # the TorchScript exporter takes a file object: no disk
                input_names=names,
                output_names=["logits"],
                dynamic_axes={k: {0: "batch", 1: "seq"} for k in names} | {"logits": {0: "batch"}},
                opset_version=17,
                dynamo=False,  # the TorchScript exporter: no onnxscript, and the graph bench/anchors.py times
            )
        graph = ov.Core().read_model(onnx.getvalue(), b"")
        del onnx
        config = {
            "PERFORMANCE_HINT": "LATENCY",
            "INFERENCE_PRECISION_HINT": PRECISION_HINTS[precision],
            "INFERENCE_NUM_THREADS": threads,
            "ENABLE_CPU_PINNING": False,
        }
        self.compiled = ov.Core().compile_model(graph, "CPU", config)
        self.request = self.compiled.create_infer_request()
        self.version = ov.__version__

    def runs(self, input_ids: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]]) -> bool:
        """Whether this batch is one OpenVINO takes; otherwise the torch path answers it and raises the error
        torch raises for a bad batch (OpenVINO's gather answers an unknown id or position silently: zeros, or
        counted from the end for a negative id). ~20 us for 32 pairs."""
        if not input_ids or not 0 < min(map(len, input_ids)) <= max(map(len, input_ids)) <= self.max_positions:
            return False
        ok_ids = 0 <= min(map(min, input_ids)) and max(map(max, input_ids)) < self.vocab
        return ok_ids and 0 <= min(map(min, token_type_ids)) and max(map(max, token_type_ids)) < self.segments

    def logits(self, input_ids: Sequence[Sequence[int]], token_type_ids: Sequence[Sequence[int]]) -> Tensor:
        """(B, levels) float32 logits, in input order. A padded token costs as much as a real one, and a
        service batch of random one-pair requests is 30-40% padding: so the pairs, longest first, are cut
        into groups of similar length (each pair at least `FILL` of its group's longest), one inference each."""
        order = sorted(range(len(input_ids)), key=lambda i: -len(input_ids[i]))
        out: Tensor | None = None
        start = 0
        while start < len(order):
            longest = len(input_ids[order[start]])
            end = start + 1
            while end < len(order) and len(input_ids[order[end]]) >= FILL * longest:
                end += 1
            group = order[start:end]
            ids, seg, mask = pad_batch([input_ids[i] for i in group], [token_type_ids[i] for i in group], self.pad_id)
            got = torch.from_numpy(self.request.infer([ids.numpy(), seg.numpy(), mask.numpy()])[0].copy())
            if out is None:
                out = torch.empty(len(order), got.shape[1])
            out[group] = got.float()
            start = end
        assert out is not None  # runs() refuses an empty batch
        return out


# --- the probe ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbeResult:
    """Seconds per engine over the probe's batches (the best of the repeats, batch by batch)."""

    torch_s: float
    openvino_s: float
    batches: str  # what was timed, e.g. "32x14-36, 8x64-128 tokens"

    @property
    def winner(self) -> str:
        return "openvino" if self.torch_s > MARGIN * self.openvino_s else "torch"

    def summary(self) -> str:
        ratio = self.torch_s / self.openvino_s if self.openvino_s > 0 else float("inf")
        return (
            f"probe on {self.batches}: torch {self.torch_s * 1e3:.1f} ms, openvino {self.openvino_s * 1e3:.1f} ms "
            f"(openvino {ratio:.2f}x torch; it serves from {MARGIN:g}x)"
        )

    def figures(self) -> dict[str, float]:
        return {"torch_ms": round(self.torch_s * 1e3, 2), "openvino_ms": round(self.openvino_s * 1e3, 2)}


Forward = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], Tensor]
Batches = list[tuple[list[list[int]], list[list[int]]]]  # (token ids, segment ids) per batch


def probe_batches(max_length: int, vocab: int, cls_id: int, sep_id: int, seed: int = 0) -> Batches:
    """Two realistic service batches: 32 one-pair requests of 14-36 tokens (about scenario (a) of
    bench/load.py, ~30% padding), and 8 long pairs from 64 tokens up to `max_length`."""
    rng = random.Random(seed)
    batches: Batches = []
    for n, lo, hi in ((32, 14, 36), (8, 64, 128)):
        lo, hi = min(lo, max_length), min(hi, max_length)
        lengths = [rng.randint(lo, hi) for _ in range(n)]
        ids = [[cls_id] + [rng.randrange(1000, vocab) for _ in range(t - 2)] + [sep_id] for t in lengths]
        segs = [[0] * (t // 2) + [1] * (t - t // 2) for t in lengths]
        batches.append((ids, segs))
    return batches


def probe(torch_forward: Forward, openvino_forward: Forward, batches: Batches, repeats: int = 3) -> ProbeResult:
    """Time both forwards on `batches`, interleaved (the order alternates per repeat) after one untimed pass
    each (first-call allocations, kernel builds); the best of `repeats` per batch, summed."""
    engines = {"torch": torch_forward, "openvino": openvino_forward}
    for f in engines.values():
        for ids, segs in batches:
            f(ids, segs)
    best = {name: [float("inf")] * len(batches) for name in engines}
    for r in range(repeats):
        for name in sorted(engines, reverse=r % 2 == 1):
            for i, (ids, segs) in enumerate(batches):
                t0 = time.perf_counter()
                engines[name](ids, segs)
                best[name][i] = min(best[name][i], time.perf_counter() - t0)
    shape = ", ".join(f"{len(ids)}x{min(map(len, ids))}-{max(map(len, ids))}" for ids, _ in batches)
    return ProbeResult(sum(best["torch"]), sum(best["openvino"]), f"{shape} tokens")


# --- the engine and its choice ----------------------------------------------------------------
class OpenVINOEngine:
    """OpenVINO answers the batches it takes; the torch engine it wraps answers head masks, the batches OpenVINO
    refuses, and any batch it fails on (logged once)."""

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
    if choice not in CHOICES:
        raise ValueError(f"inference must be one of {list(CHOICES)}, got {choice!r}")
    if choice == "torch":
        return engine, Inference("torch", f"inference={choice}")
    device = engine.device
    why = missing()
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
    elif why is None and dtype not in PRECISION_HINTS:
        why = f"OpenVINO takes float32, bfloat16 or a static int8 plan, not {dtype}"
    forward = None
    if why is None:
        try:
            assert source is not None
            fp32 = load_module(source)  # the float32 weights: the torch engine's are cast and repacked
            precision = dtype if plan is None else plan.about.get("float_precision", "float32")
            forward = OpenVINOForward(fp32, precision, torch.get_num_threads(), tokenizer.pad_id, plan=plan)
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
    batches = probe_batches(tokenizer.max_length, vocab, tokenizer.cls_id, tokenizer.sep_id)
    with torch.inference_mode():
        result = probe(engine.logits, forward.logits, batches)
    log.info("inference=auto chose %s: %s", result.winner, result.summary())
    inference = Inference(result.winner, f"auto: {result.summary()}", result.figures())
    if result.winner == "torch":
        return engine, inference  # OpenVINO not kept: its weights are a second copy
    return OpenVINOEngine(forward, engine), inference
