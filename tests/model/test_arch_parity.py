"""Parity of each architecture with `transformers`, on small random checkpoints that transformers builds and
saves itself: float32 logits within 1e-5 on the plain path and on the path the model serves on (the packed,
oneDNN, fused-kernel path for the BERT-shaped ones), bfloat16 levels at least 99.5% equal on 300 random
pairs, strict loading that names every missing, unexpected or mis-shaped tensor, and checkpoints we save
that transformers reads without a gap."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_network, save_checkpoint
from model.relevance import RelevanceModel
from model.tokenizer import PairTokenizer
from tests.model.arch_fixtures import build_reference, padded, random_pairs

transformers = pytest.importorskip("transformers")

LOGIT_ATOL = 1e-5
BF16_NOISE = 0.05  # logits of unit spread: bfloat16 keeps 8 bits (~0.004 a logit of 1) at each of many steps
PAIRS = 300
# (architecture, classes of its head): the rerankers' one logit, QBQTC's 3 levels, the default 5
CASES = [
    ("xlm-roberta", 1),
    ("xlm-roberta", 5),
    ("electra", 3),
    ("distilbert", 5),
    ("modernbert", 1),
    ("modernbert", 5),
    ("modernbert-mean", 3),  # mean pooling over the pair's tokens
]
IDS = [f"{a}-{k}" for a, k in CASES]
FAST = {"xlm-roberta", "electra", "distilbert", "modernbert", "modernbert-mean"}


def reference_logits(ref, name: str, ids, segs, **kw):
    """The reference's output on padded pairs (ELECTRA with our segments; the others have one or none)."""
    x, mask = padded(ids, ref.config.pad_token_id)
    if name == "electra":
        kw["token_type_ids"] = padded(segs, 0)[0]
    with torch.inference_mode():
        return ref(input_ids=x, attention_mask=mask, **kw)


@pytest.fixture(scope="module", params=CASES, ids=IDS)
def case(request, tmp_path_factory):
    name, k = request.param
    path = tmp_path_factory.mktemp("arch") / f"{name}-{k}"
    ref = build_reference(name, path, k)
    ids, segs = random_pairs(PAIRS)
    parts = [reference_logits(ref, name, ids[s : s + 100], segs[s : s + 100]).logits for s in range(0, PAIRS, 100)]
    return name, path, ref, ids, segs, torch.cat(parts)


def served(path: Path, dtype: str = "float32") -> RelevanceModel:
    return RelevanceModel.load(path, dtype=dtype)


def test_plain_path_logits_and_attention_match(case):
    name, path, ref, ids, segs, want = case
    module = load_network(path).eval()
    x, mask = padded(ids[:60], ref.config.pad_token_id)
    seg = padded(segs[:60], 0)[0]
    with torch.inference_mode():
        fast, _ = module(x, seg, mask)
        plain, probs = module(x, seg, mask, output_attentions=True)
    r = reference_logits(ref, name, ids[:60], segs[:60], output_attentions=True)
    torch.testing.assert_close(fast, want[:60], atol=LOGIT_ATOL, rtol=0)
    torch.testing.assert_close(plain, want[:60], atol=LOGIT_ATOL, rtol=0)
    assert probs is not None and len(probs) == len(r.attentions)
    rows = mask[:, None, :, None].bool()  # padding queries' rows are read by nothing
    for a, b in zip(probs, r.attentions, strict=True):
        assert (a - b).masked_fill(~rows, 0).abs().max() < 1e-5


def test_served_path_logits_match_in_float32(case):
    name, path, _, ids, segs, want = case
    model = served(path)
    assert model.arch.fast == (name in FAST)
    assert model.describe()["path"].startswith("fast" if name in FAST else "plain")
    got = model.logits(ids, segs, raw=True)
    assert (got - want).abs().max() <= LOGIT_ATOL


def margin(level_logits: torch.Tensor) -> torch.Tensor:
    """Per pair, how far the reference's level is from its runner-up (top-two logit gap)."""
    top = level_logits.topk(2, dim=-1).values
    return top[:, 0] - top[:, 1]


def test_bfloat16_levels_agree(case):
    """On random weights a share of pairs sits within bfloat16's rounding of a level boundary (transformers'
    own bfloat16 forward moves 1-2% of them too): the levels must agree on 99.5% of the pairs clear of one
    (a top-two gap over BF16_NOISE), and overall as often as transformers' own bfloat16 forward, within a point."""
    name, path, ref, ids, segs, want = case
    model = served(path, "bfloat16")
    ours = model.score(model.logits(ids, segs)).level
    theirs = model.score(model.head.level_logits(want)).level
    assert len(set(theirs.tolist())) > 1  # the levels vary, so agreement means something
    half = reference_logits(copy.deepcopy(ref).to(torch.bfloat16), name, ids, segs).logits.float()
    hf_agree = (model.score(model.head.level_logits(half)).level == theirs).double().mean().item()
    clear = margin(model.head.level_logits(want)) > BF16_NOISE
    assert clear.sum() >= 0.8 * PAIRS
    agree = (ours == theirs)[clear].double().mean().item()
    assert agree >= 0.995, f"{name}: {agree:.3%} of the levels clear of a boundary agree"
    overall = (ours == theirs).double().mean().item()
    assert overall >= hf_agree - 0.01, f"{name}: {overall:.3%} agree, transformers' bfloat16 {hf_agree:.3%}"


def test_one_logit_heads_score_its_sigmoid(case):
    name, path, _, ids, segs, want = case
    model = served(path)
    scored = model.score(model.logits(ids, segs))
    if want.shape[1] == 1:
        assert model.labels == ["0", "1"] and model.head.kind == "logit"
        torch.testing.assert_close(scored.expected, torch.sigmoid(want[:, 0]), atol=1e-5, rtol=0)
        assert torch.equal(scored.level, (want[:, 0] > 0).long())
    else:
        assert model.head.kind == "levels" and len(model.labels) == want.shape[1]


def test_transformers_reads_what_we_save(case, tmp_path):
    name, path, ref, ids, segs, want = case
    module = load_network(path).eval()
    save_checkpoint(module, PairTokenizer.from_dir(path), tmp_path / "ours")
    back, info = type(ref).from_pretrained(tmp_path / "ours", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    got = reference_logits(back.eval(), name, ids[:20], segs[:20]).logits
    torch.testing.assert_close(got, want[:20], atol=LOGIT_ATOL, rtol=0)
    assert load_network(tmp_path / "ours").cfg == module.cfg


def test_loading_names_every_missing_unexpected_and_misshaped_tensor(case, tmp_path):
    _, path, _, _, _, _ = case
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    state = load_file(str(bad / "model.safetensors"))
    names = sorted(k for k in state if ".1." in k)  # in the second layer: the head's layout stays whole
    gone, reshaped = names[0], names[-1]
    del state[gone]
    state[reshaped] = torch.zeros(3, 3)
    state["surplus.weight"] = torch.zeros(1)
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_network(bad)
    assert "surplus.weight" in str(e.value)
    state.pop("surplus.weight")
    save_file(state, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as e:
        load_network(bad)
    assert f"missing: {gone}" in str(e.value) and f"wrong shape: {reshaped}" in str(e.value)


def test_unsupported_model_type_is_named(tmp_path, case):
    _, path, _, _, _, _ = case
    bad = tmp_path / "gpt"
    shutil.copytree(path, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported"):
        load_network(bad)
