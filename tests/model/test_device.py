"""Device and precision resolution (model.device) and the built-in model names (model.builtin)."""

from __future__ import annotations

import pytest
import torch

import model.device as device
from model.builtin import builtin_dir, resolve_model


def uncapped(monkeypatch) -> None:
    for var in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(device, "bf16_capped", lambda: None)


def test_auto_dtype_follows_the_device_and_cpu(monkeypatch):
    uncapped(monkeypatch)
    assert device.resolve_dtype("auto", torch.device("cuda")) == "float16"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.resolve_dtype("auto", torch.device("cpu")) == "bfloat16"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert device.resolve_dtype("int8", torch.device("cpu")) == "int8"


@pytest.mark.parametrize(
    "var,cap,why",
    [
        ("ONEDNN_MAX_CPU_ISA", "AVX2", "ONEDNN_MAX_CPU_ISA=AVX2"),
        ("ONEDNN_MAX_CPU_ISA", "avx512_core_vnni", "ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI"),
        ("DNNL_MAX_CPU_ISA", "AVX2_VNNI", "DNNL_MAX_CPU_ISA=AVX2_VNNI"),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16", None),
        ("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX", None),
        ("ONEDNN_MAX_CPU_ISA", "ALL", None),
    ],
)
def test_auto_is_float32_where_onednn_is_capped_below_bf16(monkeypatch, var, cap, why):
    """bfloat16 under such a cap is emulated (measured 5.5 against 200 GFLOP/s on Zen 4): auto avoids it."""
    for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setenv(var, cap)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert device.bf16_capped() == why
    assert device.resolve_dtype("auto", "cpu") == ("float32" if why else "bfloat16")
    assert device.resolve_dtype("bfloat16", "cpu") == "bfloat16"  # asked for explicitly: kept


@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_auto_is_float32_where_aten_is_capped(monkeypatch, capability):
    for v in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA"):
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert device.bf16_capped() == f"ATen CPU capability {capability}"
    assert device.resolve_dtype("auto", "cpu") == "float32"


def test_unknown_devices_are_refused():
    assert device.resolve_device("cpu").type == "cpu"
    with pytest.raises(ValueError, match="unsupported device"):
        device.resolve_device("tpu")


def test_model_names_resolve_to_directories(tmp_path):
    assert resolve_model(None) == builtin_dir("default")
    assert resolve_model("builtin:default") == builtin_dir("default")
    assert resolve_model("builtin:pruned") == builtin_dir("pruned")
    assert (builtin_dir("pruned") / "config.json").is_file()
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(FileNotFoundError, match="no built-in model 'tiny'"):
        resolve_model("builtin:tiny")
