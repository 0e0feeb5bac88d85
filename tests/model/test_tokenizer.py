"""PairTokenizer: framing, segments, truncation, Chinese, vocab.txt-only loading, limits and bad input."""

from __future__ import annotations

import random
import shutil

import pytest
from tokenizers import Tokenizer

from model.relevance import RelevanceModel
from model.tokenizer import PairTokenizer, TokenizerError, longest_first
from tests.conftest import minilm_dir, read_pairs


@pytest.fixture(scope="module")
def tok() -> PairTokenizer:
    return PairTokenizer.from_dir(minilm_dir())


def words(n: int, word: str = "a") -> str:
    """A text of exactly n word pieces: each of these words is one token of the MiniLM vocabulary."""
    return " ".join([word] * n)


def split(tok: PairTokenizer, ids: list[int]) -> tuple[list[int], list[int]]:
    """(query ids, title ids) of one framed pair, checking the frame on the way."""
    assert ids[0] == tok.cls_id and ids[-1] == tok.sep_id
    sep = ids.index(tok.sep_id)
    return ids[1:sep], ids[sep + 1 : -1]


# --- framing ----------------------------------------------------------------------------------------
def test_cls_sep_placement_and_segment_ids(tok):
    enc = tok.encode(["Angle Bracket"], ["Simpson Strong-Tie 12-Gauge"])
    tokens = tok.tokens(enc.input_ids[0])
    # Lower-cased, split on whitespace and punctuation; every word here is in the vocabulary.
    assert tokens == ["[CLS]", "angle", "bracket", "[SEP]",
                      "simpson", "strong", "-", "tie", "12", "-", "gauge", "[SEP]"]  # fmt: skip
    assert enc.token_type_ids[0] == [0, 0, 0, 0] + [1] * 8
    assert enc.lengths == [12] and enc.truncated == [False]


def test_one_query_against_many_titles(tok):
    enc = tok.encode(["drill", "drill", "saw"], ["cordless drill", "hammer", "circular saw blade"])
    assert len(enc) == 3
    for ids, seg in zip(enc.input_ids, enc.token_type_ids, strict=True):
        q, t = split(tok, ids)
        assert seg == [0] * (len(q) + 2) + [1] * (len(t) + 1)
    assert split(tok, enc.input_ids[0])[0] == split(tok, enc.input_ids[1])[0]


def test_only_second_keeps_the_query_whole(tok):
    enc = tok.encode([words(10)], [words(200, "b")], max_length=32)
    q, t = split(tok, enc.input_ids[0])
    assert len(q) == 10  # whole
    assert len(t) == 32 - 3 - 10  # the title takes what is left
    assert enc.lengths == [32] and enc.truncated == [True]


def test_exact_fit_is_not_truncated(tok):
    enc = tok.encode([words(10)], [words(19, "b")], max_length=32)  # 10 + 19 + 3 = 32
    assert enc.lengths == [32] and enc.truncated == [False]


@pytest.mark.parametrize(
    "n_query,n_title,kept",
    [
        # budget 32 - 3 = 29. Query 40 alone overflows: the shorter title (10) fits in half the budget
        # and stays whole, the query gets 29 - 10 = 19.
        (40, 10, (19, 10)),
        # Query exactly the budget: only_second would leave an empty title. Title 5 stays, query 24.
        (29, 5, (24, 5)),
        # Both long: half each, the longer side takes the odd token: 29 // 2 = 14, 14 + 1 = 15.
        (40, 60, (14, 15)),
        (60, 40, (15, 14)),
    ],
)
def test_falls_back_to_longest_first_when_the_query_alone_is_too_long(tok, n_query, n_title, kept):
    enc = tok.encode([words(n_query)], [words(n_title, "b")], max_length=32)
    q, t = split(tok, enc.input_ids[0])
    assert (len(q), len(t)) == kept
    assert enc.truncated == [True]


def test_longest_first_on_request(tok):
    enc = tok.encode([words(10)], [words(200, "b")], max_length=32, truncation="longest_first")
    q, t = split(tok, enc.input_ids[0])
    assert (len(q), len(t)) == (10, 19)  # the shorter query fits: whole; the title takes 29 - 10
    enc = tok.encode([words(20)], [words(200, "b")], max_length=32, truncation="longest_first")
    q, t = split(tok, enc.input_ids[0])
    assert (len(q), len(t)) == (14, 15)  # 20 + 20 > 29: half each, the odd token to the longer title


@pytest.fixture(scope="module")
def library_tokenizer() -> Tokenizer:
    """MiniLM's tokenizer.json as the `tokenizers` library runs it (its post-processor adds 3 tokens)."""
    lib = Tokenizer.from_file(str(minilm_dir() / "tokenizer.json"))
    lib.no_padding()  # the file pads to 128
    return lib


