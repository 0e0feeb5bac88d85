"""Every maintained benchmark runs end to end in its --quick mode: a tiny random checkpoint, a few dev pairs,
phases of a second, the same code paths as a full run; systems that are absent here (Infinity, ONNX Runtime,
a GPU) are noted as not measured. Each writes its table and raw JSON to a scratch folder, never into docs/."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import DATA, ROOT, shared_data

BENCH = ROOT / "bench"
# script (and scenario) -> the table it publishes (None: it prints its result)
RUNS: dict[str, str | None] = {
    "model_speed.py": "model_speed",
    "anchors.py": "anchors-2threads",
    "batch_ab.py": "batch_ab-1thread",
    "bulk_speed.py": "bulk_speed",
    "load.py": "load",
    "served_cost.py": "served_cost",
    "memory.py --systems template": "memory",
    "windows_cost.py": "windows_cost",
    "service_ab.py": None,
    "code_ab.py": None,
    "prune_tradeoff.py": None,
    "gpu_check.py": None,
    "stress.py overload": None,
    "stress.py killstorm": None,
    "stress.py reload": None,
    "stress.py goodput": None,
    "fronts.py": None,
    "core_ceiling.py": None,
    "jobs.py": None,
    "arch_speed.py": None,
    "zh_speed.py": None,
}
# imported by the others, run through stress.py: no --quick of their own
HELPERS = {"storm.py", "reload.py", "goodput.py"}


def test_every_maintained_script_has_a_quick_run():
    scripts = {p.name for p in BENCH.glob("*.py")}
    covered = {run.split()[0] for run in RUNS} | HELPERS
    assert scripts == covered, f"give each new benchmark a --quick run here: {sorted(scripts ^ covered)}"


# The quick runs mostly wait on the servers and model processes they start: a few at once take about half the
# suite time of one after another on two cores (each run has its own scratch folder and free ports).
AT_ONCE = 3


def _run(run: str, out: Path) -> subprocess.CompletedProcess:
    script, *args = run.split()
    env = os.environ | {"PYTHONPATH": str(ROOT), "QTREL_BENCH_QUICK_DIR": str(out)}
    return subprocess.run(
        [sys.executable, str(BENCH / script), *args, "--quick"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )


@pytest.fixture(scope="module")
def started(request, tmp_path_factory):
    """The selected quick runs, started AT_ONCE at a time in the order of their tests: run -> (future, folder)."""
    items = request.session.items
    chosen = [it.callspec.params["run"] for it in items if getattr(it, "originalname", "") == "test_quick"]
    if not (DATA / "homedepot" / "dev.csv").exists():
        chosen = []  # each test skips (shared_data)
    out: dict[str, tuple[Future, Path]] = {}
    with ThreadPoolExecutor(AT_ONCE) as pool:
        for i, run in enumerate(chosen):
            folder = tmp_path_factory.mktemp(f"quick{i}")
            out[run] = (pool.submit(_run, run, folder), folder)
        yield out
        for future, _ in out.values():
            future.cancel()  # runs not started yet (a test stopped the session early); the started ones end


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", RUNS)
def test_quick(run: str, started):
    shared_data("homedepot", "dev.csv")
    future, tmp_path = started[run]
    done = future.result()
    assert done.returncode == 0, (
        f"{run} --quick exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    )
    table = RUNS[run]
    if table is None:
        return
    raw = list(tmp_path.glob(f"*/{table}.json"))
    assert len(raw) == 1, f"{run}: no raw result under {tmp_path}"
    assert json.loads(raw[0].read_text())["benchmark"] == table
    kind = raw[0].parent.name
    text = (tmp_path / "benchmarks.md").read_text()
    assert f"<!-- bench:{table}:{kind}:start -->" in text and f"<!-- bench:{table}:{kind}:end -->" in text
