"""Where benchmark results go: one table per benchmark and machine kind in docs/benchmarks.md, replaced on a
re-run, and the raw result beside it as docs/bench/<kind>/<benchmark>.json (the current one only).

A benchmark owns the text between `<!-- bench:NAME:KIND:start -->` and `<!-- bench:NAME:KIND:end -->`; a
re-run on the same kind of machine rewrites that block and nothing else. A new kind's block goes after the
benchmark's other kinds (or at the end of the file for a new benchmark). The machine and the exact command
line are recorded with every result. `--quick` runs write to a scratch folder, never over the real results.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs" / "benchmarks.md"
RAW = ROOT / "docs" / "bench"
# The real data (../shared/data/README.md); QTREL_TEST_DATA points the benchmarks at another copy, as it does the tests.
DATA = Path(os.environ.get("QTREL_TEST_DATA") or ROOT.parent / "shared" / "data")
DEV = DATA / "homedepot" / "dev.csv"


def quick_dir() -> Path:
    """Where --quick writes: $QTREL_BENCH_QUICK_DIR, else a folder of this user's under the temp dir."""
    given = os.environ.get("QTREL_BENCH_QUICK_DIR")
    return Path(given) if given else Path(tempfile.gettempdir()) / f"qtrel-bench-quick-{os.getuid()}"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine() -> dict[str, Any]:
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


def machine_lines(m: dict[str, Any], command: str) -> list[str]:
    return [
        f"- machine: {m['cpu']}, {m['logical_cpus']} logical CPUs, torch {m['torch']} with "
        f"{m['torch_threads']} threads, Python {m['python']}, {m['date']}",
        f"- command: `{command}`",
    ]


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def markers(name: str, kind: str) -> tuple[str, str]:
    return f"<!-- bench:{name}:{kind}:start -->", f"<!-- bench:{name}:{kind}:end -->"


def replace_section(text: str, name: str, kind: str, body: str) -> str:
    """`text` with the block of (name, kind) set to `body`: replaced where it is, else inserted after the
    last block of the same benchmark, else after the benchmark's place-holder `<!-- bench:NAME -->`, else
    appended."""
    start, end = markers(name, kind)
    block = f"{start}\n{body.rstrip()}\n{end}"
    rx = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if rx.search(text):
        return rx.sub(lambda _: block, text, count=1)
    same = list(re.finditer(rf"<!-- bench:{re.escape(name)}:[^:\s]+:end -->", text))
    if same:
        at = same[-1].end()
        return text[:at] + "\n\n" + block + text[at:]
    place = f"<!-- bench:{name} -->"
    if place in text:
        at = text.index(place) + len(place)
        return text[:at] + "\n\n" + block + text[at:]
    return text.rstrip() + "\n\n" + block + "\n"


def update_section(path: Path, name: str, kind: str, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text(encoding="utf-8") if path.exists() else "# Benchmarks\n"
    path.write_text(replace_section(text, name, kind, body), encoding="utf-8")


def update_block(path: Path, name: str, body: str) -> None:
    """Replace the text between `<!-- bench:NAME:start -->` and `<!-- bench:NAME:end -->` of another document
    (docs/heads.md): a table that is not per machine kind."""
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    text = path.read_text(encoding="utf-8") if path.exists() else ""
    block = f"{start}\n{body.rstrip()}\n{end}"
    rx = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = rx.sub(lambda _: block, text, count=1) if rx.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def output_paths(name: str, kind: str, quick: bool) -> tuple[Path, Path]:
    """(markdown file, JSON file) of a benchmark on a machine kind; --quick runs go to the scratch folder."""
    if quick:
        return quick_dir() / "benchmarks.md", quick_dir() / kind / f"{name}.json"
    return DOCS, RAW / kind / f"{name}.json"


def publish(name: str, report: dict[str, Any], text: str, quick: bool, kind: str | None = None) -> tuple[Path, Path]:
    """`report` as docs/bench/<kind>/<name>.json and `text` as the (name, kind) table of docs/benchmarks.md,
    each replacing the last run's; `kind` defaults to this machine's CPU kind. The two paths written."""
    from harness.machine import cpu_kind

    kind = kind or cpu_kind()
    md, js = output_paths(name, kind, quick)
    write_json(js, report | {"benchmark": name, "kind": kind})
    update_section(md, name, kind, text)
    print(f"\nwrote {js} and the {name}:{kind} table of {md}")
    return md, js


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"
