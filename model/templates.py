"""How a tokenizer frames a pair: the special tokens before the query, between query and title and after
the title, and each part's segment id, read from `tokenizer.json`'s own post-processor.

- BertProcessing, or no post-processor with [CLS]/[SEP] in the vocabulary: `[CLS] q [SEP] t [SEP]`,
  segments 0 0 0 1 1.
- RobertaProcessing (XLM-R, RoBERTa): `<s> q </s></s> t </s>`, one segment.
- TemplateProcessing: its `pair` template, special tokens and type ids as written (multilingual-e5's
  tokenizer.json frames pairs as XLM-R does, with this processor).
- Sequence: the first of its processors that frames pairs (ByteLevel and the like only fix offsets).

The query and the title are encoded separately (no pre-tokeniser crosses the pair boundary), then framed
here, which lets model.tokenizer truncate the title and keep the query.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

FRAMING_PROCESSORS = ("BertProcessing", "RobertaProcessing", "TemplateProcessing")


class TemplateError(ValueError):
    """A post-processor whose pair framing cannot be used."""


@dataclass(frozen=True)
class PairTemplate:
    prefix: tuple[int, ...]  # ids before the query
    middle: tuple[int, ...]  # between query and title
    suffix: tuple[int, ...]  # after the title
    # Segment ids: of each prefix token, the query, each middle token, the title, each suffix token
    prefix_types: tuple[int, ...]
    query_type: int
    middle_types: tuple[int, ...]
    title_type: int
    suffix_types: tuple[int, ...]
    kind: str  # "bert", "roberta" or "template": what the post-processor was

    @property
    def specials(self) -> int:
        """Special tokens in a framed pair."""
        return len(self.prefix) + len(self.middle) + len(self.suffix)

    @property
    def bert_shaped(self) -> bool:
        """`[CLS] q [SEP] t [SEP]` with segments 0 0 0 1 1, whichever processor wrote it."""
        return (
            self.prefix_types + (self.query_type,) + self.middle_types + (self.title_type,) + self.suffix_types
            == (0, 0, 0, 1, 1)
            and self.middle == self.suffix
            and len(self.prefix) == 1
        )

    def frame(self, query: list[int], title: list[int]) -> tuple[list[int], list[int]]:
        """Ids and segment ids of the framed pair."""
        ids = [*self.prefix, *query, *self.middle, *title, *self.suffix]
        types = [
            *self.prefix_types,
            *[self.query_type] * len(query),
            *self.middle_types,
            *[self.title_type] * len(title),
            *self.suffix_types,
        ]
        return ids, types

    def special_positions(self, n_query: int, n_title: int) -> tuple[int, ...]:
        """Where the special tokens sit in a pair framed with `n_query` and `n_title` pieces."""
        p, m = len(self.prefix), len(self.middle)
        mid = p + n_query
        end = mid + m + n_title
        return (*range(p), *range(mid, mid + m), *range(end, end + len(self.suffix)))

    @classmethod
    def bert(cls, cls_id: int, sep_id: int) -> PairTemplate:
        return cls((cls_id,), (sep_id,), (sep_id,), (0,), 0, (0,), 1, (1,), "bert")

    @classmethod
    def roberta(cls, cls_id: int, sep_id: int) -> PairTemplate:
        return cls((cls_id,), (sep_id, sep_id), (sep_id,), (0,), 0, (0, 0), 0, (0,), "roberta")

    @classmethod
    def of(cls, spec: dict[str, Any], vocab: dict[str, int]) -> PairTemplate:
        """The framing of a tokenizer.json (parsed): its post-processor's, else BERT's where the vocabulary
        has [CLS] and [SEP]."""
        post = _framing(spec.get("post_processor"))
        if post is None:
            if "[CLS]" in vocab and "[SEP]" in vocab:
                return cls.bert(vocab["[CLS]"], vocab["[SEP]"])
            raise TemplateError("tokenizer.json has no post-processor that frames pairs, and no [CLS]/[SEP] tokens")
        kind = post["type"]
        if kind in ("BertProcessing", "RobertaProcessing"):
            try:
                (_, sep_id), (_, cls_id) = post["sep"], post["cls"]
            except (KeyError, ValueError, TypeError):
                raise TemplateError(f"{kind} without its cls and sep tokens") from None
            return (cls.bert if kind == "BertProcessing" else cls.roberta)(int(cls_id), int(sep_id))
        return cls._from_template(post)

    @classmethod
    def _from_template(cls, post: dict[str, Any]) -> PairTemplate:
        specials = post.get("special_tokens") or {}
        parts: list[list[tuple[int, int]]] = [[], [], []]  # (id, type) before A, between A and B, after B
        types: dict[str, int] = {}
        where = 0
        for piece in post.get("pair") or []:
            if "Sequence" in piece:
                seq = piece["Sequence"]
                name = seq.get("id")
                if name not in ("A", "B") or name in types or (name == "B") != ("A" in types):
                    raise TemplateError("the pair template must name sequence A, then sequence B, once each")
                types[name] = int(seq.get("type_id", 0))
                where += 1
            elif "SpecialToken" in piece:
                tok = piece["SpecialToken"]
                ids = (specials.get(tok.get("id")) or {}).get("ids")
                if not ids:
                    raise TemplateError(f"the pair template's special token {tok.get('id')!r} has no ids")
                parts[where] += [(int(i), int(tok.get("type_id", 0))) for i in ids]
            else:
                raise TemplateError(f"unknown piece in the pair template: {piece}")
        if set(types) != {"A", "B"}:
            raise TemplateError("the pair template does not hold both sequences A and B")
        if not parts[0]:
            raise TemplateError("the pair template has no special token before the query: none to score from")
        (p, pt), (m, mt), (s, st) = (tuple(zip(*x)) if x else ((), ()) for x in parts)
        return cls(p, m, s, pt, types["A"], mt, types["B"], st, "template")


def _framing(post: dict[str, Any] | None) -> dict[str, Any] | None:
    if not post:
        return None
    if post.get("type") == "Sequence":
        return next((p for p in post.get("processors") or [] if p.get("type") in FRAMING_PROCESSORS), None)
    return post if post.get("type") in FRAMING_PROCESSORS else None


def unknown_id(spec: dict[str, Any], vocab: dict[str, int]) -> int | None:
    """The id the model gives text it cannot read: Unigram's `unk_id`, WordPiece's or BPE's `unk_token`
    (None for byte-level BPE, which reads every text)."""
    model = spec.get("model") or {}
    if model.get("type") == "Unigram":
        unk = model.get("unk_id")
        return int(unk) if unk is not None else None
    token = model.get("unk_token")
    return vocab.get(token) if token else None


def pad_id(spec: dict[str, Any], vocab: dict[str, int]) -> int:
    """The padding id: the tokenizer's padding setting, else [PAD] or <pad>, else 0."""
    padding = spec.get("padding") or {}
    if "pad_id" in padding:
        return int(padding["pad_id"])
    return vocab.get("[PAD]", vocab.get("<pad>", 0))
