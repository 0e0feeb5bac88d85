"""Pair tokenizer on Hugging Face `tokenizers`: WordPiece, Unigram (SentencePiece) or BPE from tokenizer.json,
framed as its own post-processor says (model.templates): `[CLS] query [SEP] title [SEP]` with segment ids
0/1 for BERT, `<s> query </s></s> title </s>` for XLM-R.

Queries and titles are encoded separately (no pre-tokeniser crosses the pair boundary, so this equals
encoding the pair), then truncated and framed here, which lets us keep the query whole by default, fall
back when the query alone is too long, and report what was cut.
"""

from __future__ import annotations

import json
import re
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, normalizers, pre_tokenizers
from tokenizers.models import WordPiece

from model.templates import PairTemplate, TemplateError, pad_id, unknown_id

Truncation = Literal["only_second", "longest_first"]
TRUNCATIONS: tuple[str, ...] = ("only_second", "longest_first")
SPECIAL_TOKENS_IN_PAIR = 3  # BERT's [CLS], [SEP], [SEP]; `PairTokenizer.specials` is each tokenizer's


class TokenizerError(ValueError):
    """Missing or unusable tokenizer files, or input the tokenizer cannot encode."""


@dataclass
class EncodedPairs:
    input_ids: list[list[int]]  # per pair, unpadded
    token_type_ids: list[list[int]]
    truncated: list[bool]
    # per pair, the share of its query's and title's pieces (before truncation) that are the unknown token:
    # text the vocabulary cannot read (0 for a tokenizer without one); counted from the ids encode made
    unknown: list[float] = field(default_factory=list)

    @property
    def lengths(self) -> list[int]:
        # a pair's token type ids are as many as its ids, and as many bytes packed (`pack_pair`): either way
        return [len(types) for types in self.token_type_ids]

    def __len__(self) -> int:
        return len(self.input_ids)


def pack_pair(ids: list[int], types: list[int]) -> tuple[bytes, bytes]:
    """A pair's ids as uint32s and its token type ids as bytes: how a front process sends them to the engine core,
    which passes them on to a model process without a Python int per token (`unpack_pair` there)."""
    return array("I", ids).tobytes(), bytes(types)


def unpack_pair(pair: tuple) -> tuple[list[int], list[int]]:
    """A pair's (ids, token type ids) as lists, from `pack_pair`'s bytes or lists already."""
    ids, types = pair
    if isinstance(ids, list):
        return ids, types
    return memoryview(ids).cast("I").tolist(), list(types)


@dataclass(slots=True)
class PairCut:
    """What truncation kept of one pair's query and title word pieces, and from which end it cut."""

    query: list[int]  # the query's word pieces before truncation
    title: list[int]
    query_kept: list[int]
    title_kept: list[int]
    side: str  # "right": cut from the end; "left": from the start
    template: PairTemplate | None = None  # the frame; None: BERT's

    @property
    def truncated(self) -> bool:
        return len(self.query_kept) < len(self.query) or len(self.title_kept) < len(self.title)

    @property
    def specials(self) -> tuple[int, ...]:
        """Positions of the special tokens in the framed pair: [CLS], the middle [SEP] and the last [SEP] for
        BERT; <s>, </s></s> and </s> for XLM-R."""
        n_query, n_title = len(self.query_kept), len(self.title_kept)
        if self.template is None:
            return 0, n_query + 1, n_query + n_title + 2
        return self.template.special_positions(n_query, n_title)

    def dropped(self, full: list[int], kept: list[int]) -> list[int]:
        return full[len(kept) :] if self.side == "right" else full[: len(full) - len(kept)]


def longest_first(n_query: int, n_title: int, budget: int) -> tuple[int, int]:
    """Lengths kept by `tokenizers`' longest_first: the shorter side stays whole when it fits in half
    the budget, otherwise both get half (the longer side, the title on a tie, takes the odd token)."""
    if n_query + n_title <= budget:
        return n_query, n_title
    swap = n_query > n_title
    short, long_ = (n_title, n_query) if swap else (n_query, n_title)
    if short > budget:
        long_ = short
    else:
        long_ = max(short, budget - short)
    if short + long_ > budget:
        short = budget // 2
        long_ = short + budget % 2
    return (long_, short) if swap else (short, long_)


