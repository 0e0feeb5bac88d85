"""Static int8 on OpenVINO (model.engines.int8): the plan's calibration and selection, its file, OpenVINO's int8
kernels against the same quantisation simulated in torch, and where int8 falls back to torch."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_module
from model.engines import int8
from model.relevance import RelevanceModel, pad_batch
from tests.conftest import read_pairs

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ov():
    return pytest.importorskip("openvino")


@pytest.fixture
def checkpoint(tiny_checkpoint, tmp_path) -> Path:
    return Path(shutil.copytree(tiny_checkpoint, tmp_path / "tiny"))


def batches_of(model: RelevanceModel, pairs, size: int = 32):
    enc = model.encode(pairs)
    return [
        pad_batch(enc.input_ids[i : i + size], enc.token_type_ids[i : i + size], model.tokenizer.pad_id)
        for i in range(0, len(enc), size)
    ]


def full_plan(path: Path) -> int8.Int8Plan:
    ref = RelevanceModel.load(path, dtype="float32")
    return int8.Int8Plan(int8.calibrate(load_module(path).eval(), batches_of(ref, read_pairs(256))))


def test_calibration_covers_every_encoder_linear_and_smooths_all_but_the_ffn_output(checkpoint):
    module = load_module(checkpoint).eval()
    plan = full_plan(checkpoint)
    assert set(plan.linears) == set(int8.encoder_linears(module)) and len(plan.linears) == 12  # 2 layers x 6
    for name, p in plan.linears.items():
        assert p.lo <= 0 <= p.hi and p.lo < p.hi
        assert (p.smooth is None) == name.endswith(".down"), name
        if p.smooth is not None:
            assert len(p.smooth) == module.get_submodule(name).in_features and min(p.smooth) > 0
    # the simulated int8 model stays close to float32 (the tiny model's logits span ~2.5)
    ids, seg, mask = batches_of(RelevanceModel.load(checkpoint, dtype="float32"), read_pairs(64))[0]
    with torch.no_grad():
        want = module(ids, seg, mask)[0]
        got = int8.apply(module, plan)(ids, seg, mask)[0]
    assert (got - want).abs().max() < 0.15 and (got - want).abs().mean() < 0.04 and not torch.equal(got, want)


def test_a_plan_round_trips_through_its_file_and_refuses_another_model(checkpoint, tmp_path):
    plan = full_plan(checkpoint)
    plan.about = {"made": "now"}
    plan.save(checkpoint)
    again = int8.Int8Plan.load(checkpoint)
    assert again is not None and set(again.linears) == set(plan.linears) and again.about == {"made": "now"}
    name = "bert.layers.0.up"
    assert again.linears[name].smooth == pytest.approx(plan.linears[name].smooth, rel=1e-5)
    assert int8.Int8Plan.load(tmp_path) is None  # no file: no plan
    wrong = int8.Int8Plan({name: int8.LinearPlan(-1.0, 1.0, (1.0,) * 7)})
    with pytest.raises(ValueError, match="takes 32 inputs"):
        wrong.check(load_module(checkpoint))
    with pytest.raises(ValueError, match="not a linear layer"):
        int8.Int8Plan({"bert.pooler": int8.LinearPlan(-1.0, 1.0)}).check(load_module(checkpoint))
    (checkpoint / int8.PLAN_FILE).write_text('{"format": 1, "linears": {"x": {"lo": 1}}}')
    with pytest.raises(ValueError, match="not an int8 plan"):
        int8.Int8Plan.load(checkpoint)


def test_select_keeps_the_longest_least_harmful_prefix_that_holds_the_target():
    harm = {"a": 0.001, "b": 0.02, "c": 0.004, "d": 0.3}

    def judged_on(n: int):
        def levels_with(linears):  # each linear moves its share of the pairs: additive, deterministic
            moved = int(n * sum(harm[k] for k in linears))
            return torch.cat([torch.ones(moved, dtype=torch.long), torch.zeros(n - moved, dtype=torch.long)])

        return levels_with, torch.zeros(n, dtype=torch.long)

    plans = {k: int8.LinearPlan(-1.0, 1.0) for k in harm}
    chosen, measured = int8.select(plans, *judged_on(100_000), target=0.97)
    assert list(chosen) == ["a", "c", "b"] and measured["selection_agreement"] == pytest.approx(0.975)
    assert measured["alone"]["d"] == pytest.approx(0.7)
    # on 1,000 pairs 97.5% measured is not surely >= 97% (the lower bound is 96.7%): b stays float
    assert list(int8.select(plans, *judged_on(1000), target=0.97)[0]) == ["a", "c"]
    assert int8.select(plans, *judged_on(100_000), target=0.9999)[0] == {}


@pytest.mark.skipif(not int8.cpu_has_vnni(), reason="no VNNI: OpenVINO's int8 kernels differ from the simulation")
def test_openvino_runs_the_plan_on_int8_kernels_as_torch_simulates_it(ov, checkpoint):
    """The int8 graph OpenVINO compiles computes what the quantise-dequantise module computes in float32:
    the same integer products, so the two agree far closer than either agrees with float32 (most rows to
    float rounding; where a value sits on a rounding step, float32 noise can put it on the other side)."""
    from model.engines.openvino import OpenVINOForward

    module = load_module(checkpoint).eval()
    plan = full_plan(checkpoint)
    ref = RelevanceModel.load(checkpoint, dtype="float32")
    enc = ref.encode(read_pairs(96)[32:])
    forward = OpenVINOForward(module, "float32", 1, ref.tokenizer.pad_id, plan=plan)
    assert forward.int8_linears == 12
    got = forward.logits(enc.input_ids, enc.token_type_ids)
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids, ref.tokenizer.pad_id)
    with torch.no_grad():
        simulated = int8.apply(module, plan)(ids, seg, mask)[0]
        exact = module(ids, seg, mask)[0]
    rows = (got - simulated).abs().amax(1)
    assert (rows < 1e-4).float().mean() > 0.5, rows
    assert (got - simulated).abs().mean() < 0.25 * (simulated - exact).abs().mean()


def test_qtrel_quantize_writes_a_plan_that_int8_serves_on_openvino(ov, checkpoint, tmp_path):
    pairs = tmp_path / "pairs.csv"
    with pairs.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["query", "title"])
        w.writerows(read_pairs(400))
    cmd = [sys.executable, "-m", "service.cli", "quantize", str(checkpoint), str(pairs)]
    cmd += ["--calibration", "128", "--selection", "200", "--target", "0.95"]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["pairs"] == {"calibration": 128, "selection": 200} and report["target_agreement"] == 0.95
    plan = int8.Int8Plan.load(checkpoint)
    assert plan is not None and report["linears"] == f"{len(plan.linears)} of 12" and plan.linears
    assert plan.about["selection_agreement"] >= 0.95

    m = RelevanceModel.load(checkpoint, dtype="int8")
    m.use_inference("auto")  # no probe against torch's dynamic int8: the plan serves
    assert m.inference == "openvino" and f"{len(plan.linears)} linears static int8" in m.inference_reason
    assert (int8.NO_VNNI in m.inference_reason) == (not int8.cpu_has_vnni())
    enc = m.encode(read_pairs(8))
    assert m.logits(enc.input_ids, enc.token_type_ids).shape == (8, 5)
    assert m.describe()["inference"] == "openvino"


def test_int8_without_a_plan_stays_on_torch_and_says_why(ov, checkpoint):
    m = RelevanceModel.load(checkpoint, dtype="int8")
    m.use_inference("openvino")
    assert m.inference == "torch" and int8.PLAN_FILE in m.inference_reason and "qtrel quantize" in m.inference_reason
    (checkpoint / int8.PLAN_FILE).write_text("not json")
    m.use_inference("auto")
    assert m.inference == "torch" and "not an int8 plan" in m.inference_reason
