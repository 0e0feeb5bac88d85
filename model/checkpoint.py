"""Hugging Face-format checkpoints: config.json + model.safetensors (or pytorch_model.bin) + tokenizer.

Loading is strict: every missing, unexpected or mis-shaped tensor is named in the error. Keys are
accepted with or without the `bert.` prefix and with the old `gamma`/`beta` LayerNorm names; saving
writes the `BertForSequenceClassification` layout, so `transformers` reads what we write.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model.arch import Architecture, Network, architecture, read_config
from model.arch.bert import BERT
from model.bert import BertForRelevance
from model.config import BertConfig, CheckpointError, ConfigError

# Buffers some checkpoints carry that hold no learned weights.
_IGNORED = re.compile(r"^(\w+\.)?embeddings\.(position_ids|token_type_ids)$")


def hf_to_ours(
    hf_state: dict[str, torch.Tensor], arch: Architecture = BERT
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Map a Hugging Face state dict of `arch` to our names. Returns (state, keys we did not recognise)."""
    state: dict[str, torch.Tensor] = {}
    unknown: list[str] = []
    for key, value in hf_state.items():
        if _IGNORED.match(key):
            continue
        k = re.sub(r"\.gamma$", ".weight", re.sub(r"\.beta$", ".bias", key))  # old LayerNorm names
        ours = arch.to_ours(k)
        if ours is None:
            unknown.append(key)
        else:
            state[ours] = value
    return state, unknown


def ours_to_hf(state: dict[str, torch.Tensor], arch: Architecture = BERT) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        hf = arch.to_hf(key)
        if hf is None:
            raise CheckpointError(f"no Hugging Face name for {key}")
        out[hf] = value
    return out


def _file_name(key: str, arch: Architecture = BERT) -> str:
    """The Hugging Face name of one of our keys, as the user sees it in the checkpoint file."""
    return arch.to_hf(key) or key


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a checkpoint directory: safetensors first; a .bin only through weights_only."""
    st, pt = path / "model.safetensors", path / "pytorch_model.bin"
    try:
        if st.is_file():
            return load_file(str(st))
        if pt.is_file():
            return torch.load(str(pt), map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt or hostile file: never fall back to unpickling
        raise CheckpointError(f"cannot read weights from {path}: {e}") from e
    raise CheckpointError(f"{path} has no model.safetensors or pytorch_model.bin")


def load_state(model: torch.nn.Module, state: dict[str, torch.Tensor], allow_missing: tuple[str, ...] = ()) -> None:
    """Copy `state` into `model`; every problem is collected and named in one error.
    `allow_missing` lists key prefixes that may be absent (a fresh head being built)."""
    arch = architecture(getattr(model, "cfg", BertConfig()).model_type)
    expected = model.state_dict()
    missing = [_file_name(k, arch) for k in expected if k not in state and not k.startswith(allow_missing)]
    unexpected = [_file_name(k, arch) for k in state if k not in expected]
    shapes = [
        f"{_file_name(k, arch)}: checkpoint {tuple(v.shape)} vs model {tuple(expected[k].shape)}"
        for k, v in state.items()
        if k in expected and v.shape != expected[k].shape
    ]
    problems = []
    if missing:
        problems.append("missing: " + ", ".join(missing))
    if unexpected:
        problems.append("unexpected: " + ", ".join(unexpected))
    if shapes:
        problems.append("wrong shape: " + "; ".join(shapes))
    if problems:
        raise CheckpointError("weights do not fit the config — " + " | ".join(problems))
    with torch.no_grad():
        for k, v in state.items():
            expected[k].copy_(v)


def load_config(path: Path) -> BertConfig:
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a directory")
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path} is not a checkpoint: it has no config.json")
    try:
        d = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path / 'config.json'}: {e}") from e
    try:
        if not isinstance(d, dict):
            raise ConfigError("not a JSON object")
        return read_config(d)
    except ConfigError as e:
        raise CheckpointError(f"{path / 'config.json'}: {e}") from e


def has_head(path: str | Path) -> bool:
    """Whether the checkpoint at `path` carries a classification head (`classifier.weight`)."""
    arch = architecture(load_config(Path(path)).model_type)
    state, _ = hf_to_ours(read_weights(Path(path)), arch)
    return "classifier.weight" in state


def load_network(path: str | Path, num_labels_fallback: bool = False) -> Network:
    """Build the relevance module of any architecture (model.arch) from a checkpoint directory.

    A checkpoint that has a classification head must match it exactly. With `num_labels_fallback`,
    an encoder-only checkpoint (no `classifier.*`) is accepted and its head left for the caller."""
    path = Path(path)
    cfg = load_config(path)
    arch = architecture(cfg.model_type)
    state, unknown = hf_to_ours(read_weights(path), arch)
    if unknown:
        raise CheckpointError(f"{path}: unexpected tensors: {', '.join(unknown)} (not in {arch.hf_class}'s layout)")
    emb = state.get(arch.ours + ("word.weight" if arch.ours == "encoder." else "embeddings.word.weight"))
    if emb is not None and emb.shape[0] != cfg.vocab_size:
        raise CheckpointError(
            f"{path}: word embeddings have {emb.shape[0]} rows but config.vocab_size is {cfg.vocab_size}"
        )
    model = arch.build(cfg, arch.pooler_key in state)
    has_head = "classifier.weight" in state
    if not has_head and not num_labels_fallback:
        raise CheckpointError(
            f"{path} has no classification head (classifier.weight); build one from this encoder "
            "with `qtrel train --base` or model.train.encoder.new_from_encoder()"
        )
    load_state(model, state, allow_missing=() if has_head else ("classifier.",))
    return model  # type: ignore[return-value]  # arch.build makes the module its config names


def load_module(path: str | Path, num_labels_fallback: bool = False) -> BertForRelevance:
    """`load_network` for the BERT-shaped architectures (BERT, XLM-R, ELECTRA, DistilBERT), which training,
    pruning and int8 work on; a ModernBERT checkpoint is refused with the reason."""
    module = load_network(path, num_labels_fallback)
    if not isinstance(module, BertForRelevance):
        raise CheckpointError(f"{path} is a {module.cfg.model_type} checkpoint: this step runs BERT-shaped encoders")
    return module


def save_checkpoint(module: Network, tokenizer, path: str | Path, dtype: torch.dtype | None = None) -> None:
    """Write config.json, model.safetensors (optionally cast, e.g. float16) and the tokenizer files, in the
    layout of the module's architecture, so that `transformers` reads them."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    arch = architecture(module.cfg.model_type)
    state = {}
    for k, v in ours_to_hf(module.state_dict(), arch).items():
        v = v.detach().to("cpu")
        if dtype is not None and v.is_floating_point():
            v = v.to(dtype)
        state[k] = v.contiguous()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "model.safetensors").chmod(0o644)  # safetensors writes 0600: unreadable to a non-root server
    cfg = arch.write_config(module.cfg)
    cfg["torch_dtype"] = str(dtype or torch.float32).removeprefix("torch.")
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n", encoding="utf-8")
    tokenizer.save(path)


