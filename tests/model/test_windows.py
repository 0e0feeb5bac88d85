"""model.windows: long titles in overlapping windows of whole words, on the real MiniLM tokenizer's pieces
and offsets; each window is a substring of the document that tokenises back to the same pieces."""

from __future__ import annotations

import pytest

from model.tokenizer import PairTokenizer
from model.windows import best, plan, split, stride_of
from tests.conftest import minilm_dir


@pytest.fixture(scope="module")
def tok() -> PairTokenizer:
    return PairTokenizer.from_dir(minilm_dir())


def windows(tok: PairTokenizer, text: str, size: int, overlap: int, limit: int = 100):
    ((offsets, words),) = tok.word_offsets([text])
    return split(text, offsets, words, size, overlap, limit)


def test_plan_overlaps_by_the_overlap_and_the_last_window_ends_at_the_end():
    every = [True] * 25  # 25 one-piece words
    assert plan(every, 10, 3, 100) == [(0, 10), (7, 17), (14, 24), (21, 25)]
    assert plan(every, 10, 0, 100) == [(0, 10), (10, 20), (20, 25)]
    assert plan(every, 10, 3, 2) == [(0, 10), (7, 17)]  # the limit: the tail is not scored
    assert plan(every, 25, 3, 100) == [(0, 25)] and plan(every, 40, 3, 1) == [(0, 25)]  # it fits: one window
    # an overlap of a window or more moves at least half a window
    assert stride_of(10, 9) == 5 and stride_of(10, 50) == 5 and stride_of(10, 3) == 7 and stride_of(1, 5) == 1
    assert plan(every, 10, 99, 100) == [(0, 10), (5, 15), (10, 20), (15, 25)]


def test_plan_never_cuts_a_word_unless_one_word_is_longer_than_a_window():
    # words of 3 pieces: [T, F, F] * 6
    starts = [i % 3 == 0 for i in range(18)]
    for a, b in plan(starts, 7, 2, 100):
        assert starts[a] and (b == 18 or starts[b]), (a, b)
        assert b - a <= 7
    one_long_word = [True] + [False] * 11 + [True, True]
    got = plan(one_long_word, 5, 1, 100)
    assert got[0] == (0, 5) and got[-1][1] == 14
    assert all(b > a for a, b in got) and all(n[0] > p[0] for p, n in zip(got, got[1:]))  # progress


def test_a_short_document_is_left_whole(tok):
    text = "  DEWALT 20V MAX Cordless Drill "
    (w,) = windows(tok, text, 64, 8)
    assert (w.text, w.start, w.end) == (text, 0, len(text))  # the very text, spaces and all


def test_windows_are_substrings_that_tokenise_to_the_documents_own_pieces(tok):
    text = (
        "DEWALT 20V MAX XR Lithium-Ion Brushless Cordless 1/2 in. Drill/Driver Kit with two 5.0Ah batteries, "
        "a charger and a contractor bag; unbelievably versatile for drywall, decking and framing work"
    )
    pieces = tok.encode_texts([text])[0]
    ws = windows(tok, text, 12, 4)
    assert len(ws) > 3
    for w in ws:
        assert text[w.start : w.end] == w.text and w.text == w.text.strip()
        ids = tok.encode_texts([w.text])[0]
        assert len(ids) == w.tokens <= 12
        # the window's pieces are a run of the document's pieces
        assert any(pieces[i : i + len(ids)] == ids for i in range(len(pieces)))
    assert ws[0].start == 0 and ws[-1].end == len(text)
    for prev, nxt in zip(ws, ws[1:]):
        assert prev.start < nxt.start < prev.end  # they overlap and go forward


def test_unicode_offsets_are_characters_of_the_original_text(tok):
    text = "Café crème brûlée torch, ünïcödé 日本語のテキスト and more words " * 3
    ws = windows(tok, text, 10, 3)
    assert len(ws) > 2 and ws[-1].end == len(text.rstrip())
    for w in ws:
        assert text[w.start : w.end] == w.text
        assert len(tok.encode_texts([w.text])[0]) == w.tokens  # accents and CJK: the same pieces again


def test_best_is_the_highest_and_the_first_of_equals():
    assert best([1.0, 3.0, 2.0]) == 1 and best([2.0, 2.0, 1.0]) == 0 and best([0.5]) == 0
