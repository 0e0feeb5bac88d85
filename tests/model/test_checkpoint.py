"""Strict checkpoint loading on the tiny checkpoint: every problem named, clear errors, heads built by seed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from model.checkpoint import CheckpointError, load_module, save_checkpoint
from model.relevance import RelevanceModel, pad_batch
from model.train.encoder import new_from_encoder
from tests.conftest import make_tiny_checkpoint, read_pairs

QUERY_BIAS = "bert.encoder.layer.1.attention.self.key.bias"  # a tensor every tiny checkpoint has


def copy_checkpoint(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_weights(path: Path, edit) -> None:
    """Rewrite model.safetensors after `edit(state)` changed the dict in place."""
    state = load_file(str(path / "model.safetensors"))
    edit(state)
    save_file(state, str(path / "model.safetensors"))


def edit_config(path: Path, **changes) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def batch(model: RelevanceModel, n: int = 8):
    enc = model.encode(read_pairs(n))
    return pad_batch(enc.input_ids, enc.token_type_ids)


@pytest.fixture
def ckpt(tiny_checkpoint, tmp_path) -> Path:
    """A private copy of the tiny checkpoint to break."""
    return copy_checkpoint(tiny_checkpoint, tmp_path / "ckpt")


# --- strict loading ---------------------------------------------------------------------------------
def test_the_tiny_checkpoint_loads(tiny_checkpoint):
    model = RelevanceModel.load(tiny_checkpoint)
    assert model.labels == ["1", "2", "3", "4", "5"]
    assert model.cfg.num_hidden_layers == 2 and model.module.bert.pooler is not None


def test_missing_tensor_is_named(ckpt):
    edit_weights(ckpt, lambda s: s.pop(QUERY_BIAS))
    with pytest.raises(CheckpointError, match=r"missing: bert\.encoder\.layer\.1\.attention\.self\.key\.bias"):
        RelevanceModel.load(ckpt)


def test_every_missing_tensor_is_named(ckpt):
    gone = ["classifier.bias", "bert.pooler.dense.bias", QUERY_BIAS]
    edit_weights(ckpt, lambda s: [s.pop(k) for k in gone])
    with pytest.raises(CheckpointError) as e:
        RelevanceModel.load(ckpt)
    for name in ("classifier.bias", "bert.pooler.dense.bias", "bert.encoder.layer.1.attention.self.key.bias"):
        assert name in str(e.value)


def test_unknown_extra_tensor_is_named(ckpt):
    extra = "bert.encoder.layer.1.attention.self.rotary.weight"
    edit_weights(ckpt, lambda s: s.update({extra: torch.zeros(4)}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensors: {extra}"):
        RelevanceModel.load(ckpt)


def test_extra_layer_is_named(ckpt):
    # A well-formed name, but for a third layer the config does not have.
    edit_weights(ckpt, lambda s: s.update({"bert.encoder.layer.2.output.dense.weight": torch.zeros(32, 64)}))
    with pytest.raises(CheckpointError, match=r"unexpected: bert\.encoder\.layer\.2\.output\.dense\.weight"):
        RelevanceModel.load(ckpt)


def test_wrong_shape_is_named_with_both_shapes(ckpt):
    def edit(s):
        s["classifier.weight"] = torch.zeros(3, 32)
        s["bert.encoder.layer.0.attention.self.query.weight"] = torch.zeros(32, 16)

    edit_weights(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        RelevanceModel.load(ckpt)
    msg = str(e.value)
    assert "classifier.weight: checkpoint (3, 32) vs model (5, 32)" in msg
    assert "bert.encoder.layer.0.attention.self.query.weight: checkpoint (32, 16) vs model (32, 32)" in msg


def test_all_problems_in_one_error(ckpt):
    def edit(s):
        s.pop(QUERY_BIAS)
        s["bert.encoder.layer.2.output.dense.bias"] = torch.zeros(32)
        s["classifier.bias"] = torch.zeros(7)

    edit_weights(ckpt, edit)
    with pytest.raises(CheckpointError) as e:
        RelevanceModel.load(ckpt)
    msg = str(e.value)
    assert "missing: bert.encoder.layer.1.attention.self.key.bias" in msg
    assert "unexpected: bert.encoder.layer.2.output.dense.bias" in msg
    assert "classifier.bias: checkpoint (7,) vs model (5,)" in msg


def test_csv_with_byte_order_mark_reads(tmp_path):
    from model.data import read_labelled

    f = tmp_path / "bom.csv"
    f.write_text("query,title,level\ndrill,cordless drill,5\n", encoding="utf-8-sig")
    ds = read_labelled(f, ["1", "2", "3", "4", "5"])
    assert ds.examples[0].query == "drill" and ds.labels == [4]


def test_position_ids_buffer_is_ignored(tiny_checkpoint, ckpt):
    # Older transformers checkpoints save this buffer; it is not a weight, and loading must not call it unexpected
    edit_weights(ckpt, lambda s: s.update({"bert.embeddings.position_ids": torch.arange(128)[None]}))
    with_buffer, plain = RelevanceModel.load(ckpt), RelevanceModel.load(tiny_checkpoint)
    ids, seg, mask = batch(plain)
    with torch.inference_mode():
        got, _ = with_buffer.module(ids, seg, mask)
        want, _ = plain.module(ids, seg, mask)
    assert torch.equal(got, want)


# --- not a checkpoint -----------------------------------------------------------------------------
def test_missing_directory(tmp_path):
    with pytest.raises(CheckpointError, match="is not a directory"):
        RelevanceModel.load(tmp_path / "nowhere")


def test_directory_that_is_not_a_checkpoint(tmp_path):
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(CheckpointError, match="is not a checkpoint: it has no config.json"):
        RelevanceModel.load(tmp_path)


def test_config_without_weights(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="has no model.safetensors or pytorch_model.bin"):
        RelevanceModel.load(ckpt)


def test_corrupt_weights(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError, match="cannot read weights"):
        RelevanceModel.load(ckpt)


def test_corrupt_config(ckpt):
    (ckpt / "config.json").write_text("{'model_type': bert")
    with pytest.raises(CheckpointError, match="cannot read"):
        RelevanceModel.load(ckpt)


def test_gpt2_config_is_refused_clearly(ckpt):
    edit_config(ckpt, model_type="gpt2")
    with pytest.raises(CheckpointError, match="model_type 'gpt2' is not supported; qtrel runs BERT"):
        RelevanceModel.load(ckpt)


def test_relative_positions_are_refused(ckpt):
    edit_config(ckpt, position_embedding_type="relative_key")
    with pytest.raises(CheckpointError, match="position_embedding_type 'relative_key' is not supported"):
        RelevanceModel.load(ckpt)


def test_vocab_size_differs_from_embeddings(ckpt):
    edit_config(ckpt, vocab_size=30000)
    with pytest.raises(CheckpointError, match="word embeddings have 30522 rows but config.vocab_size is 30000"):
        RelevanceModel.load(ckpt)


def test_tokenizer_larger_than_embeddings(tmp_path):
    # Consistent weights and config, but MiniLM's 30522-token vocabulary over a 1000-row table.
    path = make_tiny_checkpoint(tmp_path / "small-vocab", vocab_size=1000)
    with pytest.raises(CheckpointError, match="tokenizer has 30522 tokens but the model embeds only 1000"):
        RelevanceModel.load(path)


def test_pickle_in_bin_is_refused(ckpt, tmp_path):
    """pytorch_model.bin is read with weights_only: a pickled object is refused, never run."""
    flag = tmp_path / "ran"
    state = load_file(str(ckpt / "model.safetensors"))
    state["classifier.bias"] = Payload(flag)  # any non-tensor object
    (ckpt / "model.safetensors").unlink()
    torch.save(state, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="cannot read weights"):
        RelevanceModel.load(ckpt)
    assert not flag.exists()


class Payload:
    def __init__(self, flag: Path):
        self.flag = flag

    def __reduce__(self):
        return (Path.touch, (self.flag,))


def test_safetensors_is_preferred_over_bin(ckpt):
    state = load_file(str(ckpt / "model.safetensors"))
    torch.save({k: torch.zeros_like(v) for k, v in state.items()}, ckpt / "pytorch_model.bin")  # loadable, different
    model = RelevanceModel.load(ckpt)
    assert torch.equal(model.module.classifier.weight, state["classifier.weight"].float())
    assert model.module.classifier.weight.abs().sum() > 0  # not the zeros of the .bin


def test_half_precision_save_loads_as_float32(tiny_checkpoint, tmp_path):
    module = load_module(tiny_checkpoint)
    model = RelevanceModel.load(tiny_checkpoint)
    save_checkpoint(module, model.tokenizer, tmp_path / "half", dtype=torch.float16)
    assert load_file(str(tmp_path / "half" / "model.safetensors"))["classifier.weight"].dtype == torch.float16
    assert json.loads((tmp_path / "half" / "config.json").read_text())["torch_dtype"] == "float16"
    half = RelevanceModel.load(tmp_path / "half")
    assert next(half.module.parameters()).dtype == torch.float32
    ids, seg, mask = batch(model)
    with torch.inference_mode():
        want, _ = model.module(ids, seg, mask)
        got, _ = half.module(ids, seg, mask)
    torch.testing.assert_close(got, want, atol=2e-2, rtol=0)  # float16 rounding of the weights only


# --- pooler and head --------------------------------------------------------------------------------
def test_checkpoint_without_pooler_uses_the_raw_cls_vector(ckpt):
    transformers = pytest.importorskip("transformers")
    edit_weights(ckpt, lambda s: [s.pop(k) for k in ("bert.pooler.dense.weight", "bert.pooler.dense.bias")])
    model = RelevanceModel.load(ckpt)
    assert model.module.bert.pooler is None
    # Reference: transformers' encoder without pooling layer, its [CLS] vector through our file's head.
    encoder = transformers.BertModel.from_pretrained(ckpt, add_pooling_layer=False, attn_implementation="eager")
    head = load_file(str(ckpt / "model.safetensors"))
    ids, seg, mask = batch(model)
    with torch.inference_mode():
        cls = encoder.eval()(input_ids=ids, token_type_ids=seg, attention_mask=mask).last_hidden_state[:, 0]
        want = cls @ head["classifier.weight"].T + head["classifier.bias"]
        got, _ = model.module(ids, seg, mask)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.fixture
def encoder_only(ckpt) -> Path:
    edit_weights(ckpt, lambda s: [s.pop(k) for k in ("classifier.weight", "classifier.bias")])
    return ckpt


def test_encoder_only_checkpoint_says_how_to_build_a_head(encoder_only):
    with pytest.raises(CheckpointError) as e:
        RelevanceModel.load(encoder_only)
    msg = str(e.value)
    assert "has no classification head" in msg
    assert "qtrel train --base" in msg and "new_from_encoder" in msg


def head(module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if k.startswith("classifier.")}


def test_new_from_encoder_is_reproducible_by_seed(encoder_only):
    a, _ = new_from_encoder(encoder_only, seed=3)
    b, _ = new_from_encoder(encoder_only, seed=3)
    c, _ = new_from_encoder(encoder_only, seed=4)
    for k, v in head(a).items():
        assert torch.equal(v, head(b)[k]), k
    assert not torch.equal(head(a)["classifier.weight"], head(c)["classifier.weight"])
    assert head(a)["classifier.weight"].abs().sum() > 0


def test_new_from_encoder_keeps_the_encoder(encoder_only):
    module, tok = new_from_encoder(encoder_only, labels=["bad", "ok", "good"], seed=0)
    src = load_module(encoder_only, num_labels_fallback=True).state_dict()
    for k, v in module.state_dict().items():
        if not k.startswith("classifier."):
            assert torch.equal(v, src[k]), k
    assert module.cfg.labels == ["bad", "ok", "good"] and module.classifier.out_features == 3
    assert tok.max_length == 128


def test_new_from_encoder_seeds_a_missing_pooler(encoder_only):
    edit_weights(encoder_only, lambda s: [s.pop(k) for k in ("bert.pooler.dense.weight", "bert.pooler.dense.bias")])
    a, _ = new_from_encoder(encoder_only, seed=5)
    b, _ = new_from_encoder(encoder_only, seed=5)
    assert a.bert.pooler is not None
    assert torch.equal(a.bert.pooler.dense.weight, b.bert.pooler.dense.weight)
    assert a.bert.pooler.dense.weight.abs().sum() > 0


def test_a_built_head_saves_and_loads(encoder_only, tmp_path):
    module, tok = new_from_encoder(encoder_only, seed=0)
    save_checkpoint(module, tok, tmp_path / "with-head")
    model = RelevanceModel.load(tmp_path / "with-head")
    assert torch.equal(model.module.classifier.weight, module.classifier.weight)


def test_averaged_weights_are_the_mean_and_load_as_a_checkpoint(tmp_path):
    from model.checkpoint import average_checkpoints

    a = make_tiny_checkpoint(tmp_path / "a", seed=1)
    b = make_tiny_checkpoint(tmp_path / "b", seed=2)
    report = average_checkpoints([a, b], tmp_path / "avg")
    assert report["averaged"] == [str(a), str(b)]
    sa, sb, avg = (load_module(p).state_dict() for p in (a, b, tmp_path / "avg"))
    for k in sa:
        torch.testing.assert_close(avg[k], (sa[k] + sb[k]) / 2)
    pairs = [("cordless drill", "DEWALT drill"), ("deck screws", "garden hose")]
    assert len(RelevanceModel.load(tmp_path / "avg").predict(pairs)) == 2


def test_averaging_refuses_one_checkpoint_or_another_architecture(tmp_path):
    from model.checkpoint import average_checkpoints

    a = make_tiny_checkpoint(tmp_path / "a", seed=1)
    wide = make_tiny_checkpoint(tmp_path / "wide", seed=2, intermediate_size=96)
    with pytest.raises(ValueError, match="at least two"):
        average_checkpoints([a], tmp_path / "out")
    with pytest.raises(CheckpointError, match="intermediate_size"):
        average_checkpoints([a, wide], tmp_path / "out")
    assert not (tmp_path / "out").exists()
