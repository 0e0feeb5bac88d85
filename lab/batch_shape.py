"""What a batch's shape costs the model path (issue 20): CPU time per pair of one model process forwarding
the same dev pairs in length-sorted batches of 32 (what offline runs), and in file order (mixed lengths, as
one-pair requests arrive at a server) in batches of 32, 20 (the served mean under 64 clients) and 8.
Process CPU time, so a busy neighbour core does not count; rounds interleaved, median and range.

  cd bench && python batch_shape.py [--model DIR] [--pairs 2000] [--rounds 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from model_speed import read_pairs

from model.builtin import builtin_dir
from model.relevance import RelevanceModel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=str(builtin_dir("default")))
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model, dtype="auto")
    m.warm_up()
    enc = m.encode(read_pairs(a.pairs))
    ids, seg = enc.input_ids, enc.token_type_ids
    by_length = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    arrival = list(range(len(ids)))

    def cut(order: list[int], b: int) -> list[list[int]]:
        return [order[i : i + b] for i in range(0, len(order), b)]

    variants = {
        "length-sorted, 32": cut(by_length, 32),
        "file order, 32": cut(arrival, 32),
        "file order, 20": cut(arrival, 20),
        "file order, 8": cut(arrival, 8),
    }
    ms: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(a.rounds):
        for name, batches in variants.items():
            t0 = time.process_time()
            for b in batches:
                m.logits([ids[i] for i in b], [seg[i] for i in b])
            ms[name].append(1e3 * (time.process_time() - t0) / len(ids))
    print(f"{m.name}, {m.dtype}, attention {m.attention}, {a.threads} thread(s), {len(ids)} dev pairs")
    base = statistics.median(ms["length-sorted, 32"])
    for name, v in ms.items():
        med = statistics.median(v)
        print(f"{name}: {med:.2f} ms CPU per pair ({min(v):.2f}-{max(v):.2f}), {med / base:.2f}x length-sorted 32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
