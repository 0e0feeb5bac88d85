"""Should the bulk commands run qtrel's OpenVINO forward? (issue 20) `encoded_logits`, what `qtrel score`,
`qtrel eval` and `predict` run (length-sorted batches; with several threads, torch forwards whole batches
on one-thread workers while OpenVINO splits each batch over its threads), on torch and on OpenVINO.

`model/default` in the machine's native precision, dev pairs encoded once (tokenising not timed), the
engines alternating within each round; logits compared.

    python lab/bulk_engines.py [--threads 1 2] [--pairs 3000] [--rounds 4]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from load import read_dev

from model.builtin import builtin_dir
from model.relevance import RelevanceModel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(builtin_dir("default")))
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--pairs", type=int, default=3000)
    p.add_argument("--rounds", type=int, default=4)
    a = p.parse_args()
    pairs = [(r["query"], r["title"]) for r in read_dev()[: a.pairs]]
    for threads in a.threads:
        torch.set_num_threads(threads)
        models = {}
        for choice in ("torch", "openvino"):
            m = RelevanceModel.load(a.model, dtype="auto")
            m.use_inference(choice)
            if choice == "openvino" and m.inference != "openvino":
                print(f"OpenVINO not available: {m.inference_reason}")
                return 1
            models[choice] = m
        enc = models["torch"].encode(pairs)
        rates: dict[str, list[float]] = {k: [] for k in models}
        warm = models["torch"].encode(pairs[:64])
        logits = {k: m.encoded_logits(warm) for k, m in models.items()}  # first calls
        for r in range(a.rounds):
            for k in sorted(models, reverse=r % 2 == 1):
                t0 = time.perf_counter()
                logits[k] = models[k].encoded_logits(enc)
                rates[k].append(len(pairs) / (time.perf_counter() - t0))
        per_round = [o / t for t, o in zip(rates["torch"], rates["openvino"])]
        diff = float((logits["torch"] - logits["openvino"]).abs().max())
        print(
            f"{threads} thread(s), {models['torch'].dtype}, {len(pairs)} pairs: "
            + ", ".join(f"{k} {statistics.median(v):.0f} pairs/s ({min(v):.0f}-{max(v):.0f})" for k, v in rates.items())
            + f"; openvino / torch per round {', '.join(f'{x:.2f}' for x in per_round)}; max |logit diff| {diff:.1e}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
