"""Head pruning: speed against quality at several pruning levels, written to docs/heads.md.

Heads are ranked once by gradient importance (|dL/d head mask|, Michel et al. 2019) on training pairs,
the least important are removed for real (smaller q/k/v/output projections), and each pruned model is
evaluated on the whole dev file and timed on the same dev pairs as the unpruned one, in one run, with
the systems interleaved across repeats. Optionally each pruned model is fine-tuned for a few steps.

  python bench/prune_tradeoff.py --model model/default
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from harness.data import tiny_checkpoint
from harness.machine import cpu_kind
from harness.offline import throughput
from harness.publish import DEV, ROOT, command_line, machine, machine_lines, output_paths, update_block, write_json

from model.checkpoint import load_module, save_checkpoint
from model.data import read_labelled
from model.relevance import RelevanceModel
from model.tokenizer import PairTokenizer
from model.train.evaluate import evaluate
from model.train.heads import gradient_importance, heads_to_remove, prune_heads, prune_order

TRAIN = DEV.parent / "train.csv"
HEADS_MD = ROOT / "docs" / "heads.md"


def finetune(path: Path, steps: int, threads: int) -> None:
    from model.train.loop import TrainArgs, train

    train(
        TrainArgs(
            train_file=str(TRAIN),
            base=str(path),
            output_dir=str(path) + "-ft",
            dev_file=str(DEV),
            epochs=1.0,
            max_steps=steps,
            lr=3e-5,
            warmup_ratio=0.1,
            eval_every=steps,
            select="qwk",
            save_every=10**9,
            threads=threads,
            progress=False,
        )
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(ROOT / "model" / "default"))
    ap.add_argument("--fractions", default="0.25,0.4,0.5,0.6,0.75")
    ap.add_argument("--importance-pairs", type=int, default=2000)
    ap.add_argument("--speed-pairs", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--finetune-steps", type=int, default=0, help="fine-tune each pruned model this many steps")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quick", action="store_true", help="smoke run: a tiny checkpoint, one level, 64 pairs, scratch")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    tmp = Path(tempfile.mkdtemp(prefix="qtrel-prune-"))
    if a.quick:
        a.fractions, a.importance_pairs, a.speed_pairs, a.repeats, a.finetune_steps = "0.5", 32, 64, 1, 0
        a.model = str(tiny_checkpoint(tmp / "tiny"))

    module = load_module(a.model)
    tok = PairTokenizer.from_dir(a.model)
    labels = module.cfg.labels
    imp_ds = read_labelled(TRAIN, labels)
    imp_ds.examples = imp_ds.examples[: a.importance_pairs]
    enc = tok.encode([e.query for e in imp_ds.examples], [e.title for e in imp_ds.examples])
    importance = gradient_importance(module, enc, imp_ds.labels, tok.pad_id)
    order = prune_order(importance, module)
    total = module.cfg.num_hidden_layers * module.cfg.num_attention_heads

    dev = read_labelled(DEV, labels)
    if a.quick:
        dev.examples = dev.examples[:256]
    dirs = {"0%": Path(a.model)}
    removed: dict[str, list] = {"0%": []}
    for f in (float(x) for x in a.fractions.split(",")):
        remove = heads_to_remove(order, module, round(f * total))
        name = f"{round(100 * len(remove) / total)}%"
        path = tmp / name.rstrip("%")
        save_checkpoint(prune_heads(module, remove), tok, path)
        if a.finetune_steps:
            finetune(path, a.finetune_steps, a.threads)
            path = Path(str(path) + "-ft")
        dirs[name], removed[name] = path, remove
        print(f"pruned {len(remove)}/{total} heads -> {path}", file=sys.stderr)

    rows = {}
    for name, path in dirs.items():
        m = evaluate(RelevanceModel.load(path, dtype=a.dtype), dev)
        rows[name] = {k: m[k] for k in ("accuracy", "qwk", "ndcg@10", "rmse_relevance", "macro_f1")}
        print(name, json.dumps(rows[name]), file=sys.stderr)
    models = {n: RelevanceModel.load(p, dtype=a.dtype) for n, p in dirs.items()}
    speed = throughput(models, dev.pairs[: a.speed_pairs], a.repeats)

    base = rows["0%"]
    lines = [
        "| heads removed | pairs/s | speed-up | accuracy | QWK | ΔQWK | NDCG@10 | ΔNDCG@10 | RMSE (1..3) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in dirs:
        r = rows[name]
        dq = (r["qwk"] - base["qwk"]) / base["qwk"] * 100
        dn = (r["ndcg@10"] - base["ndcg@10"]) / base["ndcg@10"] * 100
        lines.append(
            f"| {name} | {speed[name]:.0f} | {speed[name] / speed['0%']:.2f}× | {r['accuracy']:.4f} | "
            f"{r['qwk']:.4f} | {dq:+.2f}% | {r['ndcg@10']:.4f} | {dn:+.2f}% | {r['rmse_relevance']:.4f} |"
        )
    m = machine()
    body = "\n".join(
        [
            *machine_lines(m, command_line()),
            f"- {a.dtype}, {a.speed_pairs} dev pairs timed, median of {a.repeats} interleaved repeats; "
            f"quality on all {len(dev)} dev pairs; importance from the first {a.importance_pairs} "
            f"training pairs; fine-tuning steps after pruning: {a.finetune_steps}",
            "",
            *lines,
        ]
    )
    md, raw = output_paths("prune_tradeoff", cpu_kind(), a.quick)
    write_json(
        raw,
        {
            "machine": m,
            "command": command_line(),
            "rows": rows,
            "speed": speed,
            "removed": {k: [list(x) for x in v] for k, v in removed.items()},
            "importance": importance.tolist(),
        },
    )
    update_block(md.with_name("heads.md") if a.quick else HEADS_MD, "prune", body)
    print(body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
