"""Infinity (michaelfeil/infinity, `infinity_emb v2`) as the same-run serving anchor of `bench/load.py`.

Infinity is installed in its own virtual environment (its pins clash with qtrel's), found by
`--infinity PATH`, `$QTREL_BENCH_INFINITY` or `/work/venv-infinity/bin/infinity_emb`:

  python3 -m venv /work/venv-infinity && /work/venv-infinity/bin/pip install torch==2.13.0 'infinity-emb[server,torch]'

It serves the same encoder offline (no hub downloads): a copy of the checkpoint with a one-output head
(the level-5 row of qtrel's 5-level head), because Infinity's reranker, sentence-transformers'
CrossEncoder, returns one score per pair. The encoder, tokenizer and lengths are the same, so the
forward work per pair is the same up to the 5x384 head. Requests go to its `/rerank` route, one query
and one document each, in the precision qtrel serves (`--dtype`).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

DEFAULT_EXE = Path("/work/venv-infinity/bin/infinity_emb")
SERVED_NAME = "qtrel-anchor"


def find_infinity(path: str | None) -> Path | None:
    for cand in (path, os.environ.get("QTREL_BENCH_INFINITY"), str(DEFAULT_EXE), shutil.which("infinity_emb")):
        if cand and Path(cand).is_file() and os.access(cand, os.X_OK):
            return Path(cand)
    return None


def version(exe: Path) -> str:
    py = exe.with_name("python")
    code = "import importlib.metadata as m; print(m.version('infinity_emb'), m.version('torch'))"
    try:
        out = subprocess.run([str(py), "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return "?"
    inf, torch = out.split()
    return f"infinity_emb {inf}, torch {torch}"


def one_output_checkpoint(model_dir: Path, out: Path) -> Path:
    """`model_dir` as a one-label BertForSequenceClassification (head: the last level's row), in `out`.
    Run with Infinity's Python (it has torch and safetensors) so that this process needs neither."""
    code = r"""
import json, shutil, sys
from pathlib import Path
from safetensors.torch import load_file, save_file
src, dst = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(src, dst)
cfg = json.loads((dst / "config.json").read_text())
cfg = {k: v for k, v in cfg.items() if not k.startswith("qtrel_")}
cfg.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
(dst / "config.json").write_text(json.dumps(cfg, indent=1))
sd = load_file(dst / "model.safetensors")
for k in ("classifier.weight", "classifier.bias"):
    sd[k] = sd[k][-1:].clone()
save_file({k: v.contiguous() for k, v in sd.items()}, dst / "model.safetensors", metadata={"format": "pt"})
"""
    return _run_in(out, code, model_dir)


def _run_in(out: Path, code: str, model_dir: Path) -> Path:
    exe = find_infinity(None)
    py = exe.with_name("python") if exe else Path("python3")
    subprocess.run([str(py), "-c", code, str(model_dir), str(out)], check=True, timeout=120)
    return out


def command(exe: Path, model_dir: Path, port: int, dtype: str, batch_size: int = 32) -> list[str]:
    return [
        str(exe),
        "v2",
        "--model-id",
        str(model_dir),
        "--served-model-name",
        SERVED_NAME,
        "--engine",
        "torch",
        "--device",
        "cpu",
        "--dtype",
        dtype,
        "--batch-size",
        str(batch_size),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-bettertransformer",
        "--log-level",
        "warning",
    ]


def env(threads: int) -> dict[str, str]:
    """Offline (no hub, no telemetry), `threads` torch threads."""
    return {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "INFINITY_ANONYMOUS_USAGE_STATS": "0",
        "DO_NOT_TRACK": "1",
        "OMP_NUM_THREADS": str(threads),
    }


def rerank_bodies(pairs: list[tuple[str, str]]) -> list[tuple[bytes, int]]:
    return [(json.dumps({"model": SERVED_NAME, "query": q, "documents": [t]}).encode(), 1) for q, t in pairs]