class PairTokenizer:
    def __init__(self, tokenizer: Tokenizer, max_length: int = 128):
        spec = json.loads(tokenizer.to_str())
        vocab = tokenizer.get_vocab()
        try:
            self.template = PairTemplate.of(spec, vocab)
        except TemplateError as e:
            raise TokenizerError(str(e)) from None
        self._tok = tokenizer
        self._tok.no_truncation()
        self._tok.no_padding()
        # The first token of the frame (scored from) and the last: [CLS]/[SEP], <s>/</s>
        self.cls_id, self.sep_id = self.template.prefix[0], (self.template.suffix or self.template.middle)[-1:][0]
        self.pad_id = pad_id(spec, vocab)
        self.unk_id = unknown_id(spec, vocab)
        self.vocab_size = tokenizer.get_vocab_size()
        self.specials = self.template.specials
        if max_length < self.specials + 2:
            raise TokenizerError(f"max_length {max_length} is too small for a pair")
        self.max_length = max_length
        self._ascii = AsciiWordPiece.of(tokenizer)

    # --- loading -----------------------------------------------------------------------------
    @classmethod
    def from_dir(cls, path: str | Path, max_length: int = 128) -> PairTokenizer:
        """Load `tokenizer.json`, or build BERT's WordPiece tokenizer from `vocab.txt`."""
        path = Path(path)
        if (path / "tokenizer.json").is_file():
            try:
                tok = Tokenizer.from_file(str(path / "tokenizer.json"))
            except Exception as e:  # tokenizers raises bare Exception on bad JSON
                raise TokenizerError(f"cannot load {path / 'tokenizer.json'}: {e}") from e
            return cls(tok, max_length)
        if (path / "vocab.txt").is_file():
            lowercase = True
            cfg = path / "tokenizer_config.json"
            if cfg.is_file():
                lowercase = bool(json.loads(cfg.read_text(encoding="utf-8")).get("do_lower_case", True))
            return cls(build_wordpiece(path / "vocab.txt", lowercase), max_length)
        raise TokenizerError(f"{path} has neither tokenizer.json nor vocab.txt")

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tok = Tokenizer.from_str(self._tok.to_str())
        wordpiece = json.loads(tok.to_str()).get("model", {}).get("type") == "WordPiece"
        if not (wordpiece and self.template.bert_shaped):  # tokenizer.json alone: its post-processor frames pairs
            tok.save(str(path / "tokenizer.json"))
            return
        tok.post_processor = _bert_post_processor(self.cls_id, self.sep_id)
        tok.save(str(path / "tokenizer.json"))
        vocab = sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])
        (path / "vocab.txt").write_text("".join(t + "\n" for t, _ in vocab), encoding="utf-8")
        (path / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "BertTokenizer",
                    "do_lower_case": self.lowercase,
                    "model_max_length": self.max_length,
                    "cls_token": "[CLS]",
                    "sep_token": "[SEP]",
                    "pad_token": "[PAD]",
                    "unk_token": "[UNK]",
                    "mask_token": "[MASK]",
                },
                indent=2,
            ),
            encoding="utf-8",
        )

    @property
    def lowercase(self) -> bool:
        norm = json.loads(self._tok.to_str()).get("normalizer") or {}
        return bool(norm.get("lowercase", False))

    # --- encoding ----------------------------------------------------------------------------
    def encode_texts(self, texts: Sequence[str]) -> list[list[int]]:
        """Word-piece ids of each text, without special tokens or truncation."""
        fast = self._ascii
        out: list[list[int] | None] = [fast.encode(t) for t in texts] if fast is not None else [None] * len(texts)
        rest = [i for i, ids in enumerate(out) if ids is None]
        if len(rest) <= 4:  # skip the batch call's thread pool for the one-pair requests of a service
            for i in rest:
                out[i] = self._tok.encode(texts[i], add_special_tokens=False).ids
        else:
            for i, e in zip(rest, self._tok.encode_batch([texts[i] for i in rest], add_special_tokens=False)):
                out[i] = e.ids
        return out  # type: ignore[return-value]  # every None was filled above

    def word_offsets(self, texts: Sequence[str]) -> list[tuple[list[tuple[int, int]], list[int | None]]]:
        """Per text, each word piece's character span in the original text and the index of its word
        (`model.windows` splits long titles into windows on them)."""
        if len(texts) <= 4:
            encs = [self._tok.encode(t, add_special_tokens=False) for t in texts]
        else:
            encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [(list(e.offsets), list(e.word_ids)) for e in encs]

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return [self._tok.id_to_token(i) or "[UNK]" for i in ids]

    def vocabulary(self) -> list[str]:
        """Every vocabulary entry, in id order."""
        return [t for t, _ in sorted(self._tok.get_vocab().items(), key=lambda kv: kv[1])]

    def token_id(self, token: str) -> int | None:
        """Id of one vocabulary entry (e.g. "[MASK]"), or None when the vocabulary lacks it."""
        return self._tok.token_to_id(token)

    def encode(
        self,
        queries: Sequence[str],
        titles: Sequence[str],
        max_length: int | None = None,
        truncation: Truncation = "only_second",
        side: Literal["right", "left"] = "right",
    ) -> EncodedPairs:
        """Encode pairs; `max_length` defaults to the tokenizer's and never exceeds it. `side` says
        which end of a text is cut when it is truncated."""
        return self._frame(self._cuts(queries, titles, max_length, truncation, side))

    def explain_truncation(
        self,
        queries: Sequence[str],
        titles: Sequence[str],
        truncation: Truncation = "only_second",
        side: Literal["right", "left"] = "right",
    ) -> tuple[EncodedPairs, list[PairCut]]:
        """`encode`, and per pair what truncation kept and cut of the query's and the title's word pieces."""
        cuts = self._cuts(queries, titles, None, truncation, side)
        return self._frame(cuts), cuts

    def _cuts(self, queries, titles, max_length, truncation, side) -> list[PairCut]:
        check_texts(queries, "query")
        check_texts(titles, "title")
        if len(queries) != len(titles):
            raise TokenizerError(f"{len(queries)} queries but {len(titles)} titles")
        if truncation not in TRUNCATIONS:
            raise TokenizerError(f"truncation must be one of {TRUNCATIONS}, got {truncation!r}")
        if side not in ("right", "left"):
            raise TokenizerError(f"side must be 'right' or 'left', got {side!r}")
        limit = self.max_length if max_length is None else min(max_length, self.max_length)
        budget = limit - self.specials
        if budget < 2:
            raise TokenizerError(f"max_length {limit} is too small for a pair")
        # One query against many titles is the common request: encode each distinct query once.
        uniq = list(dict.fromkeys(queries))
        qids = dict(zip(uniq, self.encode_texts(uniq)))
        cuts = []
        for q, t in zip(queries, self.encode_texts(titles)):
            qi = qids[q]
            nq, nt = len(qi), len(t)
            if nq + nt > budget:
                if truncation == "only_second" and nq < budget:
                    nt = budget - nq
                else:  # longest_first on request, or the query alone leaves no room for a title
                    nq, nt = longest_first(nq, nt, budget)
            if side == "right":
                cuts.append(PairCut(qi, t, qi[:nq], t[:nt], side, self.template))
            else:
                cuts.append(PairCut(qi, t, qi[len(qi) - nq :], t[len(t) - nt :], side, self.template))
        return cuts

    def _frame(self, cuts: Sequence[PairCut]) -> EncodedPairs:
        """The template's frame (`[CLS] query [SEP] title [SEP]` with segment ids 0/1 for BERT) of what each
        cut kept."""
        out = EncodedPairs([], [], [], self.unknown_share(cuts))
        for c in cuts:
            ids, types = self.template.frame(c.query_kept, c.title_kept)
            out.input_ids.append(ids)
            out.token_type_ids.append(types)
            out.truncated.append(c.truncated)
        return out

    def unknown_shares(self, queries: Sequence[str], titles: Sequence[str]) -> list[float]:
        """`unknown_share` of each (query, title) pair, whole texts (no truncation)."""
        if self.unk_id is None:
            return [0.0] * len(titles)
        uniq = list(dict.fromkeys(queries))
        qids = dict(zip(uniq, self.encode_texts(uniq)))
        cuts = [PairCut(qids[q], t, [], [], "right") for q, t in zip(queries, self.encode_texts(titles))]
        return self.unknown_share(cuts)

    def unknown_share(self, cuts: Sequence[PairCut]) -> list[float]:
        """Per pair, the share of its query's and title's pieces (before truncation) that are the unknown
        token: text this vocabulary cannot read. 0 for a tokenizer without one (byte-level BPE)."""
        unk = self.unk_id
        out = []
        for c in cuts:
            n = len(c.query) + len(c.title)
            out.append(0.0 if unk is None or not n else (c.query.count(unk) + c.title.count(unk)) / n)
        return out


