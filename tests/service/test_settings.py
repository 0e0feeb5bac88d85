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


def test_serve_refuses_an_unknown_built_in_model(capsys):
    assert main(["serve", "--model", "builtin:tiny"]) == 2
    assert "no built-in model 'tiny'" in capsys.readouterr().err


def test_batch_timeout_comes_from_the_environment_and_must_be_positive(monkeypatch):
    assert Settings().batch_timeout_s == 30.0
    monkeypatch.setenv("QTREL_BATCH_TIMEOUT_S", "2.5")
    assert Settings().batch_timeout_s == 2.5
    with pytest.raises(ValidationError):
        Settings(batch_timeout_s=0)


def test_several_models_come_from_the_environment_and_are_checked(monkeypatch):
    from service.runtime.models import entries_of
    from service.settings import ModelEntry

    monkeypatch.setenv("QTREL_MODELS", "a=builtin:default, b=builtin:pruned")
    assert entries_of(Settings()) == [ModelEntry("a", "builtin:default"), ModelEntry("b", "builtin:pruned")]
    assert entries_of(Settings(models="")) == [ModelEntry(None, None)]  # the one model of `model`, as before
    assert entries_of(Settings(models="", model="/m/x=y")) == [ModelEntry(None, "/m/x=y")]  # a bare path with "="
    for bad, why in (("a=p,a=q", "distinct"), ("a=p,/models/q", "each needs a name"), ("a=", "no path")):
        with pytest.raises(ValidationError, match=why):
            Settings(models=bad)
    with pytest.raises(ValidationError, match="shadow needs its own name"):
        Settings(models="a=p", shadow="a=q")
    with pytest.raises(ValidationError, match="not both"):
        Settings(model="builtin:pruned")  # QTREL_MODELS is set too: which to serve is unclear


def test_the_model_flag_replaces_the_models_of_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("QTREL_MODELS", "a=builtin:from-env")
    assert main(["serve", "--model", "builtin:from-flag"]) == 2
    assert "no built-in model 'from-flag'" in capsys.readouterr().err
    monkeypatch.setenv("QTREL_MODEL", "builtin:from-env")
    monkeypatch.delenv("QTREL_MODELS")
    assert main(["serve", "--model", "a=builtin:default", "--model", "b=builtin:from-flag"]) == 2
    assert "no built-in model 'from-flag'" in capsys.readouterr().err


def test_serve_takes_model_several_times(capsys):
    assert main(["serve", "--model", "a=builtin:default", "--model", "b=builtin:nope"]) == 2
    assert "no built-in model 'nope'" in capsys.readouterr().err
    assert main(["serve", "--model", "a=builtin:default", "--model", "a=builtin:pruned"]) == 2
    assert "distinct" in capsys.readouterr().err