def library_lengths(lib: Tokenizer, n_query: int, n_title: int, budget: int) -> tuple[int, int]:
    lib.enable_truncation(max_length=budget + 3, strategy="longest_first")
    types = lib.encode(words(n_query), words(n_title, "b")).type_ids
    return types.count(0) - 2, types.count(1) - 1  # less [CLS] [SEP], and the final [SEP]


def test_longest_first_equals_the_tokenizers_library(library_tokenizer):
    rng = random.Random(0)
    cases = [(rng.randint(1, 150), rng.randint(1, 150), rng.randint(2, 200)) for _ in range(400)]
    # The edges: equal sides, exact fit, one over, odd and even budgets, one side at the budget.
    cases += [(n, n, b) for n in (1, 7, 40) for b in (2, 3, 13, 14, 80)]
    cases += [(q, b - q + d, b) for b in (9, 10, 31) for q in (1, 4, 5, 8) for d in (0, 1) if b - q + d > 0]
    cases += [(b, 3, b) for b in (5, 6)] + [(3, b, b) for b in (5, 6)]
    for n_query, n_title, budget in cases:
        assert longest_first(n_query, n_title, budget) == library_lengths(
            library_tokenizer, n_query, n_title, budget
        ), (n_query, n_title, budget)
    library_tokenizer.no_truncation()


def test_encode_longest_first_equals_the_library_ids(tok, library_tokenizer):
    rng = random.Random(1)
    for _ in range(100):
        n_query, n_title, max_length = rng.randint(1, 90), rng.randint(1, 90), rng.randint(5, 128)
        library_tokenizer.enable_truncation(max_length=max_length, strategy="longest_first")
        want = library_tokenizer.encode(words(n_query, "drill"), words(n_title, "saw"))
        enc = tok.encode([words(n_query, "drill")], [words(n_title, "saw")], max_length, "longest_first")
        assert enc.input_ids[0] == want.ids and enc.token_type_ids[0] == want.type_ids
        assert enc.truncated[0] == (n_query + n_title + 3 > max_length)
    library_tokenizer.no_truncation()


# --- Chinese and other scripts -------------------------------------------------------------------------
def test_chinese_is_split_per_character(tok):
    ids = tok.encode_texts(["小孩咳嗽感冒"])[0]
    assert len(ids) == 6  # one piece per character (unknown characters become [UNK] one by one)
    assert tok.tokens(ids)[0] == "小"
    ids = tok.encode_texts(["小孩abc大人"])[0]
    assert tok.tokens(ids)[0] == "小" and "abc" in tok.tokens(ids) and len(ids) == 5


def test_chinese_pairs_equal_bert_tokenizer_fast(tok):
    transformers = pytest.importorskip("transformers")
    hf = transformers.BertTokenizerFast.from_pretrained(minilm_dir())
    pairs = read_pairs(200, "qbqtc")
    q, t = [p[0] for p in pairs], [p[1] for p in pairs]
    want = hf(q, t, truncation="longest_first", max_length=48)
    enc = tok.encode(q, t, max_length=48, truncation="longest_first")
    assert enc.input_ids == want["input_ids"]
    assert enc.token_type_ids == want["token_type_ids"]
    assert sum(enc.truncated) > 0


# --- loading and saving ---------------------------------------------------------------------------------
TRICKY = [
    "Café Crème brûlée",  # accents are stripped when lower-casing
    "3/4 in. x 10 ft. PVC (Sch. 40)",
    "  spaces\tand\nnewlines  ",
    "emoji 🙂 and symbols ©®™",
    "zero\u200bwidth and control\x07char",
    "x" * 150,  # longer than a word may be: [UNK]
    "ÀÉÎÕÜ ñ ß",
    "日本語のテキスト와 한국어",
]


def test_vocab_txt_alone_gives_the_same_ids_as_tokenizer_json(tok, tmp_path):
    for name in ("vocab.txt", "tokenizer_config.json"):
        shutil.copy(minilm_dir() / name, tmp_path / name)
    built = PairTokenizer.from_dir(tmp_path)
    assert built.lowercase
    pairs = read_pairs(500) + read_pairs(200, "qbqtc") + [(t, t[::-1] + " x") for t in TRICKY]
    q, t = [p[0] for p in pairs], [p[1] for p in pairs]
    assert built.encode(q, t).input_ids == tok.encode(q, t).input_ids
    assert built.encode_texts(TRICKY) == tok.encode_texts(TRICKY)


