"""The packed forward's attention kernels by pair length (issue 20): where each one pays, measured whole.

MiniLM's served pairs are ~27 tokens, where the A/Bs chose the kernels (lab/attention_ab.py); a user who raises
`max_length` sends longer ones. This times the default model's whole forward on batches of ~4,096 tokens of
pairs all of one length (random tokens, a 10-token query), with each kernel forced for every block and the
length guards lifted (each layer's `fused_max`, `model.engines.packed.MATH_MAX_TOKENS`): torch's flash kernel per
group, the plain matmuls per group, and the fused kernel (on several threads, on torch's OpenMP team). Then the
shipped rules against one kernel for a whole batch on mixed batches. Kernels interleaved per round, the order
rotated; median ms and the per-round ratios. What it found fixed MATH_MAX_TOKENS and checks
`model.engines.kernels.fused_max_tokens` on the machine at hand.

  python lab/long_pairs.py --model model/default [--threads 1] [--rounds 6] [--dtype float32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
import warnings
from pathlib import Path

import torch
from anchors import isa, isa_line, slug_of
from results import command_line, machine, publish

from model.engines import fused, packed
from model.relevance import RelevanceModel

LENGTHS = (27, 48, 63, 64, 96, 128, 192, 256, 512)
TOKENS = 4096


def pairs(lengths: list[int], rng: random.Random) -> tuple[list[list[int]], list[list[int]]]:
    """[CLS] a 10-token query [SEP] the rest [SEP], random word pieces; segment ids to match."""
    ids = [[101, *(rng.randrange(1000, 20000) for _ in range(10)), 102] for _ in lengths]
    ids = [q + [rng.randrange(1000, 20000) for _ in range(n - 13)] + [102] for q, n in zip(ids, lengths)]
    return ids, [[0] * 12 + [1] * (n - 12) for n in lengths]


def set_guards(m: RelevanceModel, guards: tuple[int, int]) -> None:
    """The fused kernel's longest pair (each layer's `fused_max`) and the plain matmuls' longest block."""
    for layer in m.module.bert.blocks:
        layer.attn.fused_max = guards[0]
    packed.MATH_MAX_TOKENS = guards[1]


def timed(m: RelevanceModel, batch, kind: str | None, guards: tuple[int, int]) -> tuple[float, torch.Tensor]:
    if kind is not None:
        m.use_attention(kind)  # before the guards: it sets the shipped fused_max
    set_guards(m, guards)
    t0 = time.perf_counter()
    out = m.logits(*batch)
    return 1e3 * (time.perf_counter() - t0), out


