#!/usr/bin/env bash
# The GPU check (bench/gpu_check.py) in one command on a GPU machine that has torch but not qtrel's service
# dependencies: installs the wheels carried in .whl/ where fastapi is missing, runs from the source tree
# (PYTHONPATH, no pip install of torch), and writes everything into OUT.
#   bash bench/gpu_check.sh OUT [gpu_check.py flags, e.g. --quick --device cpu for a dry run]
# The wheels, fetched beforehand where pip reaches PyPI (the machine's Python, here 3.12):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 -d .whl \
#     fastapi starlette uvicorn httptools pydantic pydantic-core pydantic-settings python-dotenv \
#     annotated-types annotated-doc typing-inspection typing-extensions opentelemetry-api
# (pinned to the versions the CPU venv has); dev pairs from .gpu/dev.csv where it exists (../shared does
# not travel to a device machine), else from ../shared.
set -euo pipefail
out=${1:?usage: bench/gpu_check.sh OUT [flags]}
shift
cd "$(dirname "$0")/.."
mkdir -p "$out"
if ! python3 -c 'import fastapi, uvicorn, pydantic_settings' 2>/dev/null && [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
dev=../shared/data/homedepot/dev.csv
if [ -f .gpu/dev.csv ]; then dev=.gpu/dev.csv; fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/nvidia-smi.txt" 2>&1 || true
python3 bench/gpu_check.py --out "$out" --dev "$dev" "$@" 2>&1 | tee "$out/gpu_check.log"
