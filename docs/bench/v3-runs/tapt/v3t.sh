#!/usr/bin/env bash
# v3t (issue 23): task-adaptive pre-training, then v3f's recipe unchanged. AMD EPYC Zen 4 (AVX512-BF16, no AMX),
# bfloat16 autocast (native here). Step 1, 2 threads: masked-LM on train.csv's own pairs, one epoch (1,845 steps).
set -euo pipefail
python bench/tapt_mlm.py ../shared/data/homedepot/train.csv --out runs/tapt --epochs 1.0 --threads 2 > runs/tapt/tapt.log 2>&1
# Step 2, 1 thread: v3f's command with --base runs/tapt; compared with v3f at the same steps (same schedule:
# 3 epochs planned, stopped by hand after the step-3000 evaluation).
qtrel train ../shared/data/homedepot/train.csv --base runs/tapt --dev ../shared/data/homedepot/dev.csv --out runs/v3t \
  --epochs 3 --lr 5e-5 --warmup-ratio 0.06 --batch-size 32 --eval-every 1000 --select rmse_relevance \
  --seed 61 --threads 1 --negatives 0.5 --hard-negatives 0.33 --foreign-negatives 0.2 --dev-negatives 0.25 \
  --mse-weight 0.5 --mse-target relevance --autocast bfloat16 --keep-evals 1 --no-progress > runs/v3t.log 2>&1
# Step 3: calibrated as v3 was, each kept step
python bench/level1_cut.py runs/v3t/step-3000
