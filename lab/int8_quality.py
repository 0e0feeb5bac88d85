"""Does the static int8 plan keep the grade? On all of held-out Home Depot dev (issue 20's int8 goal).

Against qtrel float32 on the same pairs: the share of pairs whose level is unchanged (goal >= 99%) and the
RMSE of the expected-level score; against the raters: QWK, RMSE on the relevance scale and NDCG@10, the
numbers a user of the grade sees. Rows: the native float mode on OpenVINO (what int8 is compared with),
the checkpoint's plan (`int8.json`, `qtrel quantize`), and every encoder linear in int8 (the plan's upper
bound on speed, for reference). The speed of each is `bench/anchors.py`'s (same model directory).

  python lab/int8_quality.py --model model/default
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import warnings
from pathlib import Path

import torch
from anchors import isa, run_header, slug_of
from results import DEV, publish

from model.checkpoint import load_module
from model.data import read_labelled
from model.device import resolve_dtype
from model.engines import int8
from model.engines.openvino import OpenVINOForward
from model.relevance import RelevanceModel, pad_batch
from model.train.evaluate import metrics_of

KEYS = ("qwk", "rmse_relevance", "ndcg@10")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path("model/default"))
    ap.add_argument("--tag", default="", help="suffix of the JSON file and the docs section, e.g. -pruned")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    cpu = isa()
    plan = int8.Int8Plan.load(a.model)
    if plan is None:
        raise SystemExit(f"{a.model} has no {int8.PLAN_FILE}: run qtrel quantize first")
    ds = read_labelled(DEV, ["1", "2", "3", "4", "5"])
    if a.quick:
        ds.examples = ds.examples[:500]
    ref = RelevanceModel.load(a.model, dtype="float32")
    enc = ref.encode(ds.pairs)
    want = ref.score(ref.encoded_logits(enc))
    precision = resolve_dtype("auto", torch.device("cpu"))
    precision = precision if precision in ("float32", "bfloat16") else "float32"
    fp32 = load_module(a.model).eval()
    with (DEV.parent / "train.csv").open(encoding="utf-8") as f:  # as qtrel quantize draws them
        train = [(r["query"], r["title"]) for r in csv.DictReader(f)]
    random.Random(0).shuffle(train)
    calib = ref.encode(train[:512])
    batches = [
        pad_batch(calib.input_ids[i : i + 32], calib.token_type_ids[i : i + 32], ref.tokenizer.pad_id)
        for i in range(0, len(calib), 32)
    ]
    every = int8.calibrate(fp32, batches)
    rows = {"qtrel float32 (torch)": metrics_of(ds, want)}
    systems = {
        f"OpenVINO {precision}": None,
        f"int8 plan ({plan.about.get('linears', len(plan.linears))} linears)": plan,
        "every encoder linear in int8 (reference: the speed bound)": int8.Int8Plan(every),
    }
    for name, p in systems.items():
        forward = OpenVINOForward(fp32, precision, 1, ref.tokenizer.pad_id, plan=p)
        got = ref.score(forward.logits(enc.input_ids, enc.token_type_ids))
        d = got.expected - want.expected
        rows[name] = {
            **metrics_of(ds, got),
            "same_level": (got.level == want.level).float().mean().item(),
            "score_rmse": d.pow(2).mean().sqrt().item(),
        }
        print(name, {k: round(v, 4) for k, v in rows[name].items() if k in (*KEYS, "same_level")}, flush=True)
    report = {**run_header(cpu), "pairs": len(ds), "plan": plan.about, "rows": rows}
    publish("int8_quality", slug_of(cpu) + a.tag, report, render(report), a.quick)
    print(render(report))
    return 0


def render(r: dict) -> str:
    about = r["plan"]
    pairs = about.get("pairs", {})
    lines = [
        f"### Does static int8 keep the grade? {r['isa']['microarchitecture']} (`lab/int8_quality.py`, {r['date']})",
        "",
        f"- ISA: {r['isa_line']}",
        f"- command: `{r['command']}`; torch {r['torch']}; {r['pairs']:,} dev pairs",
        f"- the plan: {about.get('linears')} encoder linears "
        f"({100 * about.get('linear_flops_share', 0):.0f}% of "
        f"their multiply-adds), chosen by `qtrel quantize` on "
        f"{pairs.get('calibration')} + {pairs.get('selection')} training pairs "
        f"(calibration + selection) for "
        f"{100 * about.get('target_agreement', 0):.0f}% agreement (measured there: "
        f"{100 * about.get('selection_agreement', 0):.2f}%), {about.get('made')}",
        "",
        "| system | same level as float32 | score RMSE vs float32 | QWK | RMSE (relevance) | NDCG@10 |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, m in r["rows"].items():
        same = "(reference)" if "same_level" not in m else f"{100 * m['same_level']:.2f}%"
        srmse = "0" if "score_rmse" not in m else f"{m['score_rmse']:.4f}"
        lines.append(f"| {name} | {same} | {srmse} | {m['qwk']:.4f} | {m['rmse_relevance']:.4f} | {m['ndcg@10']:.4f} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    raise SystemExit(main())
