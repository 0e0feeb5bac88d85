"""Sampled negatives: catalogue titles paired with a query they were never judged for, labelled level 1.

Judged pairs are candidates a search engine already retrieved, so almost none is unrelated; a service
sees whatever retrieval returns, junk included. Pairing a query with a title judged only for other
queries teaches the model (and tests it on) that end of the scale. The title set for a query excludes
every title judged for that query, compared case- and space-insensitively, so a negative never repeats
a judged pair.

Hard negatives (`sample_hard_negatives`) are closer to what retrieval returns: a title judged for another
query that shares a word with this one, but without this query's head term (its last word, as in
"cordless *drill*"): the same shop's aisle, not the product asked for ("cordless impact driver" for
"cordless drill"). Some are partly relevant to a rater, so they are mixed with random ones, not used alone.

Foreign negatives (`sample_foreign_negatives`) stand for the titles of other shops and domains (books,
food, clothes) that a general retriever returns and a one-shop catalogue never shows: words of the
tokenizer's vocabulary that no catalogue title uses, put in place of a catalogue title's words. Catalogue
negatives alone taught "a home-improvement title without the head term is level 1" and left titles from
elsewhere at level 2-3 (docs/research.md, v3a).
"""

from __future__ import annotations

import functools
import random
import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

from model.data import Dataset, Example


def _norm(text: str) -> str:
    return " ".join(text.lower().split())


def judged_titles(ds: Dataset) -> dict[str, set[str]]:
    """Normalised query -> normalised titles judged for it."""
    seen: dict[str, set[str]] = defaultdict(set)
    for e in ds.examples:
        seen[_norm(e.query)].add(_norm(e.title))
    return seen


def sample_negatives(ds: Dataset, ratio: float, seed: int, label: int = 0) -> list[Example]:
    """`round(ratio * len(ds))` negatives. Each picks a judged pair at random (so queries appear as often
    as they are judged) and pairs its query with a random catalogue title not judged for that query.
    The catalogue is the distinct titles of `ds`. Deterministic for a seed."""
    if ratio < 0:
        raise ValueError(f"negatives ratio must be >= 0, got {ratio}")
    n = round(ratio * len(ds))
    if n == 0:
        return []
    rng = random.Random(seed)
    judged = judged_titles(ds)
    catalogue = sorted({e.title for e in ds.examples})
    if len(catalogue) < 2:
        raise ValueError("negatives need a catalogue of at least two distinct titles")
    out = []
    for _ in range(n):
        anchor = ds.examples[rng.randrange(len(ds))]
        own = judged[_norm(anchor.query)]
        if len(own) >= len(catalogue):
            continue  # this query was judged against every title: nothing to sample
        while True:
            title = catalogue[rng.randrange(len(catalogue))]
            if _norm(title) not in own:
                break
        out.append(Example(anchor.query, title, label, relevance=1.0 if anchor.relevance is not None else None))
    return out


_WORD = re.compile(r"[a-z]+")
_STOP = frozenset("and for with the of to on by not".split())


# Units and sizes: sharing one of them does not make a title close to a query.
GENERIC_WORDS = frozenset("inch foot feet gal gallon volt watt amp pack piece set count lb".split())


def _stem(word: str) -> str:
    """Crude plural folding, enough to tell "screws" and "screw" apart from "drill"."""
    for end in ("ies", "es", "s"):
        if len(word) > len(end) + 2 and word.endswith(end):
            return word[: -len(end)] + ("y" if end == "ies" else "")
    return word


def content_words(text: str) -> set[str]:
    """Stemmed alphabetic words of three letters or more, stop words left out."""
    return {_stem(w) for w in _WORD.findall(text.lower()) if len(w) >= 3 and w not in _STOP}


def head_term(query: str) -> str | None:
    """The query's head term: its last content word before a "with"/"for" clause ("cordless drill" ->
    "drill", "junction box with clamps" -> "box"); None if it has none."""
    main = re.split(r"\b(?:with|for|w/)\b", query.lower())[0]
    words = [_stem(w) for w in _WORD.findall(main) if len(w) >= 3 and w not in _STOP]
    return words[-1] if words else None


def _mentions(words: set[str], head: str) -> bool:
    """Whether a title's words name the head term, typos of it included: for a head of five letters or
    more, any word sharing its first four ("sponce" and "sponge"); for a shorter one, the word itself."""
    if len(head) < 5:
        return head in words
    return any(w.startswith(head[:4]) for w in words)


def hard_candidates(ds: Dataset) -> dict[str, list[str]]:
    """Normalised query -> catalogue titles (sorted) that share a content word with the query other
    than its head term and lack the head term; never a title judged for the query. Queries with no such
    title are absent."""
    judged = judged_titles(ds)
    catalogue = sorted({e.title for e in ds.examples})
    words = {t: content_words(t) for t in catalogue}
    by_word: dict[str, set[str]] = defaultdict(set)  # content word -> titles containing it
    for t, ws in words.items():
        for w in ws:
            by_word[w].add(t)
    out: dict[str, list[str]] = {}
    for q in judged:
        head = head_term(q)
        if head is None:
            continue
        pool: set[str] = set()
        for w in content_words(q) - {head} - GENERIC_WORDS:
            pool |= by_word.get(w, set())
        cands = sorted(t for t in pool if not _mentions(words[t], head) and _norm(t) not in judged[q])
        if cands:
            out[q] = cands
    return out