# Printable ASCII, tab, newline and carriage return: the texts `AsciiWordPiece` takes
_PLAIN = re.compile(r"[\x20-\x7e\t\n\r]*")


class AsciiWordPiece:
    """BERT's tokenisation of printable-ASCII text, the same ids as the `tokenizers` call: there the
    normaliser (no control characters, no accents, CJK spacing, lower case) is `str.lower` or nothing, the
    pre-tokeniser (split on white space and punctuation) a regular expression, and each word's pieces come
    from `tokenizers`' own WordPiece model, kept per word. ~6x the per-text call (4.5 us against 28 for a
    Home Depot title), whose normaliser tracks every character's alignment: that call was a tenth of a
    one-pair request's CPU in the HTTP process. Only for BERT's normaliser, pre-tokeniser and WordPiece
    model; a text holding an added token ("[CLS]" ...) or anything else goes to `tokenizers`."""

    MAX_WORDS = 50_000  # words whose pieces are kept (~8 MB); past it the rest are looked up each time

    def __init__(self, tokenizer: Tokenizer, lowercase: bool, added: list[str], added_normalized: list[str]):
        self._model = tokenizer.model
        self._lower = lowercase
        self._words = re.compile(r"[0-9a-z]+|[^0-9a-z\s]" if lowercase else r"[0-9A-Za-z]+|[^0-9A-Za-z\s]")
        self._added = tuple(added)  # matched in the text as given
        self._added_normalized = tuple(added_normalized)  # matched in the normalised (lower-cased) text
        self._pieces: dict[str, list[int]] = {}

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> AsciiWordPiece | None:
        """The fast path for `tokenizer`, or None where it is not BERT's (any other normaliser, pre-tokeniser
        or model)."""
        spec = json.loads(tokenizer.to_str())
        norm, pre, model = spec.get("normalizer") or {}, spec.get("pre_tokenizer") or {}, spec.get("model") or {}
        if norm.get("type") != "BertNormalizer" or pre.get("type") != "BertPreTokenizer":
            return None
        if model.get("type") != "WordPiece":
            return None
        added = spec.get("added_tokens") or []
        raw = [t["content"] for t in added if not t.get("normalized")]
        normalized = [t["content"] for t in added if t.get("normalized")]
        return cls(tokenizer, bool(norm.get("lowercase")), raw, normalized)

    def encode(self, text: str) -> list[int] | None:
        """The word-piece ids of `text`, or None where the text is not for this path."""
        if not _PLAIN.fullmatch(text) or any(a in text for a in self._added):
            return None
        norm = text.lower() if self._lower else text
        if any(a in norm for a in self._added_normalized):
            return None
        ids: list[int] = []
        pieces = self._pieces
        for w in self._words.findall(norm):
            got = pieces.get(w)
            if got is None:
                got = [t.id for t in self._model.tokenize(w)]
                if len(pieces) < self.MAX_WORDS:
                    pieces[w] = got
            ids += got
        return ids


