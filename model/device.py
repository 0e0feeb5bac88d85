"""Device and precision, resolved from what the machine has: the one rule for the server, the bulk
commands and evaluation alike. torch is imported only where a device other than the CPU must be asked
about, so that a process which only plans where models run (the HTTP server) need not load it."""

from __future__ import annotations

import glob
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="ignore") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return frozenset()
    return frozenset(line.partition(":")[2].split())


def cpu_has_native_bf16() -> bool:
    """True on CPUs with bfloat16 matmul instructions (AVX512-BF16 or AMX), where bfloat16 is fast."""
    return not cpu_flags().isdisjoint({"avx512_bf16", "amx_bf16"})


# oneDNN's ISA caps (`ONEDNN_MAX_CPU_ISA`, older `DNNL_MAX_CPU_ISA`) below AVX512_CORE_BF16: capped to one of
# these, oneDNN has no bfloat16 matmul instructions and emulates them (measured on Zen 4 with the cap at
# AVX2: a bf16 FFN linear at 5.5 GFLOP/s against 200 uncapped, 42 in float32; docs/benchmarks.md).
ONEDNN_CAPS_WITHOUT_BF16 = frozenset(
    {
        "SSE41",
        "AVX",
        "AVX2",
        "AVX2_VNNI",
        "AVX2_VNNI_2",
        "AVX512_CORE",
        "AVX512_CORE_VNNI",
        "AVX512_MIC",
        "AVX512_MIC_4OPS",
    }
)


def bf16_capped() -> str | None:
    """Why bfloat16 would be emulated although the CPU has the instructions, or None: oneDNN capped below
    AVX512_CORE_BF16 by its environment variable (read once, when oneDNN starts: the model process inherits
    it), or ATen's kernels capped below AVX512 (`ATEN_CPU_CAPABILITY`, what
    `torch.backends.cpu.get_cpu_capability()` reports; asked of torch only where it is already loaded)."""
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        cap = os.environ.get(var, "").strip().upper()
        if cap in ONEDNN_CAPS_WITHOUT_BF16:
            return f"{var}={cap}"
    if "torch" in sys.modules:
        aten = sys.modules["torch"].backends.cpu.get_cpu_capability()
    else:
        aten = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().upper()
    if aten in ("DEFAULT", "AVX2", "ZVECTOR", "VSX"):
        return f"ATen CPU capability {aten}"
    return None


def cpu_runs_bf16_natively() -> bool:
    """bfloat16 instructions on the CPU and neither oneDNN nor ATen capped below them."""
    return cpu_has_native_bf16() and bf16_capped() is None


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
    """`auto`: float16 on cuda; on cpu bfloat16 where the CPU has bfloat16 instructions and oneDNN may use
    them (measured ~2.7x float32 with the predicted level unchanged on >99% of dev pairs,
    docs/benchmarks.md), else float32 (bfloat16 is emulated, 10-40x slower, on AVX2-only CPUs and under an
    ISA cap, `bf16_capped`). Any other value is kept."""
    if dtype != "auto":
        return dtype
    if str(device).startswith("cuda"):
        return "float16"
    return "bfloat16" if cpu_runs_bf16_natively() else "float32"
