"""Parity with transformers, the reference, on the real MiniLM encoder with a seeded 5-level head.

Every comparison feeds the same token ids to both models, so the tokenizer and the network are checked
separately: ids against `BertTokenizerFast`, logits and attention against `BertForSequenceClassification`.
"""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from model.checkpoint import save_checkpoint
from model.relevance import RelevanceModel, pad_batch
from model.train.encoder import new_from_encoder
from tests.conftest import minilm_dir, read_pairs

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow  # loads the real MiniLM checkpoint

BATCH = 50
LOGIT_ATOL = 1e-4
ATTN_ATOL = 1e-5
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "tokenizer_config.json")


# --- fixtures: built once per module --------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """MiniLM's encoder + a head seeded with 0, written by us."""
    module, tok = new_from_encoder(minilm_dir(), seed=0)
    path = tmp_path_factory.mktemp("parity") / "minilm-head"
    save_checkpoint(module, tok, path)
    return path


@pytest.fixture(scope="module")
def ours(checkpoint) -> RelevanceModel:
    """Loaded as the service loads it: linear layers pre-packed for oneDNN where the CPU allows."""
    return RelevanceModel.load(checkpoint)


@pytest.fixture(scope="module")
def ours_unpacked(checkpoint) -> RelevanceModel:
    """Plain torch linear layers: the form that trains and saves."""
    model = RelevanceModel.load(checkpoint, onednn=False, unpadded=False)
    assert not model.onednn
    return model


@pytest.fixture(scope="module")
def both(ours, ours_unpacked) -> dict[str, RelevanceModel]:
    return {"packed": ours, "unpacked": ours_unpacked}


