"""Which engine a model process should run here (issue 20): torch's packed forward against qtrel's OpenVINO
forward on the batches a server forms, not only on length-sorted ones.

One thread (a model process's), `model/default` in the machine's native precision; each batch set timed
for both engines alternately, best of ROUNDS: the probe's two batches (`openvino.probe_batches`,
what `inference=auto` times at start-up), 20 batches of 32 dev pairs in arrival order (mixed lengths, as
the batcher forms them under load), the same cut to 8 pairs, and the 32s sorted by length (the anchors').

    python lab/engine_batches.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import time

import torch
from load import read_dev

from model.builtin import builtin_dir
from model.engines import openvino as ovi
from model.relevance import RelevanceModel

Batches = list[tuple[list, list]]


def pass_seconds(forward, batches: Batches) -> float:
    t0 = time.perf_counter()
    for ids, segs in batches:
        forward(ids, segs)
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(builtin_dir("default")))
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    torch.set_num_threads(1)
    m = RelevanceModel.load(a.model, dtype="auto")
    m.use_inference("openvino")
    if m.inference != "openvino":
        print(f"OpenVINO not available: {m.inference_reason}")
        return 1
    tok = m.tokenizer
    probe = ovi.probe_batches(m.max_length, tok.vocab_size, tok.cls_id, tok.sep_id)
    enc = m.encode([(r["query"], r["title"]) for r in read_dev()[:640]])

    def cut(order: list[int], size: int) -> Batches:
        groups = [order[k : k + 32][:size] for k in range(0, len(order), 32)]
        return [([enc.input_ids[i] for i in g], [enc.token_type_ids[i] for i in g]) for g in groups]

    arrival = list(range(len(enc)))
    sets = {
        "probe: 32 short pairs": probe[:1],
        "probe: 8 long pairs": probe[1:],
        "20 x 32 dev pairs, arrival order": cut(arrival, 32),
        "20 x 8 dev pairs, arrival order": cut(arrival, 8),
        "20 x 32 dev pairs, sorted by length": cut(sorted(arrival, key=enc.lengths.__getitem__), 32),
    }
    engines = {"torch": m.engine.torch.logits, "openvino": m.engine.logits}
    print(f"{m.name}, {m.dtype}, {m.cpu_kernels}, 1 thread, best of {a.rounds}")
    with torch.inference_mode():
        for name, batches in sets.items():
            best = {e: float("inf") for e in engines}
            for f in engines.values():  # first calls: allocations, kernel builds
                pass_seconds(f, batches[:2])
            for r in range(a.rounds):
                for e in sorted(engines, reverse=r % 2 == 1):
                    best[e] = min(best[e], pass_seconds(engines[e], batches))
            ratio = best["torch"] / best["openvino"]
            print(f"{name}: torch {best['torch'] * 1e3:.0f} ms, openvino {best['openvino'] * 1e3:.0f} ms: "
                  f"openvino {ratio:.2f}x torch", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
