"""`qtrel export`: float16 storage under a model id, loaded back as float32."""

from __future__ import annotations

import json

import torch

from model.relevance import RelevanceModel
from service.cli import main
from tests.conftest import read_pairs


def test_export_float16_with_model_id(tiny_checkpoint, tmp_path):
    out = tmp_path / "exported"
    assert main(["export", str(tiny_checkpoint), str(out), "--model-id", "tiny-v1"]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["qtrel_model_id"] == "tiny-v1" and cfg["torch_dtype"] == "float16"
    size = (out / "model.safetensors").stat().st_size
    assert size < 0.55 * (tiny_checkpoint / "model.safetensors").stat().st_size
    a, b = RelevanceModel.load(tiny_checkpoint), RelevanceModel.load(out)
    assert b.name == "tiny-v1"
    enc = a.encode(read_pairs(20))
    pa, pb = a.probs(enc.input_ids, enc.token_type_ids), b.probs(enc.input_ids, enc.token_type_ids)
    assert torch.allclose(pa, pb, atol=5e-3)  # only the weights' storage was rounded


def test_export_of_a_missing_checkpoint_fails_cleanly(tmp_path, capsys):
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "out")]) == 2
    assert "not a directory" in capsys.readouterr().err