def sample_hard_negatives(ds: Dataset, ratio: float, seed: int, label: int = 0) -> list[Example]:
    """`round(ratio * len(ds))` hard negatives (module docstring): anchors drawn as in `sample_negatives`
    among the judged pairs whose query has hard candidates, each paired with one at random. Deterministic
    for a seed."""
    if ratio < 0:
        raise ValueError(f"negatives ratio must be >= 0, got {ratio}")
    n = round(ratio * len(ds))
    if n == 0:
        return []
    cands = hard_candidates(ds)
    anchors = [e for e in ds.examples if _norm(e.query) in cands]
    if not anchors:
        raise ValueError("no query has a hard negative: no two queries share a word")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = anchors[rng.randrange(len(anchors))]
        pool = cands[_norm(a.query)]
        title = pool[rng.randrange(len(pool))]
        out.append(Example(a.query, title, label, relevance=1.0 if a.relevance is not None else None))
    return out


def vocabulary_words(vocab: Iterable[str]) -> list[str]:
    """The whole alphabetic words of a WordPiece vocabulary (no "##" pieces, no [special] entries), sorted."""
    return sorted({t for t in vocab if len(t) >= 3 and t.isalpha() and t.isascii()})


def sample_foreign_negatives(
    ds: Dataset, ratio: float, seed: int, words: Sequence[str], label: int = 0, keep: float = 0.2
) -> list[Example]:
    """`round(ratio * len(ds))` foreign negatives (module docstring): a judged pair's query with a random
    catalogue title whose words of three letters or more are swapped for `words` the catalogue never
    uses; numbers, sizes, units and punctuation stay, so the title keeps a title's shape ("Organic
    bananas, 1 lb"), and each word stays with probability `keep` unless the query has it (at least one
    is swapped where there is one). Deterministic for a seed."""
    if ratio < 0:
        raise ValueError(f"negatives ratio must be >= 0, got {ratio}")
    n = round(ratio * len(ds))
    if n == 0:
        return []
    titles = sorted({e.title for e in ds.examples})
    own = {w for t in titles for w in _WORD.findall(t.lower())}
    foreign = sorted(set(words) - own)
    if not foreign or not titles:
        raise ValueError("foreign negatives need a catalogue and vocabulary words outside it")
    rng = random.Random(seed)

    out = []
    for _ in range(n):
        anchor = ds.examples[rng.randrange(len(ds))]
        banned = set(_WORD.findall(anchor.query.lower())) | content_words(anchor.query)

        template = titles[rng.randrange(len(titles))]
        swap = functools.partial(_swap, rng=rng, banned=banned, foreign=foreign)
        title = _TITLE_WORD.sub(functools.partial(swap, keep=keep), template)
        if title == template:  # every word kept (or none to swap): swap them all
            title = _TITLE_WORD.sub(functools.partial(swap, keep=0.0), template)
        out.append(Example(anchor.query, title, label, relevance=1.0 if anchor.relevance is not None else None))
    return out


_TITLE_WORD = re.compile(r"[A-Za-z]{3,}")


def _swap(m: re.Match, rng: random.Random, keep: float, banned: set[str], foreign: list[str]) -> str:
    """One title word: kept if a unit, or with probability `keep` if not the query's; else a foreign word."""
    w = m.group(0).lower()
    if w in GENERIC_WORDS or (rng.random() < keep and w not in banned and _stem(w) not in banned):
        return m.group(0)
    return foreign[rng.randrange(len(foreign))]


def with_negatives(
    ds: Dataset,
    ratio: float,
    seed: int,
    hard: float = 0.0,
    foreign: float = 0.0,
    words: Sequence[str] = (),
    label: int = 0,
) -> Dataset:
    """`ds` followed by its sampled negatives of class `label` (the lowest level, or the head's "not a
    candidate" class); the share `hard` of them hard ones, the share `foreign` foreign ones made of `words`."""
    if not 0 <= hard <= 1 or not 0 <= foreign <= 1 or hard + foreign > 1:
        raise ValueError(f"the hard and foreign shares must be in [0, 1] and sum to at most 1, got {hard}, {foreign}")
    n_hard = round(ratio * hard * len(ds))
    n_foreign = round(ratio * foreign * len(ds))
    n_random = round(ratio * len(ds)) - n_hard - n_foreign
    negs = sample_negatives(ds, n_random / len(ds), seed, label) if ds.examples else []
    if n_hard:
        negs += sample_hard_negatives(ds, n_hard / len(ds), seed + 1, label)
    if n_foreign:
        negs += sample_foreign_negatives(ds, n_foreign / len(ds), seed + 2, words, label)
    return Dataset(ds.examples + negs, path=ds.path)
