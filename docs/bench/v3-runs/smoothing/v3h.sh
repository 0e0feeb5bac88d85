#!/bin/bash
# v3h: v3g's control (same continuation, seed, negatives, steps) with --label-smoothing 0.1
cd /work/main
D=docs/bench/v3-runs/smoothing
DEV=../shared/data/homedepot/dev.csv
export TOKENIZERS_PARALLELISM=false
.venv/bin/qtrel train ../shared/data/homedepot/train.csv \
  --base model/default --dev $DEV --out /tmp/smooth-runs/v3h \
  --epochs 0.75 --lr 2e-5 --warmup-ratio 0.02 --batch-size 32 --eval-every 692 --select rmse_relevance \
  --seed 62 --threads 1 --label-smoothing 0.1 --negatives 0.5 --hard-negatives 0.33 --foreign-negatives 0.2 --dev-negatives 0.25 \
  --mse-weight 0.5 --mse-target relevance --keep-evals 1 --no-progress > $D/v3h-train.log 2>&1
.venv/bin/python bench/level1_cut.py /tmp/smooth-runs/v3h/step-2076 --out $D/v3h-level1-cut.json > $D/v3h-level1-cut.txt 2>&1
.venv/bin/qtrel calibrate /tmp/smooth-runs/v3h/step-2076 $DEV --out /tmp/smooth-runs/v3h-cal --bias --unrelated 0.95 > $D/v3h-calibrate.json
.venv/bin/qtrel eval /tmp/smooth-runs/v3h-cal $DEV --negatives 0.25 --json > $D/v3h-eval.json
echo done >> $D/v3h-train.log
