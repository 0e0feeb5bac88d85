#!/bin/bash
# v3i-pruned: the v3i continuation (exact-match segment ids) of model/pruned (v3-pruned60)
cd /work/main
D=docs/bench/v3-runs/match-segments
DEV=../shared/data/homedepot/dev.csv
export TOKENIZERS_PARALLELISM=false
.venv/bin/qtrel train ../shared/data/homedepot/train.csv \
  --base model/pruned --dev $DEV --out /tmp/match-runs/v3i-pruned-pruned \
  --epochs 0.75 --lr 2e-5 --warmup-ratio 0.02 --batch-size 32 --eval-every 692 --select rmse_relevance \
  --seed 62 --threads 1 --match-segments 1 --negatives 0.5 --hard-negatives 0.33 --foreign-negatives 0.2 --dev-negatives 0.25 \
  --mse-weight 0.5 --mse-target relevance --keep-evals 1 --no-progress > $D/v3i-pruned-train.log 2>&1
.venv/bin/python bench/level1_cut.py /tmp/match-runs/v3i-pruned-pruned/step-2076 --out $D/v3i-pruned-level1-cut.json > $D/v3i-pruned-level1-cut.txt 2>&1
.venv/bin/qtrel calibrate /tmp/match-runs/v3i-pruned-pruned/step-2076 $DEV --out /tmp/match-runs/v3i-pruned-pruned-cal --bias --unrelated 0.95 > $D/v3i-pruned-calibrate.json
.venv/bin/qtrel eval /tmp/match-runs/v3i-pruned-pruned-cal $DEV --negatives 0.25 --json > $D/v3i-pruned-eval.json
echo done >> $D/v3i-pruned-train.log
