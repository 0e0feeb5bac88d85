"""The two model-path changes of 2026-12-03, A/B in one run (issue 20): oneDNN's packed linears against
MKL's (fused plain layers), each with the last layer in full (the earlier forward) and at [CLS] only.

Same 1,024 dev pairs in length-sorted batches of 32 through `RelevanceModel.logits`, float32, 1 thread,
variants interleaved per round with the order rotated; median and range of pairs/s, and the ratio to the
earlier default (oneDNN, full last layer).

    python lab/kernels_ab.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from load import read_dev
from results import DEV

from model.builtin import builtin_dir
from model.engines.kernels import use_fused_linears, use_onednn_linears
from model.engines.packed import PackedEncoder, embed
from model.relevance import RelevanceModel

PACKED_CLS = PackedEncoder.forward_packed


def packed_full(self, p, head_mask=None):
    """The packed forward before 2026-12-03: every layer over every token, [CLS] read at the end."""
    x = embed(self.embeddings, p)
    for layer in self.blocks:
        x = layer.forward_packed(x, p, None)
    cls = x.index_select(0, p.cls)
    return torch.tanh(self.pooler.dense(cls)) if self.pooler is not None else cls


def model_with(kernels) -> RelevanceModel:
    m = RelevanceModel.load(builtin_dir("default"), dtype="float32", onednn=False)
    kernels(m.module)  # cpu_kernels stays "plain": no token cap, the same batches for every variant
    return m


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    torch.set_num_threads(1)
    pairs = [(r["query"], r["title"]) for r in read_dev()[:1024]]
    onednn, fused = model_with(use_onednn_linears), model_with(use_fused_linears)
    enc = fused.encode(pairs)
    order = sorted(range(len(pairs)), key=enc.lengths.__getitem__)
    batches = [order[i : i + 32] for i in range(0, len(order), 32)]

    def run(m: RelevanceModel, forward) -> float:
        PackedEncoder.forward_packed = forward
        t = time.perf_counter()
        for b in batches:
            m.logits([enc.input_ids[i] for i in b], [enc.token_type_ids[i] for i in b])
        return len(pairs) / (time.perf_counter() - t)

    variants = {
        "oneDNN, last layer in full (the earlier default)": (onednn, packed_full),
        "oneDNN, last layer at [CLS] only": (onednn, PACKED_CLS),
        "MKL fused, last layer in full": (fused, packed_full),
        "MKL fused, last layer at [CLS] only": (fused, PACKED_CLS),
    }
    for v in variants.values():
        run(*v)  # warm
    rates: dict[str, list[float]] = {k: [] for k in variants}
    names = list(variants)
    for r in range(a.rounds):
        for k in names[r % len(names) :] + names[: r % len(names)]:
            rates[k].append(run(*variants[k]))
    PackedEncoder.forward_packed = PACKED_CLS
    base = statistics.median(rates[names[0]])
    print(f"{len(pairs)} pairs of {DEV.name}, batches of 32, float32, 1 thread, {a.rounds} rounds")
    for k, v in rates.items():
        med = statistics.median(v)
        print(f"{k}: {med:.0f} pairs/s ({min(v):.0f}-{max(v):.0f}), x{med / base:.2f}")


if __name__ == "__main__":
    main()
