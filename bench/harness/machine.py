"""The machine at hand: its CPU's instruction sets and kind (the key of every published table), and its
native precision."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

ISA_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def isa() -> dict[str, Any]:
    info = Path("/proc/cpuinfo").read_text(errors="ignore").splitlines()
    field = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in info[:40]) if v}
    flags = set(field.get("flags", "").split())
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        name = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "?")
    except (OSError, subprocess.CalledProcessError):
        name = field.get("model name", "?")
    fam, mod = int(field.get("cpu family", 0)), int(field.get("model", 0))
    return {
        "model_name": name,
        "vendor": field.get("vendor_id", "?"),
        "family": fam,
        "model": mod,
        "microarchitecture": microarchitecture(field.get("vendor_id", ""), fam, mod, flags),
        "flags": {f: f in flags for f in ISA_FLAGS},
    }


def microarchitecture(vendor: str, fam: int, mod: int, flags: set[str]) -> str:
    if vendor == "AuthenticAMD":
        if fam == 26:
            return "Zen 5"
        if fam == 25:
            return "Zen 4" if (0x10 <= mod <= 0x1F or 0x60 <= mod <= 0x7F or 0xA0 <= mod <= 0xAF) else "Zen 3"
        if fam == 23:
            return "Zen / Zen 2"
    if vendor == "GenuineIntel" and "amx_bf16" in flags:
        return "Sapphire Rapids or later (AMX)"
    return "unknown"


def isa_line(i: dict[str, Any]) -> str:
    flags = ", ".join(f"{f} {'yes' if v else 'no'}" for f, v in i["flags"].items())
    return (
        f"{i['model_name']} ({i['vendor']} family {i['family']} model {i['model']}, {i['microarchitecture']}): {flags}"
    )


def slug(text: str) -> str:
    """A file-name-safe tag: "Sapphire Rapids or later (AMX)" -> sapphire-rapids-or-later-amx."""
    return "-".join("".join(c if c.isalnum() else " " for c in text.lower()).split())


def slug_of(i: dict[str, Any]) -> str:
    return slug(i["microarchitecture"])


def cpu_kind() -> str:
    """This CPU's kind, the key of its tables and raw files: zen-4, zen-3, sapphire-rapids-or-later-amx..."""
    return slug_of(isa())


def gpu_kind(device_name: str) -> str:
    """A GPU's kind from its device name: "NVIDIA H200" -> nvidia-h200."""
    return slug(device_name)


def default_title(i: dict[str, Any]) -> str:
    f = i["flags"]
    bits = [
        "AVX512-BF16" if f["avx512_bf16"] else "no AVX512-BF16",
        "VNNI" if f["avx512_vnni"] else "no VNNI",
        "AMX" if f["amx_bf16"] else "no AMX",
    ]
    return f"{i['model_name']} {i['microarchitecture']} ({', '.join(bits)})"


def native_precision(i: dict[str, Any]) -> str:
    return "bfloat16" if i["flags"]["avx512_bf16"] or i["flags"]["amx_bf16"] else "float32"
