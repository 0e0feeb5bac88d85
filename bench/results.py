"""Where benchmark results go: raw JSON under docs/bench/ and one owned section of docs/benchmarks.md.

Each benchmark owns the text between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->` and
rewrites only that; everything else in the file is left as it is. The machine and the exact command
line are recorded with every result.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
RAW = ROOT / "docs" / "bench"
DEV = ROOT.parent / "shared" / "data" / "homedepot" / "dev.csv"
QUICK_DIR = Path("/tmp/qtrel-bench-quick")  # --quick writes here, never over the real results


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict:
    import torch

    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def command_line() -> str:
    return shlex.join(["python", *sys.argv])


def machine_lines(m: dict, command: str) -> list[str]:
    return [
        f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} with "
        f"{m['torch_threads']} threads, Python {m['python']}, {m['date']}",
        f"- command: `{command}`",
    ]


def output_paths(name: str, quick: bool) -> tuple[Path, Path]:
    """(markdown file, JSON file) for a benchmark; --quick runs go to a scratch directory."""
    if quick:
        return QUICK_DIR / "benchmarks.md", QUICK_DIR / f"{name}.json"
    return DOCS, RAW / f"{name}.json"


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def update_section(path: Path, name: str, body: str) -> None:
    """Replace the text between this benchmark's markers (append the section if it is not there)."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    rx = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if rx.search(text):
        text = rx.sub(lambda _: block, text, count=1)
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def publish(name: str, key: str, report: dict, text: str, quick: bool) -> tuple[Path, Path]:
    """`report` as `<name>-<key>.json` and `text` as the `<name>:<key>` section of the benchmarks file (a
    machine kind's slug as the key: one table per kind); the two paths written."""
    md, js = output_paths(f"{name}-{key}", quick)
    write_json(js, report)
    update_section(md, f"{name}:{key}", text)
    return md, js


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
