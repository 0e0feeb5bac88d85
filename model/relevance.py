"""The graded-relevance model as a library: load, encode, score.

`RelevanceModel` joins the tokenizer and the module on one device and precision. Scores are always
float32 and defined once, in `model.scoring`: probabilities per level, the expected level
sum_k level_k * p(k) (a single number that ranks titles for a query), and the level chosen by the
checkpoint's level rule."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from model.batches import bulk_batches
from model.bert import BertForRelevance
from model.checkpoint import CheckpointError, load_module, save_checkpoint
from model.config import BertConfig
from model.device import resolve_device, resolve_dtype
from model.int8 import NO_VNNI, PLAN_FILE, Int8Plan, cpu_has_vnni
from model.kernels import attention_path, choose_attention, install_cpu_kernels, set_attention, warm_linear_shapes
from model.levels import DEFAULT_LEVELS, MAX_BATCH_TOKENS
from model.packing import length_batches, pad_batch, token_slices
from model.parallel import ForwardWorkers, run_batches, workers_for
from model.scoring import LevelRule, ScoredBatch, level_values, merge_classes, score_logits
from model.tokenizer import EncodedPairs, PairTokenizer, Truncation

if TYPE_CHECKING:  # imported where OpenVINO is asked for: the torch path never loads it
    from model.openvino_inference import OpenVINOForward

__all__ = ["RelevanceModel", "PairScore", "level_values", "pad_batch", "length_batches", "new_from_encoder"]

log = logging.getLogger("qtrel.model")

# float32 on MKL (the fused kernels): a forward over more packed tokens than this ran slower per pair, its
# activations out of cache (AMD EPYC Zen 3: 117 pairs/s at 2,048-4,096 tokens, 99 at 8,192; docs/benchmarks.md)
FUSED_FORWARD_TOKENS = 4096
Ids = Sequence[Sequence[int]]  # a batch of encoded pairs' token (or segment) ids
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": None}


@dataclass
class PairScore:
    probs: list[float]  # per level, in the order of `RelevanceModel.labels`
    level: str  # label of the level chosen by the model's level rule
    score: float  # expected level
    tokens: int
    truncated: bool


class RelevanceModel:
    """Tokenizer + module on one device and precision; inference only."""

    def __init__(
        self,
        module: BertForRelevance,
        tokenizer: PairTokenizer,
        device: str = "cpu",
        dtype: str = "float32",
        name: str = "qtrel",
        onednn: bool = False,
        unpadded: bool = False,
        attention: str = "auto",
    ):
        """`onednn`: the linear layers in oneDNN's weight layout (cpu, float32/bfloat16, where
        `model.kernels.probe` passes); the module is then inference-only and cannot be saved or trained.
        `unpadded`: batches run without padding (`model.packing`; cpu only, cuda keeps padded batches).
        `attention` (with `onednn`): the packed forward's attention kernel, "auto", "fused" or "torch"
        (`model.kernels.choose_attention`)."""
        self.device = resolve_device(device)
        dtype = resolve_dtype(dtype, self.device)  # "auto": the fastest this machine runs natively
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {list(DTYPES)} or auto, got {dtype!r}")
        if dtype == "float16" and self.device.type == "cpu":
            raise ValueError("float16 runs on cuda only; on cpu use bfloat16 or int8")
        if dtype == "int8" and self.device.type != "cpu":
            raise ValueError("int8 dynamic quantisation runs on cpu only")
        if tokenizer.vocab_size > module.cfg.vocab_size:
            raise CheckpointError(
                f"tokenizer has {tokenizer.vocab_size} tokens but the model embeds only {module.cfg.vocab_size}"
            )
        self.cfg: BertConfig = module.cfg
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.name = name
        module = module.eval()
        if dtype == "int8":
            module = torch.ao.quantization.quantize_dynamic(module, {nn.Linear}, dtype=torch.qint8)
        else:
            module = module.to(self.device, DTYPES[dtype])
        self.cpu_kernels = "plain"  # or onednn-packed, fused, plain (probe failed: ...), as describe() reports
        self.attention = "sdpa"  # the packed forward's attention kernel (model.kernels.choose_attention)
        self.attention_probe: dict[str, float] | None = None  # its start-up timings, where it ran
        self.attention_reason = "RelevanceModel's default"
        self.fused_norm = False  # the packed forward's residual add + LayerNorm in one pass (model.kernels)
        torch_dtype = DTYPES[dtype]  # None for int8
        if onednn and torch_dtype is not None and self.device.type == "cpu":
            self.cpu_kernels = install_cpu_kernels(module, torch_dtype)
            choice = choose_attention(module, torch_dtype, attention)
            self.attention, self.attention_probe, self.attention_reason, self.fused_norm = choice
        self.onednn = self.cpu_kernels == "onednn-packed"
        self.unpadded = unpadded and self.device.type == "cpu"  # model.packing.pack; measured on cpu only
        self.module = module
        self.source: Path | None = None  # the checkpoint directory, where loaded from one (load())
        self.inference = "torch"  # what runs the forward (use_inference) until a model process asks for OpenVINO
        self.inference_reason = "RelevanceModel's default"
        self.inference_probe: dict | None = None
        self._openvino: OpenVINOForward | None = None
        self._openvino_failed = False  # logged once
        # Many batches at once (encoded_logits) on workers of one thread each where torch has several
        # (model.parallel); `workers`: how many, 0 for one per core up to parallel.MAX_WORKERS
        self.workers = 0
        self._pool: ForwardWorkers | None = None
        self.labels = self.cfg.levels  # what a score grades; the head may have extra classes (model.config)
        self.class_levels = self.cfg.class_levels
        self.values = level_values(self.labels)
        try:
            self.rule = LevelRule.from_extra(self.cfg.extra, len(self.labels))
        except ValueError as e:
            raise CheckpointError(f"config.json: {e}") from None

    @classmethod
    def load(
        cls,
        path: str | Path,
        device: str = "cpu",
        dtype: str = "float32",
        max_length: int = 128,
        onednn: bool = True,
        unpadded: bool = True,
        attention: str = "auto",
    ) -> RelevanceModel:
        """A checkpoint on a device and precision; by default on the fast path this machine has (oneDNN
        linears where the probe passes, batches without padding on cpu)."""
        path = Path(path)
        module = load_module(path)
        limit = min(max_length, module.cfg.max_position_embeddings)
        tok = PairTokenizer.from_dir(path, max_length=limit)
        name = str(module.cfg.extra.get("qtrel_model_id") or path.name)
        m = cls(
            module, tok, device=device, dtype=dtype, name=name, onednn=onednn, unpadded=unpadded, attention=attention
        )
        m.source = path
        return m

    @property
    def max_length(self) -> int:
        return self.tokenizer.max_length

    def describe(self) -> dict:
        """What a server reports about the loaded model (plain JSON-ready values)."""
        return {
            "name": self.name,
            "labels": list(self.labels),
            "max_length": self.max_length,
            "device": str(self.device),
            "dtype": self.dtype,
            "level_rule": self.rule.name,
            "level_cuts": None if self.rule.cuts is None else list(self.rule.cuts),
            "cpu_kernels": self.cpu_kernels,
            "attention": self.attention,
            "attention_probe": self.attention_probe,
            "attention_reason": self.attention_reason,
            "attention_path": attention_path(self.attention, self.dtype),
            "fused_norm": self.fused_norm,
            "inference": self.inference,
            "inference_reason": self.inference_reason,
            "inference_probe": self.inference_probe,
        }

    def use_inference(self, choice: str) -> None:
        """What runs the forward pass: "torch", "openvino" (compiled here from the checkpoint on disk, cpu,
        float32/bfloat16), or "auto": both timed on two realistic batches (about a second on the default
        model), OpenVINO kept only where it is clearly faster (`openvino_inference.MARGIN`). Where OpenVINO
        is missing or fails to convert or compile, torch, with the reason in `describe()`. Compiling starts
        OpenVINO's thread pools: never call this in a process that forks (service.runtime.template). Head
        masks always run on torch."""
        from model import openvino_inference as ovi

        if choice not in ovi.CHOICES:
            raise ValueError(f"inference must be one of {list(ovi.CHOICES)}, got {choice!r}")
        self._openvino, self.inference_probe = None, None
        self.inference, self.inference_reason = "torch", f"inference={choice}"
        if choice == "torch":
            return
        why = ovi.missing()
        if why is None and self.device.type != "cpu":
            why = f"OpenVINO serves the cpu here, not {self.device}"
        if why is None and self.source is None:
            why = "no checkpoint directory to convert from"
        plan = None
        if why is None and self.dtype == "int8":
            try:
                assert self.source is not None
                plan = Int8Plan.load(self.source)
            except ValueError as e:
                why = str(e)
            if why is None and plan is None:
                why = f"int8 on OpenVINO needs the checkpoint's {PLAN_FILE} (qtrel quantize): dynamic int8"
        elif why is None and self.dtype not in ovi.PRECISION_HINTS:
            why = f"OpenVINO takes float32, bfloat16 or a static int8 plan, not {self.dtype}"
        if why is None:
            try:
                assert self.source is not None
                fp32 = load_module(self.source)  # the float32 weights: self.module is cast and repacked
                precision = self.dtype if plan is None else plan.about.get("float_precision", "float32")
                self._openvino = ovi.OpenVINOForward(
                    fp32, precision, torch.get_num_threads(), self.tokenizer.pad_id, plan=plan
                )
                del fp32
            except Exception as e:  # conversion or compilation: torch serves
                why = f"conversion failed: {type(e).__name__}: {(str(e).splitlines() or [''])[0][:200]}"
        if why is not None or self._openvino is None:
            self.inference_reason = f"torch: {why}"
            (log.warning if choice == "openvino" or self.dtype == "int8" else log.info)(
                "inference=%s runs torch: %s", choice, why
            )
            return
        if plan is not None:  # no probe: torch's int8 is dynamic and moves the grade (docs/benchmarks.md)
            self.inference = "openvino"
            self.inference_reason = f"inference={choice}, int8: {len(plan.linears)} linears static int8 ({PLAN_FILE})"
            if not cpu_has_vnni():
                self.inference_reason += f"; {NO_VNNI}"
                log.warning("dtype=int8: %s", NO_VNNI)
            return
        if choice == "openvino":
            self.inference, self.inference_reason = "openvino", "inference=openvino"
            return
        vocab = min(self.tokenizer.vocab_size, self.cfg.vocab_size)
        batches = ovi.probe_batches(self.max_length, vocab, self.tokenizer.cls_id, self.tokenizer.sep_id)
        with torch.inference_mode():
            result = ovi.probe(self._torch_logits, self._openvino.logits, batches)
        self.inference, self.inference_probe = result.winner, result.figures()
        self.inference_reason = f"auto: {result.summary()}"
        if result.winner == "torch":
            self._openvino = None  # not kept: its weights are a second copy
        log.info("inference=auto chose %s: %s", result.winner, result.summary())

    def warm_up(self, max_batch_tokens: int = MAX_BATCH_TOKENS, kernels: bool = True) -> None:
        """Forward passes over a spread of lengths and batch sizes, and (unpadded path, `kernels`) every linear
        layer at every packed token count up to `max_batch_tokens`: first-call allocations and kernel builds
        happen here, not on a user's request. `kernels=False`: the forward passes only, for a process forked
        from one that built the kernels (they touch the pages a request writes, so that the copies on write
        happen here too)."""
        # oneDNN builds a kernel per shape (MKL's sgemm behind the fused plain layers does not); with OpenVINO
        # only head masks run torch
        if self.unpadded and kernels and self.onednn and self._openvino is None:
            warm_linear_shapes(self.module, max_batch_tokens)
        vocab = min(self.tokenizer.vocab_size, self.cfg.vocab_size)
        for length in sorted({8, 32, self.max_length}):
            for size in (1, 8):
                ids = [[self.tokenizer.cls_id] + [1000 % vocab] * (length - 2) + [self.tokenizer.sep_id]] * size
                self.logits(ids, [[0] * length] * size)

    def use_attention(self, kind: str) -> None:
        """The packed forward's attention kernel, "sdpa", "math" or "fused", whatever this CPU would choose (A/Bs)."""
        self.attention = set_attention(self.module, kind)
        self.attention_reason = "set by use_attention"

    def save(self, path: str | Path, dtype: torch.dtype | None = None) -> None:
        if self.dtype == "int8" or self.cpu_kernels in ("onednn-packed", "fused"):
            raise ValueError("save the float model, not its oneDNN or int8 runtime form (load with onednn=False)")
        save_checkpoint(self.module, self.tokenizer, path, dtype)

    # --- scoring -------------------------------------------------------------------------------
    @torch.inference_mode()
    def logits(
        self,
        input_ids: Sequence[Sequence[int]],
        token_type_ids: Sequence[Sequence[int]],
        head_mask: Tensor | None = None,
        raw: bool = False,
        on_device: bool = False,
    ) -> Tensor:
        """One forward pass over a batch of encoded pairs -> (B, levels) float32 logits on cpu (`on_device`: left
        on the model's device); `raw`: one per class of the head, before extra classes are merged (calibration)."""
        logits = None
        ov = self._openvino
        if ov is not None and head_mask is None and ov.runs(input_ids, token_type_ids):
            try:
                logits = ov.logits(input_ids, token_type_ids)
            except Exception as e:  # this batch on torch; the model process lives on
                if not self._openvino_failed:
                    self._openvino_failed = True
                    log.warning(
                        "OpenVINO failed on a batch, torch answered it (logged once): %s: %s", type(e).__name__, e
                    )
        if logits is None:
            logits = self._torch_logits(input_ids, token_type_ids, head_mask, on_device)
        return logits if raw else merge_classes(logits, self.class_levels)

    def _torch_logits(self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None, gpu=False) -> Tensor:
        """(B, classes) float32 logits on cpu (`gpu`: left on the device) from the torch module."""
        if self.unpadded:
            fused = self.cpu_kernels == "fused"
            parts = token_slices([len(x) for x in input_ids], FUSED_FORWARD_TOKENS) if fused else [slice(None)]
            return torch.cat(
                [self.module.forward_packed(input_ids[s], token_type_ids[s], head_mask).float().cpu() for s in parts]
            )
        ids, seg, mask = pad_batch(input_ids, token_type_ids, self.tokenizer.pad_id)
        dev = self.device
        logits, _ = self.module(ids.to(dev), seg.to(dev), mask.to(dev), head_mask, cls_only=True)
        return logits.float() if gpu else logits.float().cpu()

    def probs(self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None) -> Tensor:
        """(B, levels) float32 probabilities."""
        return self.logits(input_ids, token_type_ids, head_mask).softmax(-1)

    def score(self, logits: Tensor) -> ScoredBatch:
        """(B, levels) logits -> probabilities, expected level and the rule's level (model.scoring)."""
        return score_logits(logits, self.values, self.rule)

    def encode(self, pairs: Sequence[tuple[str, str]], truncation: Truncation = "only_second") -> EncodedPairs:
        return self.tokenizer.encode([q for q, _ in pairs], [t for _, t in pairs], truncation=truncation)

    def encoded_logits(
        self,
        enc: EncodedPairs,
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        head_mask: Tensor | None = None,
        raw: bool = False,
    ) -> Tensor:
        """(n, levels) float32 logits of encoded pairs, in their order, forwarded in length-sorted batches
        of at most `max_batch_tokens` padded tokens (`raw`: per class, as `logits`); on several workers at
        once where torch has several threads (`forward_workers`)."""
        out = torch.empty(len(enc), len(self.class_levels) if raw else len(self.labels))
        batches = self.batches_of(enc.lengths, max_batch_tokens)
        pool = self.forward_workers(torch_only=head_mask is not None)

        def forward(batch: list[int]) -> Tensor:
            ids, segs = [enc.input_ids[i] for i in batch], [enc.token_type_ids[i] for i in batch]
            return self.logits(ids, segs, head_mask, raw, on_device=True)

        got = run_batches(pool, forward, batches)
        # one copy at the end: on cuda the host pads the next batch while the device runs this one
        for batch, x in zip(batches, torch.cat(got).cpu().split([len(b) for b in batches]) if got else []):
            out[batch] = x
        return out

    def batches_of(self, lengths: Sequence[int], max_batch_tokens: int) -> list[list[int]]:
        """The length-sorted batches `encoded_logits` forwards (model.batches.bulk_batches)."""
        return bulk_batches(lengths, max_batch_tokens, self.device.type == "cpu")

    def forward_workers(self, torch_only: bool = False) -> ForwardWorkers | None:
        """The workers that forward many batches at once on this cpu (None: the caller's thread): as many as
        the caller's torch threads allow (`workers` to choose). OpenVINO forwards run on its own threads
        (`torch_only`: the batches run on torch, e.g. with a head mask)."""
        if self.device.type != "cpu" or (self._openvino is not None and not torch_only):
            return None
        self._pool = workers_for(self._pool, torch.get_num_threads(), self.workers)
        return self._pool

    def predict(
        self,
        pairs: Sequence[tuple[str, str]],
        truncation: Truncation = "only_second",
        max_batch_tokens: int = MAX_BATCH_TOKENS,
        head_mask: Tensor | None = None,
    ) -> list[PairScore]:
        """Score pairs in length-sorted batches of at most `max_batch_tokens` padded tokens."""
        enc = self.encode(pairs, truncation)
        s = self.score(self.encoded_logits(enc, max_batch_tokens, head_mask))
        return [
            PairScore(p, self.labels[lv], e, n, tr)
            for p, lv, e, n, tr in zip(
                s.probs.tolist(), s.level.tolist(), s.expected.tolist(), enc.lengths, enc.truncated
            )
        ]


