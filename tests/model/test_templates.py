"""tokenizer.json templates: WordPiece, Unigram and BPE tokenizers, built here with `tokenizers`, framed as
their own post-processors say; truncation keeps the query; windows and the unknown-token share."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE, Unigram, WordPiece
from tokenizers.trainers import BpeTrainer

from model.chunks import split_pairs
from model.templates import PairTemplate, TemplateError
from model.tokenizer import PairTokenizer, TokenizerError

WORDS = ["cordless", "drill", "battery", "kit", "red", "deck", "paint", "苹", "果", "手", "机", "价", "格"]


def wordpiece() -> Tokenizer:
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "##s"])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.BertProcessing(("[SEP]", 3), ("[CLS]", 2))
    return tok


def unigram(post: str = "template") -> Tokenizer:
    """XLM-R's layout: <s> <pad> </s> <unk> first, Metaspace words; the post-processor as multilingual-e5's
    tokenizer.json writes it (TemplateProcessing) or as RoBERTa's does."""
    pieces = ["<s>", "<pad>", "</s>", "<unk>"] + [p for w in WORDS for p in ("▁" + w, w)] + ["▁"]
    tok = Tokenizer(Unigram([(p, 0.0 if i < 4 else -1.0 - i / 100) for i, p in enumerate(pieces)], unk_id=3))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    if post == "template":
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A </s>", pair="<s> $A </s> </s> $B </s>", special_tokens=[("<s>", 0), ("</s>", 2)]
        )
    else:
        tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok


def bpe() -> Tokenizer:
    """Byte-level BPE (RoBERTa's kind): reads every text, no unknown token."""
    tok = Tokenizer(BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = BpeTrainer(
        special_tokens=["<s>", "<pad>", "</s>", "<unk>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    tok.post_processor = processors.Sequence(
        [processors.ByteLevel(trim_offsets=False), processors.RobertaProcessing(("</s>", 2), ("<s>", 0))]
    )
    return tok


def saved(tmp_path: Path, tok: Tokenizer, max_length: int = 16) -> PairTokenizer:
    tok.save(str(tmp_path / "tokenizer.json"))
    return PairTokenizer.from_dir(tmp_path, max_length=max_length)


KINDS = {"wordpiece": wordpiece, "unigram": unigram, "unigram-roberta": lambda: unigram("roberta"), "bpe": bpe}


@pytest.mark.parametrize("kind", KINDS)
def test_frame_equals_the_tokenizers_own_pair_encoding(tmp_path, kind):
    raw = KINDS[kind]()
    tok = saved(tmp_path, raw, max_length=64)
    for q, t in [("cordless drill", "red deck paint kit"), ("苹果手机", "价格 battery"), ("kit", "drills")]:
        enc = tok.encode([q], [t])
        ref = raw.encode(q, t)
        assert enc.input_ids[0] == ref.ids, kind
        assert enc.token_type_ids[0] == ref.type_ids, kind


def test_each_kind_frames_as_its_family(tmp_path):
    bert = saved(tmp_path, wordpiece())
    assert bert.template.kind == "bert" and bert.specials == 3
    assert bert.tokens(bert.encode(["drill"], ["kit"]).input_ids[0]) == ["[CLS]", "drill", "[SEP]", "kit", "[SEP]"]
    assert bert.encode(["drill"], ["kit"]).token_type_ids[0] == [0, 0, 0, 1, 1]
    for kind in ("unigram", "unigram-roberta"):
        d = tmp_path / kind
        d.mkdir()
        xlmr = saved(d, KINDS[kind]())
        assert xlmr.specials == 4 and xlmr.cls_id == 0 and xlmr.sep_id == 2 and xlmr.pad_id == 1
        enc = xlmr.encode(["drill"], ["kit"])
        assert xlmr.tokens(enc.input_ids[0]) == ["<s>", "▁drill", "</s>", "</s>", "▁kit", "</s>"]
        assert enc.token_type_ids[0] == [0] * 6


@pytest.mark.parametrize("kind", KINDS)
def test_truncation_keeps_the_query_and_fills_max_length(tmp_path, kind):
    tok = saved(tmp_path, KINDS[kind](), max_length=12)
    query, title = "cordless drill", " ".join(["red deck paint kit"] * 6)
    enc, cuts = tok.explain_truncation([query], [title])
    (cut,) = cuts
    assert len(enc.input_ids[0]) == 12 and enc.truncated[0]
    assert cut.query_kept == cut.query == tok.encode_texts([query])[0]
    assert cut.title_kept == cut.title[: 12 - tok.specials - len(cut.query)]
    ids = enc.input_ids[0]
    specials = set(cut.specials)
    assert len(specials) == tok.specials
    assert [x for j, x in enumerate(ids) if j not in specials] == cut.query_kept + cut.title_kept
    assert {ids[j] for j in specials} <= {tok.cls_id, tok.sep_id}


@pytest.mark.parametrize("kind", KINDS)
def test_windows_fill_what_the_query_leaves(tmp_path, kind):
    tok = saved(tmp_path, KINDS[kind](), max_length=16)
    query, title = "drill", " ".join(["red deck paint kit cordless"] * 4)
    (windows,) = split_pairs(tok, [query], [title], max_chunks=10, overlap=2)
    room = 16 - tok.specials - len(tok.encode_texts([query])[0])
    assert len(windows) > 1
    for w in windows:
        assert w.text == title[w.start : w.end]
        assert w.tokens <= room
        assert len(tok.encode([query], [w.text]).input_ids[0]) <= 16


def test_unknown_share_counts_the_unknown_token(tmp_path):
    tok = saved(tmp_path, wordpiece(), max_length=32)
    _, cuts = tok.explain_truncation(["离婚申请", "drill"], ["苹果手机价格", "kit"])
    share = tok.unknown_share(cuts)
    assert share[0] == pytest.approx(4 / 10)  # 离 婚 申 请 unknown, the title's six characters read
    assert share[1] == 0.0
    d = tmp_path / "bpe"
    d.mkdir()
    byte_level = saved(d, bpe(), max_length=32)
    assert byte_level.unk_id is None
    assert byte_level.unknown_share(byte_level.explain_truncation(["离婚申请"], ["x"])[1]) == [0.0]


def test_template_errors_are_clear(tmp_path):
    spec = json.loads(unigram().to_str())
    spec["post_processor"] = None
    with pytest.raises(TemplateError, match="no post-processor"):
        PairTemplate.of(spec, {})
    tok = unigram()
    tok.post_processor = processors.TemplateProcessing(
        single="$A </s>", pair="$A </s> $B </s>", special_tokens=[("</s>", 2)]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(TokenizerError, match="no special token before the query"):
        PairTokenizer.from_dir(tmp_path)


def test_save_keeps_a_non_bert_post_processor(tmp_path):
    tok = saved(tmp_path, unigram())
    out = tmp_path / "out"
    out.mkdir()
    tok.save(out)
    again = PairTokenizer.from_dir(out)
    assert again.template == tok.template and not (out / "vocab.txt").exists()
