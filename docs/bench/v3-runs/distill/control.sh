#!/bin/bash
# v3g's control: the same continuation (seed, negatives, steps) without --teacher
cd /work/main
D=docs/bench/v3-runs/distill
DEV=../shared/data/homedepot/dev.csv
export TOKENIZERS_PARALLELISM=false
.venv/bin/qtrel train ../shared/data/homedepot/train.csv \
  --base model/default --dev $DEV --out /tmp/distill-runs/v3g-control \
  --epochs 0.75 --lr 2e-5 --warmup-ratio 0.02 --batch-size 32 --eval-every 692 --select rmse_relevance \
  --seed 62 --threads 2 --negatives 0.5 --hard-negatives 0.33 --foreign-negatives 0.2 --dev-negatives 0.25 \
  --mse-weight 0.5 --mse-target relevance --keep-evals 1 --no-progress > $D/control-train.log 2>&1
.venv/bin/python bench/level1_cut.py /tmp/distill-runs/v3g-control/step-2076 --out $D/control-level1-cut.json > $D/control-level1-cut.txt 2>&1
.venv/bin/qtrel calibrate /tmp/distill-runs/v3g-control/step-2076 $DEV --out /tmp/distill-runs/v3g-control-cal --bias --unrelated 0.95 > $D/control-calibrate.json
.venv/bin/qtrel eval /tmp/distill-runs/v3g-control-cal $DEV --negatives 0.25 --json > $D/control-eval.json
echo done >> $D/control-train.log
