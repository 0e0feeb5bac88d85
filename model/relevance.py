"""The graded-relevance model as a library: load, encode, score.

`RelevanceModel` joins the tokenizer and an inference engine (`model.engines`, chosen once at load) on one
device and precision. Scores are always float32 and defined once, in `model.scoring`: probabilities per
level, the expected level sum_k level_k * p(k) (a single number that ranks titles for a query), and the level
chosen by the checkpoint's level rule."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from model.arch import Network, architecture
from model.batches import bulk_batches
from model.checkpoint import CheckpointError, load_network, save_checkpoint
from model.config import BertConfig
from model.device import resolve_device, resolve_dtype
from model.engines import openvino
from model.engines.base import Engine, EngineKind, Ids, Kernels
from model.engines.eager import DTYPES, torch_engine
from model.engines.kernels import attention_path
from model.heads import Head
from model.levels import MAX_BATCH_TOKENS, PairScore, ScoredBatch
from model.packing import length_batches, pad_batch
from model.parallel import ForwardWorkers, run_batches, workers_for
from model.scoring import LevelRule, level_values, score_logits
from model.tokenizer import EncodedPairs, PairTokenizer, Truncation

__all__ = ["RelevanceModel", "level_values", "pad_batch", "length_batches"]


class RelevanceModel:
    """Tokenizer + module on one device and precision; inference only."""

    def __init__(
        self,
        module: Network,
        tokenizer: PairTokenizer,
        device: str = "cpu",
        dtype: str = "float32",
        name: str = "qtrel",
        onednn: bool = False,
        unpadded: bool = False,
        attention: str = "auto",
    ):
        """`onednn`: the linear layers in oneDNN's weight layout (cpu, float32/bfloat16, where
        `model.engines.kernels.probe` passes); the module is then inference-only and cannot be saved or trained.
        `unpadded`: batches run without padding (`model.packing`; cpu only, cuda keeps padded batches).
        `attention` (with `onednn`): the packed forward's attention kernel, "auto", "fused" or "torch"
        (`model.engines.kernels.choose_attention`)."""
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
        # what runs the forward: a torch engine, until a model process asks for OpenVINO (use_inference)
        self.arch = architecture(self.cfg.model_type)  # which network; whether the fast CPU path covers it
        fast = self.arch.fast
        self.engine: Engine = torch_engine(
            module, self.device, dtype, tokenizer.pad_id, onednn and fast, unpadded and fast, attention
        )
        self.inference_choice = openvino.Inference()
        self.source: Path | None = None  # the checkpoint directory, where loaded from one (load())
        # Many batches at once (encoded_logits) on workers of one thread each where torch has several
        # (model.parallel); `workers`: how many, 0 for one per core up to parallel.MAX_WORKERS
        self.workers = 0
        self._pool: ForwardWorkers | None = None
        try:  # what a score grades: a k-level head's levels, or a one-logit head's (model.heads)
            self.head = Head.of(self.cfg)
        except ValueError as e:
            raise CheckpointError(f"config.json: {e}") from None
        self.labels = list(self.head.levels)
        self.class_levels = list(self.head.class_levels)
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
        module = load_network(path)
        limit = min(max_length, module.cfg.max_position_embeddings - module.cfg.position_offset)
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

    @property
    def path(self) -> str:
        """Which forward serves this model (/info): the fast CPU path or the plain one, and why."""
        if self.unpadded:
            return f"fast: packed rows, {self.cpu_kernels} linears, {self.attention} attention"
        if not self.arch.fast:
            return f"plain: the fast CPU path does not cover {self.cfg.model_type} yet"
        return "plain: padded batches"

    @property
    def module(self) -> Network:
        """The torch module the torch engine runs (head masks and explanations always run on it)."""
        return self.engine.torch.module

    @property
    def kernels(self) -> Kernels:
        """What the torch engine runs on the CPU; each field also an attribute of its own, as describe() names it."""
        return self.engine.torch.kernels

    @property
    def cpu_kernels(self) -> str:
        return self.kernels.cpu_kernels

    @property
    def attention(self) -> str:
        return self.kernels.attention

    @property
    def attention_probe(self) -> dict[str, float] | None:
        return self.kernels.attention_probe

    @property
    def attention_reason(self) -> str:
        return self.kernels.attention_reason

    @property
    def fused_norm(self) -> bool:
        return self.kernels.fused_norm

    @property
    def inference(self) -> str:
        return self.inference_choice.name

    @property
    def inference_reason(self) -> str:
        return self.inference_choice.reason

    @property
    def inference_probe(self) -> dict[str, float] | None:
        return self.inference_choice.probe

    @property
    def onednn(self) -> bool:
        return self.kernels.cpu_kernels == "onednn-packed"

    @property
    def unpadded(self) -> bool:
        return self.engine.torch.kind == EngineKind.PACKED

    def describe(self) -> dict[str, Any]:
        """What a server reports about the loaded model (plain JSON-ready values)."""
        k = self.kernels
        # ModernBERT's fused attention runs float32 arithmetic on any dtype (model.engines.modern_packed)
        arithmetic = "float32" if self.cfg.model_type == "modernbert" else self.dtype
        return {
            "name": self.name,
            "labels": list(self.labels),
            "max_length": self.max_length,
            "device": str(self.device),
            "dtype": self.dtype,
            "level_rule": self.rule.name,
            "level_cuts": None if self.rule.cuts is None else list(self.rule.cuts),
            "architecture": self.cfg.model_type,
            "head": self.head.kind,
            "path": self.path,
            "cpu_kernels": k.cpu_kernels,
            "attention": k.attention,
            "attention_probe": k.attention_probe,
            "attention_reason": k.attention_reason,
            "attention_path": attention_path(k.attention, arithmetic),
            "fused_norm": k.fused_norm,
            "inference": self.inference_choice.name,
            "inference_reason": self.inference_choice.reason,
            "inference_probe": self.inference_choice.probe,
        }

    def use_inference(self, choice: str) -> None:
        """What runs the forward pass: "torch", "openvino" (compiled here from the checkpoint on disk, cpu,
        float32/bfloat16), or "auto": both timed on two realistic batches (about a second on the default
        model), OpenVINO kept only where it is clearly faster (`openvino.MARGIN`). Where OpenVINO
        is missing or fails to convert or compile, torch, with the reason in `describe()`. Compiling starts
        OpenVINO's thread pools: never call this in a process that forks (service.runtime.workers.template). Head
        masks always run on torch."""
        vocab = min(self.tokenizer.vocab_size, self.cfg.vocab_size)
        self.engine, self.inference_choice = openvino.choose(
            self.engine.torch, choice, self.source, self.dtype, self.tokenizer, vocab
        )

    def warm_up(self, max_batch_tokens: int = MAX_BATCH_TOKENS, kernels: bool = True) -> None:
        """Forward passes over a spread of lengths and batch sizes, and (`kernels`) the engine's kernels for
        every packed token count up to `max_batch_tokens`: first-call allocations and kernel builds happen here,
        not on a user's request. `kernels=False`: the forward passes only, for a process forked from one that
        built the kernels (they touch the pages a request writes, so that the copies on write happen here too)."""
        if kernels:
            self.engine.warm_up(max_batch_tokens)
        vocab = min(self.tokenizer.vocab_size, self.cfg.vocab_size)
        for length in sorted({8, 32, self.max_length}):
            for size in (1, 8):
                ids = [[self.tokenizer.cls_id] + [1000 % vocab] * (length - 2) + [self.tokenizer.sep_id]] * size
                self.logits(ids, [[0] * length] * size)

    def use_attention(self, kind: str) -> None:
        """The packed forward's attention kernel, "sdpa", "math" or "fused", whatever this CPU would choose (A/Bs)."""
        self.engine.torch.use_attention(kind)

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
        logits = self.engine.logits(input_ids, token_type_ids, head_mask, on_device)
        return logits if raw else self.head.level_logits(logits)

    def probs(self, input_ids: Ids, token_type_ids: Ids, head_mask: Tensor | None = None) -> Tensor:
        """(B, levels) float32 probabilities."""
        return self.logits(input_ids, token_type_ids, head_mask).softmax(-1)

    def score(self, logits: Tensor) -> ScoredBatch[Tensor]:
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
        if self.device.type != "cpu" or (self.engine.own_threads and not torch_only):
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
        """Score pairs in length-sorted batches of at most `max_batch_tokens` padded tokens; a pair's level is
        its class index (`labels[level]` names it)."""
        enc = self.encode(pairs, truncation)
        return self.score(self.encoded_logits(enc, max_batch_tokens, head_mask)).rows()
