"""Device and precision resolution (model.device) and the built-in model names (model.builtin)."""

from __future__ import annotations

import pytest
import torch

import model.device as device
from model.builtin import builtin_dir, resolve_model


def test_auto_dtype_follows_the_device_and_cpu(monkeypatch):
    assert device.resolve_dtype("auto", torch.device("cuda")) == "float16"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: True)
    assert device.resolve_dtype("auto", torch.device("cpu")) == "bfloat16"
    monkeypatch.setattr(device, "cpu_has_native_bf16", lambda: False)
    assert device.resolve_dtype("auto", torch.device("cpu")) == "float32"
    assert device.resolve_dtype("int8", torch.device("cpu")) == "int8"


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
