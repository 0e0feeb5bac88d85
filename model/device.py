"""Device and precision, resolved from what the machine has: the one rule for the server, the bulk
commands and evaluation alike. torch is imported only where a device other than the CPU must be asked
about, so that a process which only plans where models run (the HTTP server) need not load it."""

from __future__ import annotations

import glob
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bfloat16 matmul instructions (AVX512-BF16 or AMX), where bfloat16 is fast."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            flags = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return False
    return " avx512_bf16" in flags or " amx_bf16" in flags


def resolve_device(device: str) -> torch.device:
    import torch

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unsupported device {device!r} (cpu, cuda, cuda:N, auto)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' requested but CUDA is not available")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device!r} (cpu, cuda, auto)")
    return dev


def resolve_device_name(device: str) -> str:
    """`resolve_device` as a name ("cpu", "cuda", "cuda:1"). "cpu", and "auto" on a machine without an
    NVIDIA device node (where CUDA cannot be available), are answered without importing torch."""
    if device == "cpu" or (device == "auto" and not glob.glob("/dev/nvidia[0-9]*")):
        return "cpu"
    return str(resolve_device(device))


def resolve_dtype(dtype: str, device: torch.device | str) -> str:
    """`auto`: float16 on cuda; on cpu bfloat16 where the CPU has bfloat16 instructions (measured ~2.7x
    float32 with the predicted level unchanged on >99% of dev pairs, docs/benchmarks.md), else float32
    (bfloat16 is emulated, ~20x slower, on AVX2-only CPUs). Any other value is kept."""
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda"):
        return "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"


def add_device_options(parser) -> None:
    """`--device` and `--dtype`, defaulting to `auto` as `qtrel serve` does, for the model commands."""
    parser.add_argument("--device", default="auto", help="cpu, cuda or auto (cuda when there is one)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "int8"],
        help="auto: as `qtrel serve` (float16 on cuda; bfloat16 on CPUs with AVX512-BF16 or AMX, else float32)",
    )
