"""Long documents in windows: a title longer than the model's window is split into overlapping windows of
whole words, each scored with the query as an ordinary pair; the document takes its best window's score
(what Cohere's `max_chunks_per_doc` and OpenVINO Model Server's rerank chunking do).

The split is on the tokenizer's own word pieces and their character offsets
(`PairTokenizer.word_offsets`), so a window is a substring of the original text (`doc[start:end]`) that
tokenises back to the same pieces, and a window never starts or ends inside a word (unless one word is
longer than a window). A document that fits is left as it is: one window, the whole text, the very pair
that would be scored without windows. `split_pairs` applies it to pairs (the service's
`Engine.score_windows` and `qtrel score --max-chunks` alike). No torch, no HTTP.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from model.levels import CHUNK_OVERLAP
from model.tokenizer import PairTokenizer

__all__ = ["CHUNK_OVERLAP", "MIN_WINDOW", "Window", "best", "plan", "split", "split_pairs", "stride_of"]

MIN_WINDOW = 8  # word pieces: a query that leaves less room than this is scored whole, without windows


@dataclass(frozen=True, slots=True)
class Window:
    text: str  # doc[start:end]
    start: int  # character offsets in the document
    end: int
    tokens: int  # the window's word pieces (no special tokens)


def stride_of(size: int, overlap: int) -> int:
    """Tokens from one window's start to the next: the window less the overlap, never under half a window
    (an overlap that large would only score nearly the same window again)."""
    return max(size - overlap, (size + 1) // 2, 1)


def plan(starts_word: Sequence[bool], size: int, overlap: int, limit: int) -> list[tuple[int, int]]:
    """Token ranges [a, b) of at most `limit` windows of at most `size` pieces over a text whose pieces
        begin a word where `starts_word` is true; consecutive windows share about `overlap` pieces (at most
    half the earlier window, `stride_of`). The last
        window ends at the text's end unless `limit` stops first (the rest of the text is then not scored)."""
    n = len(starts_word)
    if n <= size:
        return [(0, n)]
    out: list[tuple[int, int]] = []
    a = 0
    while len(out) < limit:
        b = min(a + size, n)
        if b < n:  # end before the word that piece b belongs to, unless that word began at a
            j = b
            while j > a and not starts_word[j]:
                j -= 1
            b = j if j > a else b
        out.append((a, b))
        if b == n:
            break
        nxt = a + stride_of(b - a, overlap)  # of this window: one cut short before a word still overlaps
        back = nxt
        while back > a and not starts_word[back]:  # back to the start of its word: the overlap holds
            back -= 1
        if back > a:
            nxt = back
        else:  # the window is one word: go on at the next word
            while nxt < b and not starts_word[nxt]:
                nxt += 1
        a = nxt
    return out


def split(
    text: str,
    offsets: Sequence[tuple[int, int]],
    word_ids: Sequence[int | None],
    size: int,
    overlap: int,
    limit: int,
) -> list[Window]:
    """The windows of one document from its word pieces' character offsets and word ids (as `tokenizers`
    gives them): the whole text when it fits in `size` pieces, else `plan`'s windows as substrings."""
    n = len(offsets)
    if n <= size:
        return [Window(text, 0, len(text), n)]
    starts = [i == 0 or word_ids[i] != word_ids[i - 1] or word_ids[i] is None for i in range(n)]
    out = []
    for a, b in plan(starts, size, overlap, limit):
        start, end = offsets[a][0], offsets[b - 1][1]
        out.append(Window(text[start:end], start, end, b - a))
    return out


def best(scores: Sequence[float]) -> int:
    """The winning window: the highest score, the first of equals."""
    return max(range(len(scores)), key=lambda i: (scores[i], -i))


def split_pairs(
    tok: PairTokenizer, queries: list[str], titles: list[str], max_chunks: int, overlap: int
) -> list[list[Window]]:
    """Per pair, the windows of its title: as many pieces as the query leaves of the model's window."""
    uniq = list(dict.fromkeys(queries))
    room = {q: tok.max_length - tok.specials - len(ids) for q, ids in zip(uniq, tok.encode_texts(uniq))}
    out = []
    for q, t, (offsets, words) in zip(queries, titles, tok.word_offsets(titles)):
        size = room[q]
        if size < MIN_WINDOW:  # a query this long is cut with its title as usual: no windows
            out.append([Window(t, 0, len(t), len(offsets))])
        else:
            out.append(split(t, offsets, words, size, overlap, max_chunks))
    return out