def test_vocab_txt_cased_config_keeps_case(tmp_path):
    shutil.copy(minilm_dir() / "vocab.txt", tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    cased = PairTokenizer.from_dir(tmp_path)
    assert not cased.lowercase
    assert cased.tokens(cased.encode_texts(["Drill drill"])[0]) == ["[UNK]", "drill"]  # the vocab is uncased


def test_save_round_trip(tok, tmp_path):
    small = PairTokenizer.from_dir(minilm_dir(), max_length=64)
    small.save(tmp_path)
    again = PairTokenizer.from_dir(tmp_path, max_length=64)
    pairs = read_pairs(100)
    q, t = [p[0] for p in pairs], [p[1] for p in pairs]
    assert again.encode(q, t).input_ids == small.encode(q, t).input_ids
    assert again.lowercase and again.vocab_size == tok.vocab_size
    assert '"model_max_length": 64' in (tmp_path / "tokenizer_config.json").read_text()


def test_directory_without_tokenizer_files(tmp_path):
    with pytest.raises(TokenizerError, match="neither tokenizer.json nor vocab.txt"):
        PairTokenizer.from_dir(tmp_path)


def test_vocab_without_unk(tmp_path):
    (tmp_path / "vocab.txt").write_text("[PAD]\n[CLS]\n[SEP]\na\n")
    with pytest.raises(TokenizerError, match=r"no \[UNK\] token"):
        PairTokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(TokenizerError, match="cannot load"):
        PairTokenizer.from_dir(tmp_path)


# --- limits ---------------------------------------------------------------------------------------------
def test_max_length_never_exceeds_the_tokenizer_limit():
    small = PairTokenizer.from_dir(minilm_dir(), max_length=32)
    enc = small.encode([words(100)], [words(100, "b")], max_length=500)
    assert enc.lengths == [32]
    assert small.encode([words(100)], [words(100, "b")]).lengths == [32]  # the default is the limit
    assert small.encode([words(100)], [words(100, "b")], max_length=20).lengths == [20]


def test_model_caps_the_tokenizer_at_its_positions(tiny_checkpoint):
    # The tiny model has 128 learned positions: asking for more must not give longer sequences.
    model = RelevanceModel.load(tiny_checkpoint, max_length=1000)
    assert model.max_length == 128
    assert model.encode([(words(300), words(300, "b"))]).lengths == [128]


@pytest.mark.parametrize("max_length", [0, 3, 4])
def test_too_small_max_length(tok, max_length):
    with pytest.raises(TokenizerError, match="too small"):
        tok.encode(["q"], ["t"], max_length=max_length)
    with pytest.raises(TokenizerError, match="too small"):
        PairTokenizer.from_dir(minilm_dir(), max_length=max_length)


# --- bad input ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "queries,titles,message",
    [
        ([""], ["title"], "query 0 is empty"),
        (["ok", "   \t\n"], ["a", "b"], "query 1 is empty"),
        (["query"], [" "], "title 0 is empty"),
        ([None], ["title"], "query 0 is NoneType, not a string"),
        (["q", 3], ["a", "b"], "query 1 is int, not a string"),
        (["q"], [b"bytes"], "title 0 is bytes, not a string"),
        ("drill", ["cordless drill"], "queries must be a list of strings, not one string"),
        (["drill"], "cordless drill", "titles must be a list of strings, not one string"),
        (["a", "b"], ["t"], "2 queries but 1 titles"),
        (["a"], ["t", "u"], "1 queries but 2 titles"),
    ],
)
def test_bad_input_raises_a_clear_error(tok, queries, titles, message):
    with pytest.raises(TokenizerError) as e:
        tok.encode(queries, titles)
    assert message in str(e.value)


def test_unknown_truncation(tok):
    with pytest.raises(TokenizerError, match="truncation must be one of"):
        tok.encode(["q"], ["t"], truncation="only_first")  # type: ignore[arg-type]  # deliberately not a Truncation


def test_empty_batch(tok):
    enc = tok.encode([], [])
    assert len(enc) == 0 and enc.lengths == []


# --- the printable-ASCII fast path (AsciiWordPiece) against the tokenizers library ------------------------
def library_ids(lib: Tokenizer, texts: list[str]) -> list[list[int]]:
    lib.no_truncation()
    return [lib.encode(t, add_special_tokens=False).ids for t in texts]


