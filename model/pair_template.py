"""How a tokenizer frames a pair, read from its own `tokenizer.json` post-processor: the special tokens before
the query, between query and title and after the title, and each side's segment id. BERT's
`[CLS] q [SEP] t [SEP]` (segments 0 / 1), RoBERTa's and XLM-R's `<s> q </s></s> t </s>` (one segment), or
whatever a `TemplateProcessing` says; a tokenizer without a post-processor gets BERT's frame from its
`[CLS]` and `[SEP]` entries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer


class TemplateError(ValueError):
    """A post-processor whose pair frame qtrel cannot read."""


@dataclass(frozen=True)
class PairTemplate:
    start: tuple[int, ...]  # special token ids before the query
    middle: tuple[int, ...]  # between query and title
    end: tuple[int, ...]  # after the title
    segments: tuple[int, int] = (0, 1)  # the query side's segment id (start, query, middle), the title side's

    @property
    def specials(self) -> int:
        """Special tokens a pair carries."""
        return len(self.start) + len(self.middle) + len(self.end)

    @property
    def cls_id(self) -> int:
        return (self.start or self.middle or self.end)[0]

    @property
    def sep_id(self) -> int:
        return (self.end or self.middle or self.start)[-1]

    def frame(self, query: list[int], title: list[int]) -> tuple[list[int], list[int]]:
        """The pair's ids and segment ids."""
        a = [*self.start, *query, *self.middle]
        b = [*title, *self.end]
        return a + b, [self.segments[0]] * len(a) + [self.segments[1]] * len(b)

    def positions(self, n_query: int, n_title: int) -> tuple[int, ...]:
        """Where the special tokens sit in a framed pair of these lengths."""
        s, m = len(self.start), len(self.middle)
        mid = s + n_query
        end = mid + m + n_title
        return (*range(s), *range(mid, mid + m), *range(end, end + len(self.end)))

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> PairTemplate:
        post = json.loads(tokenizer.to_str()).get("post_processor") or {}
        return _read(post, tokenizer.get_vocab())


def _read(post: dict[str, Any], vocab: dict[str, int]) -> PairTemplate:
    kind = post.get("type")
    if kind == "RobertaProcessing":
        c, s = int(post["cls"][1]), int(post["sep"][1])
        return PairTemplate((c,), (s, s), (s,), (0, 0))
    if kind == "BertProcessing":
        c, s = int(post["cls"][1]), int(post["sep"][1])
        return PairTemplate((c,), (s,), (s,), (0, 1))
    if kind == "TemplateProcessing":
        return _from_template(post)
    framing = [p for p in post.get("processors") or [] if p.get("type") != "ByteLevel"]
    if kind == "Sequence" and len(framing) == 1:  # e.g. ByteLevel offsets, then the frame
        return _read(framing[0], vocab)
    try:
        return PairTemplate((vocab["[CLS]"],), (vocab["[SEP]"],), (vocab["[SEP]"],), (0, 1))
    except KeyError as e:
        raise TemplateError(f"the vocabulary has no {e.args[0]} token and no post-processor frames a pair") from None


def _from_template(post: dict[str, Any]) -> PairTemplate:
    specials = {k: v["ids"] for k, v in (post.get("special_tokens") or {}).items()}
    parts: list[list[int]] = [[], [], []]
    segments = [0, 0]
    side = 0
    for item in post.get("pair") or []:
        if "Sequence" in item:
            seq = item["Sequence"]
            if seq["id"] not in ("A", "B") or side != (0 if seq["id"] == "A" else 1):
                raise TemplateError("the pair template must hold $A, then $B")
            segments[side] = int(seq.get("type_id", 0))
            side += 1
        else:
            name = item["SpecialToken"]["id"]
            if name not in specials:
                raise TemplateError(f"the pair template names {name!r}, which it does not define")
            parts[side] += [int(i) for i in specials[name]]
    if side != 2:
        raise TemplateError("the pair template must hold both $A and $B")
    return PairTemplate(tuple(parts[0]), tuple(parts[1]), tuple(parts[2]), (segments[0], segments[1]))
