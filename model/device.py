"""Device and precision, resolved from what the machine has: the one rule for the server, the bulk
commands and evaluation alike."""

from __future__ import annotations

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


def resolve_dtype(dtype: str, device: torch.device) -> str:
    """`auto`: float16 on cuda; on cpu bfloat16 where the CPU has bfloat16 instructions (measured ~2.7x
    float32 with the predicted level unchanged on >99% of dev pairs, docs/benchmarks.md), else float32
    (bfloat16 is emulated, ~20x slower, on AVX2-only CPUs). Any other value is kept."""
    if dtype != "auto":
        return dtype
    if device.type == "cuda":
        return "float16"
    return "bfloat16" if cpu_has_native_bf16() else "float32"