def random_texts(rng: random.Random, n: int) -> list[str]:
    """Printable ASCII with runs of letters, digits and punctuation, white space of every kind, and now and
    then a control character, an added token, a word over WordPiece's 100 characters or a non-ASCII one."""
    alphabet = "abcXYZ019 .,-/\"'()[]{}#&*+:;<=>?@\\^_`|~!$%\t\n\r  "
    extra = ["\x07", "\x0b", "\x0c", "\x1c", "\x7f", "[CLS]", "[SEP]", "[mask]", "[UNK]", "é", "ß", "日", "\u200b"]
    out = []
    for _ in range(n):
        parts = ["".join(rng.choices(alphabet, k=rng.randint(1, 12))) for _ in range(rng.randint(1, 8))]
        if rng.random() < 0.2:
            parts.insert(rng.randrange(len(parts) + 1), rng.choice(extra))
        if rng.random() < 0.05:
            parts.append("q" * rng.randint(95, 130))
        out.append(rng.choice(["", " "]).join(parts))
    return out


def test_ascii_fast_path_equals_the_library(tok, library_tokenizer):
    pairs = read_pairs(3000)
    texts = [p[0] for p in pairs] + [p[1] for p in pairs] + TRICKY + random_texts(random.Random(2), 3000)
    fast = tok._ascii
    assert fast is not None
    taken = sum(fast.encode(t) is not None for t in texts)
    assert taken > 0.9 * len(texts)  # the path is really taken, not silently off
    assert tok.encode_texts(texts) == library_ids(library_tokenizer, texts)
    # one text at a time (the one-pair path) and again from the cache of word pieces
    assert [tok.encode_texts([t])[0] for t in texts[-500:]] == library_ids(library_tokenizer, texts[-500:])


def test_ascii_fast_path_leaves_added_tokens_and_other_text_to_the_library(tok):
    fast = tok._ascii
    for text in ["a [CLS] b", "[SEP]", "café", "tab\x07bell", "zero\u200bwidth"]:
        assert fast.encode(text) is None, text
    assert fast.encode("[cls] is not an added token") is not None  # added tokens match case-sensitively


def test_ascii_fast_path_cased(tmp_path, library_tokenizer):
    shutil.copy(minilm_dir() / "vocab.txt", tmp_path / "vocab.txt")
    (tmp_path / "tokenizer_config.json").write_text('{"do_lower_case": false}')
    cased = PairTokenizer.from_dir(tmp_path)
    texts = random_texts(random.Random(3), 1000) + ["Drill drill DRILL"]
    assert cased._ascii is not None and cased.encode_texts(texts) == library_ids(cased._tok, texts)


def test_ascii_fast_path_only_for_berts_tokenizer(tok):
    from tokenizers import pre_tokenizers as pre

    lib = Tokenizer.from_str(tok._tok.to_str())
    lib.pre_tokenizer = pre.Whitespace()  # not BERT's: "a-b" stays one word... and the path steps aside
    other = PairTokenizer(lib)
    assert other._ascii is None
    assert other.encode_texts(["drill-bit set"]) == library_ids(lib, ["drill-bit set"])


def test_ascii_fast_path_keeps_a_bounded_number_of_words(tok, monkeypatch):
    fresh = PairTokenizer(Tokenizer.from_str(tok._tok.to_str()))
    monkeypatch.setattr(type(fresh._ascii), "MAX_WORDS", 10)
    texts = [f"word{i} other{i}" for i in range(40)]
    assert fresh.encode_texts(texts) == tok.encode_texts(texts)
    assert len(fresh._ascii._pieces) == 10


def test_ascii_fast_path_with_a_normalised_added_token(tok):
    lib = Tokenizer.from_str(tok._tok.to_str())
    from tokenizers import AddedToken

    lib.add_tokens([AddedToken("powerdrill", normalized=True)])  # matched after lower-casing: "PowerDrill" too
    mine = PairTokenizer(lib)
    texts = ["cordless PowerDrill kit", "power drill", "[CLS] x", "plain text"]
    assert mine._ascii is not None and mine._ascii.encode(texts[0]) is None
    assert mine.encode_texts(texts) == library_ids(lib, texts)
    assert lib.token_to_id("powerdrill") in mine.encode_texts(texts[:1])[0]


def test_a_packed_pair_unpacks_to_its_ids_and_counts_its_tokens(tok):
    """How a front process sends a pair's ids to the engine core (bytes, no int a token), and back as lists."""
    from model.tokenizer import EncodedPairs, pack_pair, unpack_pair

    enc = tok.encode(["cordless drill"], ["DEWALT 20V MAX cordless drill " * 30])
    ids, types = enc.input_ids[0], enc.token_type_ids[0]
    packed = pack_pair(ids, types)
    assert unpack_pair(packed) == (ids, types) and unpack_pair((ids, types)) == (ids, types)
    assert EncodedPairs([packed[0]], [packed[1]], [True]).lengths == enc.lengths
    assert unpack_pair(pack_pair([10**6, 0], [0, 1])) == ([10**6, 0], [0, 1])