def interleaved(m, batch, arms: dict, rounds: int) -> dict[str, list[float]]:
    """arms: name -> (kernel or None for as it is, guards); round 0 warms and is dropped."""
    ms: dict[str, list[float]] = {a: [] for a in arms}
    names = list(arms)
    for r in range(rounds + 1):
        for a in names[r % len(names) :] + names[: r % len(names)]:
            t, _ = timed(m, batch, *arms[a])
            if r:
                ms[a].append(t)
    return ms


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=Path("model/default"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--dtype", default="auto", help="the model's dtype (auto: what the service picks here)")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args()
    lengths = (27, 64, 256) if a.quick else LENGTHS
    rounds = 1 if a.quick else a.rounds
    warnings.filterwarnings("ignore")
    torch.set_num_threads(a.threads)
    m = RelevanceModel.load(a.model, dtype=a.dtype)
    m.warm_up()
    shipped, grouped = m.attention, m.module.bert.blocks[0].attn.grouped
    shipped_guards = (m.module.bert.blocks[0].attn.fused_max, packed.MATH_MAX_TOKENS)
    dtype = m.module.bert.embeddings.word.weight.dtype
    several = a.threads == 1 or fused.parallel()  # the fused kernel runs on this many threads
    kinds = ["sdpa", "math"] + (["fused"] if several and fused.available()[0] else [])
    rng = random.Random(0)
    free = (10**6, 10**6)
    res: dict = {"by_length": {}, "mixed": {}}
    try:
        for n in lengths:
            batch = pairs([n] * max(1, TOKENS // n), rng)
            ms = interleaved(m, batch, {k: (k, free) for k in kinds}, rounds)
            med = {k: statistics.median(v) for k, v in ms.items()}
            best = min(med, key=med.__getitem__)
            res["by_length"][n] = {"pairs": len(batch[0]), "ms": med, "all": ms, "best": best}
            print(n, {k: round(v, 1) for k, v in med.items()}, flush=True)
        m.use_attention(shipped)
        mixed = {
            "16 x 256": [256] * 16,
            "8 x 512": [512] * 8,
            "32 x 14-300": [rng.randrange(14, 300) for _ in range(32)],
            "64 x 128": [128] * 64,
            "31 x 20-40 + 1 x 300": [rng.randrange(20, 40) for _ in range(31)] + [300],
            "28 x 20-40 + 4 x 200-500": [rng.randrange(20, 40) for _ in range(28)]
            + [rng.randrange(200, 500) for _ in range(4)],
            "32 x 100-400": [rng.randrange(100, 400) for _ in range(32)],
        }
        for name, lens in mixed.items():
            batch = pairs(lens, rng)
            arms = {"shipped": (None, shipped_guards), "per group, every pair": (grouped, shipped_guards)}
            if grouped == "math":
                arms["per group, math on every block"] = (grouped, (shipped_guards[0], 10**6))
            if shipped == "fused" and several and shipped_guards[0] < 10**6:
                arms["fused, every pair"] = ("fused", (10**6, shipped_guards[1]))
            elif shipped == "fused" and several:  # the float32 path's guard, against every pair fused
                arms[f"fused up to {packed.FUSED_MAX_TOKENS}"] = ("fused", (packed.FUSED_MAX_TOKENS, shipped_guards[1]))
            ms = interleaved(m, batch, arms, rounds)
            ratios = {k: [o / s for s, o in zip(ms["shipped"], v)] for k, v in ms.items() if k != "shipped"}
            res["mixed"][name] = {"ms": {k: statistics.median(v) for k, v in ms.items()}, "ratios": ratios}
            print(name, res["mixed"][name]["ms"], flush=True)
    finally:
        m.use_attention(shipped)
        set_guards(m, shipped_guards)

    report = {
        "machine": machine(),
        "isa": isa(),
        "command": command_line(),
        "dtype": str(dtype).removeprefix("torch."),
        "threads": a.threads,
        "shipped": {"attention": shipped, "per_group": grouped, "guards": shipped_guards},
        **res,
    }
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    longest = "every pair's" if shipped_guards[0] >= 10**6 else f"{shipped_guards[0]}"
    lines = [
        f"### Attention kernels by pair length (`lab/long_pairs.py`, {stamp})",
        "",
        f"{report['dtype']}, {a.threads} torch thread(s); the default model's whole forward on batches of "
        f"~{TOKENS} tokens of pairs all of one length (random tokens), each kernel forced on every block with "
        f"the length guards lifted, interleaved over {rounds} rounds (median ms per forward). Shipped here: "
        f"**{shipped}**, per group **{grouped}**; the fused kernel up to {longest} tokens, the plain "
        f"matmuls on blocks up to {shipped_guards[1]} keys.",
        f"- {isa_line(report['isa'])}",
        f"- command: `{report['command']}`",
        "",
        "| tokens per pair | pairs | " + " | ".join(f"{k} ms" for k in kinds) + " | fastest | "
        + " | ".join(f"{k} ÷ fastest" for k in kinds) + " |",
        "|---:|---:|" + "---:|" * len(kinds) + "---|" + "---:|" * len(kinds),
    ]  # fmt: skip
    for n, r in res["by_length"].items():
        best = r["ms"][r["best"]]
        lines.append(
            f"| {n} | {r['pairs']} | " + " | ".join(f"{r['ms'][k]:.1f}" for k in kinds) + f" | {r['best']} | "
            + " | ".join(f"{r['ms'][k] / best:.2f}" for k in kinds) + " |"
        )  # fmt: skip
    arms = list(next(iter(res["mixed"].values()))["ratios"]) if res["mixed"] else []
    lines += [
        "",
        "The shipped rules (the fused kernel for pairs up to its guard, the groups for longer ones; the plain"
        " matmuls only on short blocks) against one kernel for the whole batch, mixed batches; the speed-up of the"
        " shipped rules over each (median of the per-round ratios, range):",
        "",
        "| batch | shipped ms | " + " | ".join(f"{k}: ms, speed-up" for k in arms) + " |",
        "|---|---:|" + "---:|" * len(arms),
    ]
    for name, r in res["mixed"].items():
        cells = [
            f"{r['ms'][k]:.1f}, {statistics.median(q):.2f} ({min(q):.2f}–{max(q):.2f})" for k, q in r["ratios"].items()
        ]
        lines.append(f"| {name} | {r['ms']['shipped']:.1f} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    key = f"{slug_of(isa())}-{a.threads}thread" + ("" if a.dtype == "auto" else f"-{a.dtype}")
    publish("long_pairs", key, report, text, a.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