def check_texts(texts: Sequence[str], what: str) -> None:
    if isinstance(texts, str):
        plural = "queries" if what == "query" else f"{what}s"
        raise TokenizerError(f"{plural} must be a list of strings, not one string")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise TokenizerError(f"{what} {i} is {type(t).__name__}, not a string")
        if not t.strip():
            raise TokenizerError(f"{what} {i} is empty")


def _bert_post_processor(cls_id: int, sep_id: int):
    from tokenizers.processors import TemplateProcessing

    return TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", cls_id), ("[SEP]", sep_id)],
    )


def build_wordpiece(vocab_file: str | Path, lowercase: bool) -> Tokenizer:
    """BERT's basic + WordPiece tokenizer: clean text, split CJK characters, strip accents when
    lower-casing, split on whitespace and punctuation, then greedy longest-match word pieces."""
    vocab: dict[str, int] = {}
    for i, line in enumerate(Path(vocab_file).read_text(encoding="utf-8").splitlines()):
        vocab.setdefault(line.rstrip("\n"), i)
    if "[UNK]" not in vocab:
        raise TokenizerError(f"{vocab_file} has no [UNK] token")
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.BertNormalizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=None, lowercase=lowercase
    )
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    if "[CLS]" in vocab and "[SEP]" in vocab:
        tok.post_processor = _bert_post_processor(vocab["[CLS]"], vocab["[SEP]"])
    return tok
