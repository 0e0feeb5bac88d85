"""Settings: environment, CLI flags, consistency checks."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from service.cli import main
from service.settings import Settings


def test_every_field_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("QTREL_MAX_BATCH_TOKENS", "4096")
    monkeypatch.setenv("QTREL_MAX_WAIT_MS", "7.5")
    monkeypatch.setenv("QTREL_LOG_JSON", "false")
    monkeypatch.setenv("QTREL_MODEL", "/models/x")
    s = Settings()
    assert s.max_batch_tokens == 4096 and s.max_wait_ms == 7.5 and s.log_json is False and s.model == "/models/x"


def test_settings_are_frozen_and_checked():
    s = Settings()
    with pytest.raises(ValidationError):
        s.port = 1  # type: ignore[misc]
    with pytest.raises(ValidationError, match="max_batch_tokens"):
        Settings(max_batch_tokens=64, max_length=128)
    with pytest.raises(ValidationError, match="max_pairs_per_request"):
        Settings(max_pairs_per_request=100, max_queue_pairs=10)
    with pytest.raises(ValidationError):
        Settings(dtype="float64")


def test_cli_rejects_bad_settings_cleanly(capsys):
    assert main(["serve", "--max-batch-tokens", "not-a-number"]) == 2
    assert "invalid settings" in capsys.readouterr().err


def test_cli_flags_cover_every_setting(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = capsys.readouterr().out
    for name in Settings.model_fields:
        assert "--" + name.replace("_", "-") in text, name


def test_auto_dtype_follows_the_device_and_cpu(monkeypatch):
    import torch

    import service.runtime as engine

    auto = Settings(dtype="auto")
    assert engine.resolve_dtype(auto, torch.device("cuda")) == "float16"
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: True)
    assert engine.resolve_dtype(auto, torch.device("cpu")) == "bfloat16"
    monkeypatch.setattr(engine, "cpu_has_native_bf16", lambda: False)
    assert engine.resolve_dtype(auto, torch.device("cpu")) == "float32"
    assert engine.resolve_dtype(Settings(dtype="int8"), torch.device("cpu")) == "int8"


# --- where the model runs: processes x threads --------------------------------------------------
@pytest.mark.parametrize(
    ("env", "cores", "want"),
    [
        ({}, 2, (2, 1)),  # small cpu: one single-thread process per core
        ({}, 4, (4, 1)),
        ({}, 16, (4, 4)),  # larger: 4 threads each keeps one batch's latency low
        ({"threads": 2}, 2, (1, 2)),
        ({"replicas": 1}, 2, (1, 2)),
        ({"replicas": 3, "threads": 2}, 2, (3, 2)),  # explicit values win
        ({"worker": "thread"}, 8, (1, 0)),
    ],
)
def test_worker_layout(env, cores, want):
    import torch

    from service.runtime import resolve_layout

    assert resolve_layout(Settings(**env), torch.device("cpu"), cores) == want


def test_worker_layout_on_cuda_is_one_process():
    import torch

    from service.runtime import resolve_layout

    assert resolve_layout(Settings(), torch.device("cuda"), 16) == (1, 0)


def test_cgroup_cpu_quota_is_read(tmp_path):
    from service.runtime import cgroup_cpu_limit

    assert cgroup_cpu_limit(tmp_path) is None  # no cgroup files: no limit
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_limit(tmp_path) is None
    (tmp_path / "cpu.max").write_text("250000 100000\n")
    assert cgroup_cpu_limit(tmp_path) == 2.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("200000\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_limit(v1) == 2.0


def test_model_names_resolve_to_directories(tmp_path):
    from service.runtime import default_model_dir, resolve_model_dir

    assert resolve_model_dir(Settings()) == default_model_dir("default")
    assert resolve_model_dir(Settings(model="builtin:default")) == default_model_dir("default")
    assert resolve_model_dir(Settings(model="builtin:pruned")) == default_model_dir("pruned")
    assert (default_model_dir("pruned") / "config.json").is_file()
    assert resolve_model_dir(Settings(model=str(tmp_path))) == tmp_path
    with pytest.raises(FileNotFoundError, match="no built-in model 'tiny'"):
        resolve_model_dir(Settings(model="builtin:tiny"))


def test_serve_refuses_an_unknown_built_in_model(capsys):
    assert main(["serve", "--model", "builtin:tiny"]) == 2
    assert "no built-in model 'tiny'" in capsys.readouterr().err
