"""What the model wings' command lines share (model/train/cli.py, model/bulk/cli.py; `qtrel`'s parser in
service/cli.py merges them): the device options and one way to fail."""

from __future__ import annotations

import argparse
import sys


def fail(a: argparse.Namespace, message: object) -> int:
    """Say why the command `a` stops, on stderr, and return its exit status (2: bad input)."""
    print(f"qtrel {a.command}: {message}", file=sys.stderr)
    return 2


def add_device_options(parser: argparse.ArgumentParser) -> None:
    """`--device` and `--dtype`, defaulting to `auto` as `qtrel serve` does, for the model commands."""
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        help="auto: as `qtrel serve` (float16 on cuda; bfloat16 on CPUs with AVX512-BF16 or AMX unless "
        "ONEDNN_MAX_CPU_ISA caps oneDNN below them, else float32). int8: dynamic quantisation, measured to "
        "change the level of ~17%% of dev pairs (docs/benchmarks.md)",
    )