def new_from_encoder(
    path: str | Path, labels: Sequence[str] = DEFAULT_LEVELS, seed: int = 0, max_length: int = 128
) -> tuple[BertForRelevance, PairTokenizer]:
    """A fresh relevance model: pretrained encoder from `path`, new seeded head (and pooler if the
    encoder has none), labelled `labels`."""
    path = Path(path)
    encoder = load_module(path, num_labels_fallback=True)
    cfg = encoder.cfg.with_labels(list(labels))
    module = BertForRelevance(cfg, with_pooler=True)
    module.init_weights(seed)
    src = encoder.state_dict()
    mismatched = [
        f"{k}: {tuple(src[k].shape)} vs {tuple(v.shape)}"
        for k, v in module.state_dict().items()
        if k in src and not k.startswith("classifier.") and src[k].shape != v.shape
    ]
    if mismatched:  # never train a tensor as if it were pretrained when it was not copied
        raise CheckpointError(f"{path}: encoder tensors do not fit the new model: {'; '.join(mismatched)}")
    with torch.no_grad():
        for k, v in module.state_dict().items():
            if k in src and not k.startswith("classifier."):
                v.copy_(src[k])
    tok = PairTokenizer.from_dir(path, max_length=min(max_length, cfg.max_position_embeddings))
    return module, tok
