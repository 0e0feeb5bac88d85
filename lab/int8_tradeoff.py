"""int8 on the machine at hand (issue 20): does any int8 variant keep the grade, and is it faster than the
fastest float mode? On the shipped default model and held-out Home Depot dev pairs.

Quality, against qtrel's float32 path on `--quality-pairs` dev pairs: the share of pairs whose level is
unchanged (goal >= 99%) and the RMSE of the expected-level score. Variants:
  - `torch.ao.quantization.quantize_dynamic` (qtrel's `--dtype int8` today: per-tensor int8 weights,
    per-tensor dynamic activations, the x86 engine);
  - W8A8: per-output-channel symmetric int8 weights, per-token dynamic symmetric int8 activations, run on
    `torch._int_mm` (oneDNN s8 x s8 -> s32); the same scheme as torchao's
    `Int8DynamicActivationInt8WeightConfig`, which is timed beside it in eager mode where torchao is installed;
  - W7A8: the same with 7-bit weights (the remedy for u8 x s8 saturation on AVX2 without VNNI).
Speed: pairs/s on length-sorted batches of 32 (`--speed-pairs` pairs, tokenisation not timed), each int8
variant beside qtrel's default (bfloat16 where native, unpadded, oneDNN) and float32, interleaved per
repeat (`bench/anchors.py`'s `measure`), at 1 and at 2 torch threads.

  python lab/int8_tradeoff.py --model model/default [--pause-pid PID]
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import warnings
from pathlib import Path

import torch
from anchors import isa, isa_line, measure, run_header, slug_of
from results import DEV, publish
from torch import Tensor, nn

from model.bert import Layer
from model.relevance import RelevanceModel

BATCH = 32


class W8A8Linear(nn.Module):
    """Per-channel symmetric int weights (`bits`), per-token symmetric int8 activations, `torch._int_mm`."""

    def __init__(self, lin: nn.Linear, bits: int = 8):
        super().__init__()
        w = lin.weight.detach().float()
        q = 2 ** (bits - 1) - 1
        scale = w.abs().amax(1).clamp(min=1e-12) / q  # (out,)
        self.wq = torch.round(w / scale[:, None]).clamp(-q, q).to(torch.int8).t().contiguous()  # (in, out)
        self.scale = scale
        self.bias = lin.bias.detach().float()

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1]).float()  # (N, in)
        xs = x.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127  # (N, 1)
        acc = torch._int_mm(torch.round(x / xs).to(torch.int8), self.wq)  # (N, out) int32
        out = acc.float().mul_(self.scale).mul_(xs).add_(self.bias)
        return out.reshape(*shape[:-1], -1)


def int8_model(path: Path, bits: int) -> RelevanceModel:
    m = RelevanceModel.load(path, dtype="float32", onednn=False)
    for layer in m.module.modules():
        if isinstance(layer, Layer):
            a = layer.attn
            for parent, name in ((a, "query"), (a, "key"), (a, "value"), (a, "out"), (layer, "up"), (layer, "down")):
                setattr(parent, name, W8A8Linear(getattr(parent, name), bits))
    return m


def torchao_model(path: Path) -> RelevanceModel | None:
    try:
        from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_
    except ImportError:
        return None
    m = RelevanceModel.load(path, dtype="float32", onednn=False)
    quantize_(m.module.bert, Int8DynamicActivationInt8WeightConfig())
    return m


def read_pairs(n: int) -> list[tuple[str, str]]:
    with DEV.open(encoding="utf-8") as f:
        return [(r["query"], r["title"]) for _, r in zip(range(n), csv.DictReader(f))]


def batches_of(m: RelevanceModel, pairs: list[tuple[str, str]]) -> list[tuple[list, list]]:
    enc = m.encode(pairs)
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    chunks = [order[i : i + BATCH] for i in range(0, len(order), BATCH)]
    return [([enc.input_ids[i] for i in c], [enc.token_type_ids[i] for i in c]) for c in chunks]


def quality(ref: RelevanceModel, models: dict[str, RelevanceModel], pairs: list[tuple[str, str]]) -> dict:
    enc = ref.encode(pairs)
    want = ref.score(ref.encoded_logits(enc))
    out = {}
    for name, m in models.items():
        got = m.score(m.encoded_logits(enc))
        d = got.expected - want.expected
        out[name] = {
            "same_level": (got.level == want.level).float().mean().item(),
            "score_rmse": d.pow(2).mean().sqrt().item(),
            "score_max_abs": d.abs().max().item(),
        }
        print(f"  quality {name}: {out[name]}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("model/default"))
    ap.add_argument("--quality-pairs", type=int, default=2000)
    ap.add_argument("--speed-pairs", type=int, default=1000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--pause-pid", type=int, default=None, help="SIGSTOP this process during each timed repeat")
    ap.add_argument("--tag", default="", help="suffix of the JSON file and the docs section, e.g. -1thread")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    torch.backends.quantized.engine = "x86"
    machine_isa = isa()
    print(isa_line(machine_isa), flush=True)

    torch.set_num_threads(1)
    ref = RelevanceModel.load(args.model, dtype="float32")
    fast_float = RelevanceModel.load(args.model, dtype="auto")
    models = {
        f"qtrel default ({fast_float.dtype})": fast_float,
        "qtrel float32": ref,
        "quantize_dynamic qint8": RelevanceModel.load(args.model, dtype="int8"),
        "W8A8 per-token (_int_mm)": int8_model(args.model, 8),
        "W7A8 per-token (_int_mm)": int8_model(args.model, 7),
    }
    ao = torchao_model(args.model)
    if ao is not None:
        models["torchao Int8DynamicActivationInt8Weight (eager)"] = ao
    others = {k: v for k, v in models.items() if k != "qtrel float32"}
    q = quality(ref, others, read_pairs(args.quality_pairs)) if args.quality_pairs else {}

    lists = batches_of(ref, read_pairs(args.speed_pairs))
    speed: dict[str, dict] = {}
    for threads in args.threads:
        torch.set_num_threads(threads)

        def system(m: RelevanceModel):
            return lambda: torch.cat([m.logits(ids, seg) for ids, seg in lists])

        print(f"speed, {threads} thread(s)", flush=True)
        runs, _, load = measure({k: system(m) for k, m in models.items()}, {}, args.repeats, args.pause_pid)
        speed[str(threads)] = {
            "load": load,
            "pairs_per_s": {k: [args.speed_pairs / s for s in r["seconds"]] for k, r in runs.items()},
            "pairs_per_cpu_s": {k: [args.speed_pairs / s for s in r["cpu_seconds"]] for k, r in runs.items()},
        }
    report = {
        **run_header(machine_isa),
        "quality_pairs": args.quality_pairs,
        "speed_pairs": args.speed_pairs,
        "quality": q,
        "speed": speed,
        "fast_float": f"qtrel default ({fast_float.dtype})",
    }
    publish("int8_tradeoff", slug_of(machine_isa) + args.tag, report, render(report), args.quick)
    print(render(report))
    return 0


def render(r: dict) -> str:
    fast = r["fast_float"]
    lines = [
        f"### int8 against the fastest float mode: {r['isa']['microarchitecture']} "
        f"(`lab/int8_tradeoff.py`, {r['date']})",
        "",
        f"- ISA: {r['isa_line']}",
        f"- command: `{r['command']}`; torch {r['torch']}",
        f"- quality on {r['quality_pairs'] or 'no (see the run with quality)'} dev pairs against qtrel float32; "
        f"speed on {r['speed_pairs']} dev pairs "
        f"in length-sorted batches of {BATCH}, systems interleaved per repeat, median (range)",
    ]
    for t, s in r["speed"].items():
        lines.append(
            f"- load at {t} thread(s): 1-minute load average after each repeat "
            + ", ".join(f"{x['loadavg_1min_after']:.1f}" for x in s["load"])
        )
    heads = " | ".join(f"pairs/s, {t} thr | × {fast}, {t} thr | × per CPU-s, {t} thr" for t in r["speed"])
    lines += [
        "",
        f"| variant | same level | score RMSE | {heads} |",
        "|---|---:|---:|" + "---:|---:|---:|" * len(r["speed"]),
    ]
    for name in r["speed"][next(iter(r["speed"]))]["pairs_per_s"]:
        qa = r["quality"].get(name)
        if not r["quality"]:
            cells = ["(not run)", "(not run)"]
        elif name == "qtrel float32":
            cells = ["(reference)", "0"]
        else:
            cells = [f"{qa['same_level'] * 100:.2f}%", f"{qa['score_rmse']:.4f}"]
        for s in r["speed"].values():
            v = s["pairs_per_s"][name]
            base = s["pairs_per_s"][fast]
            ratio = statistics.median(a / b for a, b in zip(v, base))
            cpu = statistics.median(s["pairs_per_cpu_s"][name]) / statistics.median(s["pairs_per_cpu_s"][fast])
            cells += [f"{statistics.median(v):.0f} ({min(v):.0f}–{max(v):.0f})", f"{ratio:.2f}", f"{cpu:.2f}"]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