def export_checkpoint(src: str | Path, out: str | Path, dtype: str = "float16", model_id: str | None = None) -> dict:
    """`qtrel export`: re-save a checkpoint with weights stored in `dtype`, optionally under a model id
    (config key qtrel_model_id). Every other config key, the level rule included, is kept."""
    from dataclasses import replace

    from model.tokenizer import PairTokenizer

    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    module = load_network(src)
    if model_id:
        module.cfg = replace(module.cfg, extra={**module.cfg.extra, "qtrel_model_id": model_id})
    save_checkpoint(module, PairTokenizer.from_dir(src), out, dtype=getattr(torch, dtype))
    return {"out": str(out), "dtype": dtype, "model_id": model_id}


def average_checkpoints(paths: list[str | Path], out: str | Path, dtype: str = "float32") -> dict:
    """`qtrel average`: the element-wise mean of the weights of several checkpoints of one architecture
    (e.g. the last evaluations of one run, or seeds from one base): an ensemble's gain at one model's cost.
    The config and tokenizer are the first checkpoint's; recalibrate the result (the level rule was fitted
    on the first checkpoint's scores)."""
    from model.tokenizer import PairTokenizer

    if len(paths) < 2:
        raise ValueError("averaging needs at least two checkpoints")
    if dtype not in ("float32", "float16", "bfloat16"):
        raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
    module = load_module(paths[0])
    first = load_config(Path(paths[0])).to_dict()
    total = {k: v.detach().double().clone() for k, v in module.state_dict().items()}
    for p in paths[1:]:
        cfg = load_config(Path(p)).to_dict()
        keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "vocab_size")
        differs = [k for k in (*keys, "id2label", "pruned_heads") if cfg.get(k) != first.get(k)]
        if differs:
            raise CheckpointError(f"{p} does not have the architecture of {paths[0]}: {', '.join(differs)} differ")
        other = load_module(p).state_dict()
        if other.keys() != total.keys() or any(other[k].shape != v.shape for k, v in total.items()):
            raise CheckpointError(f"{p} does not have the tensors of {paths[0]} (pruned differently?)")
        for k, v in other.items():
            total[k] += v.double()
    with torch.no_grad():
        for k, v in module.state_dict().items():
            v.copy_((total[k] / len(paths)).to(v.dtype))
    save_checkpoint(module, PairTokenizer.from_dir(paths[0]), out, dtype=getattr(torch, dtype))
    return {"out": str(out), "averaged": [str(p) for p in paths], "dtype": dtype}
