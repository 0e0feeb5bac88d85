"""The tree is lint-clean, formatted and type-checks: ruff check, ruff format --check, mypy (pyproject.toml).

Each runs the virtual environment's own executable (the one beside this Python), so the versions are
those that `pip install -e '.[test]'` installed; a test skips when its tool is not installed.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINTED = ["model", "service", "tests", "bench", "lab"]  # lab/ is linted, never run or typed


def tool(name: str) -> str:
    """The venv's executable (bin/ or Scripts/ beside sys.executable), else one on PATH, else skip."""
    here = Path(sys.executable).parent / name
    found = str(here) if here.is_file() else shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed: pip install -e '.[test]'")
    return found


def run(*cmd: str, timeout: float = 600) -> None:
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(cmd)} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"


def test_ruff_check():
    run(tool("ruff"), "check", *LINTED)


def test_ruff_format():
    run(tool("ruff"), "format", "--check", *LINTED)


@pytest.mark.timeout(900)
def test_mypy():
    # packages and strictness come from [tool.mypy] in pyproject.toml
    run(tool("mypy"))
