"""Turn a `finetune_zh` run into builtin:zh: fit the head's class biases on calib.jsonl for macro-F1 (folded
into the classifier's bias, so the result is a plain checkpoint), measure the held-out split through qtrel's
own tokenizer and forward path, and save in float16 with the tokenizer and the model's languages.

    python -m model.train.ship_zh RUN ENCODER DATA OUT

Only the calibration pairs choose the biases; the held-out pairs are only measured.
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
from dataclasses import replace
from pathlib import Path

import torch

from model.checkpoint import load_module, save_checkpoint
from model.relevance import RelevanceModel
from model.tokenizer import PairTokenizer
from model.train.metrics import accuracy, confusion, macro_f1
from model.train.qbqtc import read

MODEL_ID = "qtrel-e5small-qbqtc-zh"
LANGUAGES = ["zh", "en"]
GRID = [round(-1.5 + 0.05 * i, 2) for i in range(61)]  # bias offsets tried for classes 1 and 2 (class 0 fixed)


def logits_of(model: RelevanceModel, rows: list[dict]) -> torch.Tensor:
    return model.encoded_logits(model.encode([(r["query"], r["title"]) for r in rows]))


def fit_bias(logits: torch.Tensor, labels: list[int]) -> tuple[list[float], float]:
    """Class-bias offsets (the first class's 0) that maximise macro-F1 on these pairs."""
    best: tuple[float, list[float]] = (-1.0, [0.0] * logits.shape[1])
    for rest in itertools.product(GRID, repeat=logits.shape[1] - 1):
        b = [0.0, *rest]
        pred = (logits + torch.tensor(b)).argmax(-1).tolist()
        f = macro_f1(labels, pred, logits.shape[1])
        if f > best[0]:
            best = (f, b)
    return best[1], best[0]


def metrics(logits: torch.Tensor, labels: list[int], bias: list[float] | None = None) -> dict:
    pred = (logits + torch.tensor(bias or [0.0] * logits.shape[1])).argmax(-1).tolist()
    k = logits.shape[1]
    return {
        "pairs": len(labels),
        "accuracy": round(accuracy(labels, pred), 4),
        "macro_f1": round(macro_f1(labels, pred, k), 4),
        "confusion": confusion(labels, pred, k),
    }


def ship(run: Path, encoder: Path, data: Path, out: Path, max_length: int = 64) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(run / name, work / name)
        shutil.copy(encoder / "tokenizer.json", work / "tokenizer.json")
        model = RelevanceModel.load(work, dtype="float32", max_length=max_length)
        calib, held = read(data / "calib.jsonl"), read(data / "heldout.jsonl")
        lc, lh = logits_of(model, calib), logits_of(model, held)
        y_c, y_h = [r["label"] for r in calib], [r["label"] for r in held]
        bias, calib_f1 = fit_bias(lc, y_c)
        module = load_module(work)
        with torch.no_grad():
            module.classifier.bias.add_(torch.tensor(bias))
        extra = {**module.cfg.extra, "qtrel_model_id": MODEL_ID, "languages": LANGUAGES}
        extra["qtrel_heldout"] = metrics(lh, y_h, bias) | {"max_length": max_length}
        module.cfg = replace(module.cfg, extra=extra)
        save_checkpoint(module, PairTokenizer.from_dir(work), out, dtype=torch.float16)
    return {
        "class_bias": bias,
        "calib_macro_f1": round(calib_f1, 4),
        "heldout_raw": metrics(lh, y_h),
        "heldout": extra["qtrel_heldout"],
        "size_bytes": (out / "model.safetensors").stat().st_size,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a finetune_zh output (config.json, model.safetensors)")
    ap.add_argument("encoder", type=Path, help="the trimmed encoder (its tokenizer.json)")
    ap.add_argument("data", type=Path, help="calib.jsonl and heldout.jsonl (model.train.qbqtc --calib-percent)")
    ap.add_argument("out", type=Path)
    ap.add_argument("--max-length", type=int, default=64)
    args = ap.parse_args(argv)
    print(json.dumps(ship(args.run, args.encoder, args.data, args.out, args.max_length), indent=1))


if __name__ == "__main__":
    main()
