"""Exact-match segment ids (tokenizer_config.json "qtrel_match_segments"): the tokenizer's marks, the flag on
disk, the model that must embed them, segments added to a trained checkpoint without moving a score, and a
training run that learns them; explanations and OpenVINO take them too."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_module
from model.config import CheckpointError
from model.explain import PairLayout, explain_pair
from model.relevance import RelevanceModel
from model.tokenizer import MATCH_OFFSET, PairTokenizer, TokenizerError
from model.train.loop import TrainArgs, add_match_segments, train
from tests.conftest import minilm_dir, read_pairs, shared_data


def marking(tok: PairTokenizer) -> PairTokenizer:
    return PairTokenizer(tok._tok, tok.max_length, match_segments=True)


def test_pieces_the_other_text_has_get_their_segment_plus_two():
    tok = PairTokenizer.from_dir(minilm_dir())
    assert not tok.match_segments
    q, t = ["cordless drill 18v"], ["Makita 18-Volt Drill, cordless (bare tool)"]
    plain, marked = tok.encode(q, t), marking(tok).encode(q, t)
    assert plain.input_ids == marked.input_ids and MATCH_OFFSET == 2
    pieces = tok.tokens(marked.input_ids[0])
    by_piece = dict(zip(pieces, marked.token_type_ids[0]))
    assert by_piece["drill"] == 3 and by_piece["bare"] == 1 and by_piece["tool"] == 1
    n_query = plain.token_type_ids[0].count(0) - 2
    title_pieces = pieces[n_query + 2 :]
    want = [2 if p in title_pieces else 0 for p in pieces[1 : 1 + n_query]]
    assert marked.token_type_ids[0][1 : 1 + n_query] == want
    # [CLS] and both [SEP]s keep 0 / 0 / 1 whatever they match; the segment is the id's parity everywhere
    seg = marked.token_type_ids[0]
    assert seg[0] == 0 and seg[n_query + 1] == 0 and seg[-1] == 1
    assert [s % 2 for s in seg] == plain.token_type_ids[0]
    # nothing shared: nothing marked
    none = marking(tok).encode(["garden hose"], ["Moby Dick by Herman Melville"])
    assert none.token_type_ids == tok.encode(["garden hose"], ["Moby Dick by Herman Melville"]).token_type_ids


def test_the_flag_lives_in_tokenizer_config_and_is_checked(tmp_path):
    tok = PairTokenizer.from_dir(minilm_dir())
    marking(tok).save(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert cfg["qtrel_match_segments"] is True
    assert PairTokenizer.from_dir(tmp_path).match_segments
    (tmp_path / "tokenizer.json").unlink()  # vocab.txt alone reads it too
    assert PairTokenizer.from_dir(tmp_path).match_segments
    plain = tmp_path / "plain"
    plain.mkdir()
    tok.save(plain)
    assert "qtrel_match_segments" not in json.loads((plain / "tokenizer_config.json").read_text())
    cfg["qtrel_match_segments"] = "yes"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(TokenizerError, match="must be true or false"):
        PairTokenizer.from_dir(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(TokenizerError, match="not a JSON object"):
        PairTokenizer.from_dir(tmp_path)


def test_a_model_with_two_segment_ids_refuses_a_marking_tokenizer(tiny_checkpoint, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny_checkpoint, bad)
    cfg = json.loads((bad / "tokenizer_config.json").read_text())
    (bad / "tokenizer_config.json").write_text(json.dumps({**cfg, "qtrel_match_segments": True}))
    with pytest.raises(CheckpointError, match="embeds only 2 segment ids"):
        RelevanceModel.load(bad)


def test_added_segments_move_no_score_until_trained(tiny_checkpoint, tmp_path):
    pairs = read_pairs(24)
    before = RelevanceModel.load(tiny_checkpoint).predict(pairs)
    module, tok = load_module(tiny_checkpoint), PairTokenizer.from_dir(tiny_checkpoint)
    add_match_segments(module, tok)
    assert tok.match_segments and module.cfg.type_vocab_size == 4
    assert any(2 in s or 3 in s for s in tok.encode(*zip(*pairs)).token_type_ids)
    after = RelevanceModel(module, tok).predict(pairs)
    for b, a in zip(before, after):
        assert a.level == b.level and a.score == pytest.approx(b.score, abs=1e-5)
    with pytest.raises(ValueError, match="extend 2 segment ids"):
        add_match_segments(module, tok)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("data")
    out = []
    for name, n in (("train.csv", 256), ("dev.csv", 200)):
        with shared_data("homedepot", name).open(encoding="utf-8") as f:
            (d / name).write_text("".join(line for _, line in zip(range(n + 1), f)), encoding="utf-8")
        out.append(d / name)
    return out[0], out[1]


def test_training_learns_the_marks_and_the_checkpoint_keeps_them(tiny_checkpoint, data, tmp_path):
    def args(base: Path, out: Path, **kw) -> TrainArgs:
        fields = dict(epochs=1.0, batch_size=16, lr=1e-3, max_steps=6, progress=False, seed=0)
        fields.update(kw)
        return TrainArgs(train_file=str(data[0]), base=str(base), output_dir=str(out), dev_file=str(data[1]), **fields)

    train(args(tiny_checkpoint, tmp_path / "a", match_segments=1))
    m = RelevanceModel.load(tmp_path / "a")
    assert m.tokenizer.match_segments and m.cfg.type_vocab_size == 4
    w = load_module(tmp_path / "a").bert.embeddings.token_type.weight
    assert not torch.equal(w[2], w[0]) and not torch.equal(w[3], w[1])  # the copies moved apart
    pairs = read_pairs(16)
    assert len({round(s.score, 4) for s in m.predict(pairs)}) > 1
    # Continuing keeps the marks without the flag; a plain run stays plain.
    train(args(tmp_path / "a", tmp_path / "b", max_steps=2))
    assert PairTokenizer.from_dir(tmp_path / "b").match_segments
    train(args(tiny_checkpoint, tmp_path / "c", max_steps=2))
    assert not PairTokenizer.from_dir(tmp_path / "c").match_segments
    assert load_module(tmp_path / "c").cfg.type_vocab_size == 2
    # An explanation lays the pair out by segment parity: its query tokens are the query's.
    e = explain_pair(m, "power drill", "Power Drill Kit")
    query = [t for t in e["tokens"] if t["segment"] == 0 and not t["special"]]
    assert [(t["token"], t["match"]) for t in query] == [("power", True), ("drill", True)]
    assert [t["match"] for t in e["tokens"] if t["token"] == "kit"] == [False]
    lay = PairLayout.of([0, 2, 0, 0, 1, 3, 1])
    assert lay.query == [1, 2] and lay.title == [4, 5]


def test_openvino_takes_the_marked_segments(tiny_checkpoint, tmp_path):
    pytest.importorskip("openvino")
    module, tok = load_module(tiny_checkpoint), PairTokenizer.from_dir(tiny_checkpoint)
    add_match_segments(module, tok)
    with torch.no_grad():
        w = module.bert.embeddings.token_type.weight  # marks that change scores (a constant LayerNorm would remove)
        w[2:] += torch.randn(w[2:].shape, generator=torch.Generator().manual_seed(0))
    from model.checkpoint import save_checkpoint

    save_checkpoint(module, tok, tmp_path / "m")
    pairs = read_pairs(24)
    torch_model = RelevanceModel.load(tmp_path / "m")
    ov = RelevanceModel.load(tmp_path / "m")
    ov.use_inference("openvino")
    assert ov.inference == "openvino", ov.inference_reason
    enc = torch_model.encode(pairs)
    assert max(max(s) for s in enc.token_type_ids) == 3
    torch.testing.assert_close(ov.encoded_logits(enc), torch_model.encoded_logits(enc), atol=2e-4, rtol=0)
    plain = RelevanceModel.load(tiny_checkpoint).encoded_logits(RelevanceModel.load(tiny_checkpoint).encode(pairs))
    assert not torch.allclose(plain, torch_model.encoded_logits(enc), atol=1e-3)