@pytest.fixture(scope="module")
def reference(checkpoint):
    return transformers.BertForSequenceClassification.from_pretrained(checkpoint, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def hf_tokenizer():
    return transformers.BertTokenizerFast.from_pretrained(minilm_dir())


@pytest.fixture(scope="module")
def pairs() -> list[tuple[str, str]]:
    return read_pairs(250) + read_pairs(100, "qbqtc")  # 7 batches each way: suite time, every length bucket


@pytest.fixture(scope="module")
def batches(ours, pairs) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """All pairs as padded (ids, segments, mask) batches of BATCH, sorted by length to pad little."""
    enc = ours.encode(pairs)
    order = sorted(range(len(enc)), key=enc.lengths.__getitem__)
    out = []
    for s in range(0, len(order), BATCH):
        idx = order[s : s + BATCH]
        out.append(pad_batch([enc.input_ids[i] for i in idx], [enc.token_type_ids[i] for i in idx]))
    return out


@pytest.fixture(scope="module")
def differences(both, reference, batches) -> dict[str, float]:
    """Largest absolute differences from the reference over every pair, for the packed and the unpacked
    model: logits of both attention paths, and the attention probabilities of the plain path (compared
    batch by batch, not kept: they are large). Attention rows of padding queries are left out: nothing
    reads them, and float error grows there."""
    worst = {f"{form} {what}": 0.0 for form in both for what in ("fast", "plain", "attention")}
    worst["pairs"] = 0
    with torch.inference_mode():
        for ids, seg, mask in batches:
            ref = reference(input_ids=ids, token_type_ids=seg, attention_mask=mask, output_attentions=True)
            real_rows = mask[:, None, :, None]  # (B, 1, T, 1)
            for form, model in both.items():
                fast, none = model.module(ids, seg, mask)
                plain, attentions = model.module(ids, seg, mask, output_attentions=True)
                assert none is None
                assert len(attentions) == len(ref.attentions) == 6
                worst[f"{form} fast"] = max(worst[f"{form} fast"], (fast - ref.logits).abs().max().item())
                worst[f"{form} plain"] = max(worst[f"{form} plain"], (plain - ref.logits).abs().max().item())
                for a, r in zip(attentions, ref.attentions, strict=True):
                    assert a.shape == r.shape  # (B, nh, T, T)
                    d = ((a - r) * real_rows).abs().max().item()
                    worst[f"{form} attention"] = max(worst[f"{form} attention"], d)
            worst["pairs"] += len(ids)
    return worst


def first_batch(pairs, ours, n: int = BATCH):
    enc = ours.encode(pairs[:n])
    return pad_batch(enc.input_ids, enc.token_type_ids)


# --- tokenizer ------------------------------------------------------------------------------------
def reference_encoding(hf_tokenizer, pairs, truncation: str, max_length: int):
    """The reference's ids and segment ids per pair, and how many pairs fell back. transformers refuses
    only_second when the query alone fills the budget; there we document a fall back to longest_first,
    so that is the reference for those pairs."""
    budget = max_length - 3
    query_len = [len(x) for x in hf_tokenizer([q for q, _ in pairs], add_special_tokens=False)["input_ids"]]
    fallback = [truncation == "only_second" and n >= budget for n in query_len]
    ids: list[list[int]] = [[] for _ in pairs]
    segments: list[list[int]] = [[] for _ in pairs]
    for strategy, wanted in ((truncation, False), ("longest_first", True)):
        idx = [i for i, f in enumerate(fallback) if f == wanted]
        if not idx:
            continue
        enc = hf_tokenizer(
            [pairs[i][0] for i in idx], [pairs[i][1] for i in idx], truncation=strategy, max_length=max_length
        )
        for i, x, s in zip(idx, enc["input_ids"], enc["token_type_ids"], strict=True):
            ids[i], segments[i] = x, s
    return ids, segments, sum(fallback)


@pytest.mark.parametrize(
    "truncation,max_length", [("only_second", 128), ("longest_first", 128), ("only_second", 24), ("longest_first", 24)]
)
def test_token_ids_segments_and_masks_match_reference(ours, hf_tokenizer, pairs, truncation, max_length):
    enc = ours.tokenizer.encode([q for q, _ in pairs], [t for _, t in pairs], max_length, truncation)
    ref_ids, ref_segments, fallbacks = reference_encoding(hf_tokenizer, pairs, truncation, max_length)
    assert enc.input_ids == ref_ids
    assert enc.token_type_ids == ref_segments
    padded = hf_tokenizer.pad({"input_ids": ref_ids}, return_tensors="pt")
    ids, _, mask = pad_batch(enc.input_ids, enc.token_type_ids, ours.tokenizer.pad_id)
    assert torch.equal(ids, padded["input_ids"])
    assert torch.equal(mask, padded["attention_mask"])

    full = hf_tokenizer([q for q, _ in pairs], [t for _, t in pairs])["input_ids"]
    assert enc.truncated == [len(f) > len(r) for f, r in zip(full, ref_ids, strict=True)]
    assert max(enc.lengths) <= max_length
    if max_length == 24:  # the short limit must really cut, and some Chinese queries fill it alone
        assert sum(enc.truncated) > len(pairs) // 2
        if truncation == "only_second":
            assert fallbacks > 0


def test_padded_batch_matches_reference_call(ours, hf_tokenizer, pairs):
    """Padded ids, segment ids and attention mask equal those of one padded reference call."""
    q, t = [p[0] for p in pairs], [p[1] for p in pairs]
    ref = hf_tokenizer(q, t, truncation="only_second", max_length=128, padding=True, return_tensors="pt")
    enc = ours.tokenizer.encode(q, t)
    ids, seg, mask = pad_batch(enc.input_ids, enc.token_type_ids, ours.tokenizer.pad_id)
    assert torch.equal(ids, ref["input_ids"])
    assert torch.equal(seg, ref["token_type_ids"])
    assert torch.equal(mask, ref["attention_mask"])
    assert not any(enc.truncated)  # no real pair reaches 128 tokens


def test_reference_reads_the_tokenizer_we_save(checkpoint, hf_tokenizer, pairs):
    saved = transformers.BertTokenizerFast.from_pretrained(checkpoint)
    q, t = [p[0] for p in pairs], [p[1] for p in pairs]
    kwargs = dict(truncation="longest_first", max_length=24)
    assert saved(q, t, **kwargs)["input_ids"] == hf_tokenizer(q, t, **kwargs)["input_ids"]
    assert saved.model_max_length == 128


# --- forward passes -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["packed", "unpacked"])
def test_fast_path_logits_match_reference(differences, form):
    assert differences["pairs"] == 350
    assert differences[f"{form} fast"] < LOGIT_ATOL


@pytest.mark.parametrize("form", ["packed", "unpacked"])
def test_plain_path_logits_match_reference(differences, form):
    assert differences[f"{form} plain"] < LOGIT_ATOL


@pytest.mark.parametrize("form", ["packed", "unpacked"])
def test_plain_path_attention_probabilities_match_reference(differences, form):
    assert differences[f"{form} attention"] < ATTN_ATOL


def silence_heads_in_reference(reference, heads: dict[int, list[int]]):
    """A copy of the reference whose listed heads emit zero: their value-projection rows and biases are
    zeroed, so every token's context vector for that head is 0 (transformers 5 takes no head_mask)."""
    model = copy.deepcopy(reference)
    hs = model.config.hidden_size // model.config.num_attention_heads
    with torch.no_grad():
        for layer, hh in heads.items():
            value = model.bert.encoder.layer[layer].attention.self.value
            for h in hh:
                value.weight[h * hs : (h + 1) * hs] = 0
                value.bias[h * hs : (h + 1) * hs] = 0
    return model


@pytest.fixture(scope="module")
def unmasked(reference, pairs, ours) -> torch.Tensor:
    """The reference's logits on the first batch, every head on."""
    ids, seg, mask = first_batch(pairs, ours)
    with torch.inference_mode():
        return reference(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits


@pytest.mark.parametrize(
    "heads",
    [{0: [0]}, {2: [5], 4: [0, 11]}, {3: list(range(12))}, {0: list(range(12)), 5: [3]}],
    ids=["L0H0", "L2H5+L4H0,11", "all-of-L3", "all-of-L0+L5H3"],
)
def test_head_mask_equals_reference_with_silenced_heads(both, reference, pairs, unmasked, heads):
    ids, seg, mask = first_batch(pairs, both["packed"])
    head_mask = torch.ones(6, 12)
    for layer, hh in heads.items():
        head_mask[layer, hh] = 0
    silenced = silence_heads_in_reference(reference, heads)
    with torch.inference_mode():
        want = silenced(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits
    assert (want - unmasked).abs().max() > 1e-3  # the mask matters, so the comparison means something
    for model in both.values():
        with torch.inference_mode():
            fast, _ = model.module(ids, seg, mask, head_mask)
            plain, _ = model.module(ids, seg, mask, head_mask, output_attentions=True)
        torch.testing.assert_close(fast, want, atol=LOGIT_ATOL, rtol=0)
        torch.testing.assert_close(plain, want, atol=LOGIT_ATOL, rtol=0)


# --- checkpoints across the two implementations ---------------------------------------------------
def test_transformers_loads_our_checkpoint_without_gaps(ours_unpacked, pairs, tmp_path):
    ours = ours_unpacked
    ours.save(tmp_path / "resaved")
    model, info = transformers.BertForSequenceClassification.from_pretrained(
        tmp_path / "resaved", attn_implementation="eager", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert model.config.id2label == {i: str(i + 1) for i in range(5)}
    ids, seg, mask = first_batch(pairs, ours)
    with torch.inference_mode():
        want, _ = ours.module(ids, seg, mask)
        got = model.eval()(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)


@pytest.fixture(scope="module")
def perturbed(reference, checkpoint, tmp_path_factory):
    """The reference with seeded noise on every parameter, so that any tensor a loader drops or swaps
    shows in the logits; saved by transformers (`save_pretrained`, safetensors) with the tokenizer."""
    model = copy.deepcopy(reference)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.01)
    path = tmp_path_factory.mktemp("hf") / "saved-by-transformers"
    model.save_pretrained(path)
    copy_tokenizer(checkpoint, path)
    return model, path


def copy_tokenizer(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(src / name, dst / name)


def assert_same_logits(path: Path, reference_model, pairs, ours):
    loaded = RelevanceModel.load(path)
    ids, seg, mask = first_batch(pairs, ours)
    with torch.inference_mode():
        want = reference_model(input_ids=ids, token_type_ids=seg, attention_mask=mask).logits
        got, _ = loaded.module(ids, seg, mask)
    torch.testing.assert_close(got, want, atol=LOGIT_ATOL, rtol=0)
    assert loaded.labels == ["1", "2", "3", "4", "5"]


def test_we_load_what_transformers_saves(perturbed, pairs, ours):
    model, path = perturbed
    assert (path / "model.safetensors").is_file()
    assert_same_logits(path, model, pairs, ours)


def test_pytorch_model_bin_loads_through_weights_only(perturbed, pairs, ours, tmp_path):
    model, src = perturbed
    path = tmp_path / "bin"
    copy_tokenizer(src, path)
    shutil.copy(src / "config.json", path / "config.json")
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    assert not (path / "model.safetensors").exists()
    assert_same_logits(path, model, pairs, ours)


def test_old_layernorm_names_without_bert_prefix_load(perturbed, pairs, ours, tmp_path):
    model, src = perturbed
    path = tmp_path / "old-names"
    copy_tokenizer(src, path)
    shutil.copy(src / "config.json", path / "config.json")
    state = {}
    for key, value in model.state_dict().items():
        if "LayerNorm" in key:
            key = key.replace(".weight", ".gamma").replace(".bias", ".beta")
        state[key.removeprefix("bert.")] = value.contiguous()
    assert "embeddings.LayerNorm.gamma" in state and "encoder.layer.5.output.LayerNorm.beta" in state
    save_file(state, str(path / "model.safetensors"))
    assert_same_logits(path, model, pairs, ours)
