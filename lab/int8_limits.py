"""Can every encoder linear run in int8 and keep the grade? Where the error comes from, and whether
quantisation-aware distillation buys it back (issue 20's int8 goal: >= 99% of float32's levels).

`qtrel quantize` keeps only the linears the grade tolerates (model.engines.int8): on model/default 15 of 36, a
third of the multiply-adds, which caps int8's speed-up. This measures the three things that decide
whether the rest could follow, on held-out Home Depot dev pairs against qtrel float32's levels:

1. **weight-only int8**: every encoder linear's weights rounded to int8 (symmetric, per output channel,
   as OpenVINO's int8 kernels take them), activations in float32: the weights' share of the error;
2. **static int8 on every linear**: the plan's calibration (per-tensor uint8 activations at the 99.999th
   percentile, SmoothQuant at alpha 0.5) for all 36, as torch's fake quantisation computes it; with
   `--openvino`, also on OpenVINO's int8 kernels (the two agree within noise);
3. **after quantisation-aware distillation**: the same quantised model trained to match float32's
   outputs on training pairs (straight-through gradients through the quantisers, ranges fixed; loss KL
   on the five classes plus MSE on the expected level), one row per learning rate.

bfloat16 (the shipped float mode) is the yardstick: the error a precision costs without any int8.

  python lab/int8_limits.py --model model/default [--pairs 2000] [--steps 250] [--lr 2e-5 1e-4]
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import random
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from anchors import isa, run_header, slug_of
from results import DEV, publish
from torch import Tensor, nn

from model.bert import BertForRelevance
from model.checkpoint import load_module
from model.data import read_labelled
from model.engines import int8
from model.relevance import RelevanceModel, pad_batch


class WeightOnly(nn.Module):
    """Weights rounded to int8 per output channel, inputs untouched."""

    weight: Tensor

    def __init__(self, lin: nn.Linear):
        super().__init__()
        w = lin.weight.detach().float()
        q = torch.fake_quantize_per_channel_affine(w, int8.weight_scale(w), zeros(w), 0, -128, 127)
        self.register_buffer("weight", q)
        self.bias = lin.bias

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Trainable(nn.Module):
    """model.engines.int8.FakeQuantLinear with the (smoothed) weight and bias as parameters: the weight scale
    follows the weight, the activation range and the smoothing stay as calibrated."""

    s: Tensor

    def __init__(self, lin: nn.Linear, p: int8.LinearPlan):
        super().__init__()
        s = torch.ones(lin.in_features) if p.smooth is None else torch.tensor(p.smooth, dtype=torch.float32)
        self.register_buffer("s", s)
        self.weight = nn.Parameter(lin.weight.detach().float() * s)
        self.bias = nn.Parameter(lin.bias.detach().float().clone())
        self.scale, self.zero = p.scale_zero

    def forward(self, x: Tensor) -> Tensor:
        x = torch.fake_quantize_per_tensor_affine(x / self.s, self.scale, self.zero, 0, 255)
        v = self.weight
        w = torch.fake_quantize_per_channel_affine(v, int8.weight_scale(v.detach()), zeros(v), 0, -128, 127)
        return F.linear(x, w, self.bias)


def zeros(w: Tensor) -> Tensor:
    return torch.zeros(w.shape[0], dtype=torch.int32)


def swap(module: BertForRelevance, make) -> nn.Module:
    """A copy of `module` with every encoder linear replaced by `make(name, linear)`."""
    return int8.replaced(module, int8.encoder_linears(module), make)


def padded_batches(ref: RelevanceModel, enc, size: int = 32) -> list[tuple[list[int], tuple]]:
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    out = []
    for k in range(0, len(order), size):
        b = order[k : k + size]
        ids, segs = [enc.input_ids[i] for i in b], [enc.token_type_ids[i] for i in b]
        out.append((b, pad_batch(ids, segs, ref.tokenizer.pad_id)))
    return out


@torch.no_grad()
def logits_of(module: nn.Module, batches, n: int) -> Tensor:
    got = [(b, module(*padded)[0].float()) for b, padded in batches]
    out = torch.empty(n, got[0][1].shape[1])
    for b, logits in got:
        out[b] = logits
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("model/default"))
    ap.add_argument("--pairs", type=int, default=2000, help="dev pairs measured (the first N)")
    ap.add_argument("--train-pairs", type=int, default=8000)
    ap.add_argument("--steps", type=int, default=250, help="distillation steps (batches of 32)")
    ap.add_argument("--lr", type=float, nargs="*", default=[2e-5, 1e-4])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--openvino", action="store_true", help="also run static int8 on OpenVINO's int8 kernels")
    ap.add_argument("--tag", default="")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    if a.quick:
        a.pairs, a.train_pairs, a.steps, a.lr = 200, 256, 4, a.lr[:1]
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    cpu = isa()
    ref = RelevanceModel.load(a.model, dtype="float32")
    fp32 = load_module(a.model).eval()
    ds = read_labelled(DEV, ["1", "2", "3", "4", "5"])
    ds.examples = ds.examples[: a.pairs]
    dev = ref.encode(ds.pairs)
    dev_batches = padded_batches(ref, dev)
    want = ref.score(logits_of(fp32, dev_batches, len(dev)))
    with (DEV.parent / "train.csv").open(encoding="utf-8") as f:  # as qtrel quantize draws them
        train = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    random.Random(0).shuffle(train)
    calib = padded_batches(ref, ref.encode(train[:512]))
    plan = int8.calibrate(fp32, [p for _, p in calib])
    rows: dict[str, dict] = {}

    def row(name: str, logits: Tensor, **extra) -> None:
        got = ref.score(logits)
        rows[name] = {
            "same_level": (got.level == want.level).float().mean().item(),
            "score_rmse": (got.expected - want.expected).pow(2).mean().sqrt().item(),
            **extra,
        }
        print(name, {k: round(v, 5) if isinstance(v, float) else v for k, v in rows[name].items()}, flush=True)

    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    row("bfloat16 (every op; the shipped float mode's rounding)", logits_of(bf16, dev_batches, len(dev)))
    weight_only = swap(fp32, lambda _n, lin: WeightOnly(lin))
    row("weight-only int8, every encoder linear", logits_of(weight_only, dev_batches, len(dev)))
    static = int8.apply(fp32, int8.Int8Plan(plan))
    row("static int8, every encoder linear (torch fake quantisation)", logits_of(static, dev_batches, len(dev)))
    if a.openvino:
        from model.engines.openvino import OpenVINOForward

        ov = OpenVINOForward(static, "float32", a.threads, ref.tokenizer.pad_id)
        name = "static int8, every encoder linear (OpenVINO int8 kernels, float32 elsewhere)"
        row(name, ov.logits(dev.input_ids, dev.token_type_ids))

    train_batches = [p for _, p in padded_batches(ref, ref.encode(train[512 : 512 + a.train_pairs]))]
    with torch.no_grad():
        teacher = [fp32(*p)[0] for p in train_batches]
    values = torch.tensor(ref.values, dtype=torch.float32)
    for lr in a.lr:
        student = swap(fp32, lambda n, lin: Trainable(lin, plan[n]))  # eval mode: no dropout
        params = [p for p in student.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 20) * max(0.0, 1 - i / a.steps))
        rng = random.Random(1)
        t0, losses = time.perf_counter(), []
        for _ in range(a.steps):
            j = rng.randrange(len(train_batches))
            out, t = student(*train_batches[j])[0], teacher[j]
            kl = F.kl_div(out.log_softmax(-1), t.log_softmax(-1), log_target=True, reduction="batchmean")
            mse = F.mse_loss((out.softmax(-1) * values).sum(-1), (t.softmax(-1) * values).sum(-1))
            loss = kl + mse
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
        k = max(1, len(losses) // 10)
        extra = {
            "train_loss_first": sum(losses[:k]) / k,
            "train_loss_last": sum(losses[-k:]) / k,
            "seconds": round(time.perf_counter() - t0, 1),
        }
        name = f"static int8, every linear, after distillation (lr {lr:g}, {a.steps} steps)"
        row(name, logits_of(student, dev_batches, len(dev)), **extra)

    report = {
        **run_header(cpu),
        "pairs": len(dev),
        "train_pairs": a.train_pairs,
        "steps": a.steps,
        "linears": len(plan),
        "rows": rows,
    }
    publish("int8_limits", slug_of(cpu) + a.tag, report, render(report), a.quick)
    print(render(report))
    return 0


def render(r: dict) -> str:
    lines = [
        f"### Can every linear run in int8 and keep the grade? {r['isa']['microarchitecture']} "
        f"(`lab/int8_limits.py`, {r['date']})",
        "",
        f"- ISA: {r['isa_line']}",
        f"- command: `{r['command']}`; torch {r['torch']}; the first {r['pairs']:,} dev pairs against qtrel float32's "
        f"levels; {r['linears']} encoder linears; distillation on {r['train_pairs']:,} training pairs "
        f"(batches of 32, {r['steps']} steps)",
        "",
        "| model | same level as float32 | expected-level RMSE vs float32 | distillation loss, first → last tenth |",
        "|---|---:|---:|---:|",
    ]
    for name, m in r["rows"].items():
        loss = f"{m['train_loss_first']:.5f} → {m['train_loss_last']:.5f}" if "train_loss_first" in m else ""
        lines.append(f"| {name} | {100 * m['same_level']:.2f}% | {m['score_rmse']:.4f} | {loss} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
