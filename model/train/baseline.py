"""A lexical baseline for graded relevance: hand-made matching features and gradient-boosted trees.

It plays the part of the older matching model that a BERT cross-encoder is reported beside: BM25 of the
title for the query (document statistics fitted on the training titles), term overlap (exact, stemmed,
prefix, inside the title's compacted text), character 3-gram Jaccard, numeric-token agreement and lengths.
A multi-class `HistGradientBoostingClassifier` maps them to probabilities over the levels, and it is
scored with exactly the metrics of the model (`model.train.metrics.all_metrics`).

The trees are not persisted (that would mean pickling scikit-learn objects). `save` writes a JSON
recipe — settings, training file and its SHA-256 — and `load` refits from it, which takes seconds and
gives the same probabilities, since the fit is seeded.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from model.data import Dataset, read_labelled
from model.train.metrics import all_metrics

FORMAT = "qtrel-lexical-baseline/1"

# Numbers keep their fraction or decimal part ("1/2", "1.9"); letters and digits split ("125v" -> 125, v).
_TOKEN = re.compile(r"\d+(?:[./]\d+)*|[^\W\d_]+")
_NON_ALNUM = re.compile(r"[\W_]+")

FEATURES = (
    "q_terms",  # query length in terms
    "t_terms",  # title length in terms
    "q_chars",  # query length in characters
    "exact_overlap",  # fraction of distinct query terms that are title terms
    "stem_overlap",  # the same after light suffix stripping
    "prefix_overlap",  # ... or where one term is a prefix (>= 3 characters) of the other
    "compact_overlap",  # ... or found inside the title with spaces and punctuation removed ("deck over")
    "idf_overlap",  # stem overlap weighted by idf
    "bm25",  # BM25 of the title for the query, on stems
    "bm25_norm",  # bm25 / sum of the query stems' idf: comparable across queries
    "char3_jaccard",  # Jaccard of character 3-gram sets
    "char3_containment",  # fraction of the query's 3-grams found in the title
    "q_numbers",  # numeric tokens in the query
    "number_match",  # fraction of them in the title (NaN when the query has none)
    "number_miss",  # query numbers not in the title
    "first_term_match",  # the first query stem is in the title
    "last_term_match",  # the last query stem (often the head noun) is in the title
    "bigram_overlap",  # fraction of query stem bigrams that are title stem bigrams (NaN for one term)
    "first_match_pos",  # position of the first matching title stem / title length (NaN when none)
    "brand_match",  # the title's first term (usually the brand) is in the query
    "q_unseen",  # fraction of query stems that no training title contains
    "q_mean_idf",  # specificity of the query
    "q_min_idf",
)


class BaselineError(ValueError):
    """A baseline that cannot be fitted, saved or restored; the message says why."""


@dataclass(frozen=True)
class BaselineSettings:
    max_iter: int = 400  # boosting rounds at most; early stopping usually ends sooner
    learning_rate: float = 0.05
    max_leaf_nodes: int = 31
    min_samples_leaf: int = 40  # guards against fitting rare feature combinations on small files
    l2_regularization: float = 1.0
    validation_fraction: float = 0.1  # held out of the training file for early stopping (never the dev file)
    seed: int = 0  # fixes the early-stopping split, hence the whole fit
    k1: float = 1.2  # BM25 term-frequency saturation
    b: float = 0.75  # BM25 length normalisation


def tokens(text: str) -> list[str]:
    return _TOKEN.findall(text.lower())


def stem(term: str) -> str:
    """Light English suffix stripping: plurals, -ing, -ed. Numbers are left alone."""
    if term[0].isdigit() or len(term) <= 3:
        return term
    for suffix, repl in (("ies", "y"), ("sses", "ss"), ("shes", "sh"), ("ches", "ch"), ("xes", "x")):
        if term.endswith(suffix):
            return term[: -len(suffix)] + repl
    if term.endswith("s") and not term.endswith(("ss", "us", "is")):
        return term[:-1]
    for suffix in ("ing", "ed"):
        if term.endswith(suffix) and len(term) - len(suffix) >= 3:
            return term[: -len(suffix)]
    return term


def char_ngrams(text: str, n: int = 3) -> set[str]:
    s = " " + " ".join(_NON_ALNUM.sub(" ", text.lower()).split()) + " "
    return {s[i : i + n] for i in range(len(s) - n + 1)}


def _prefix_match(term: str, title_terms: set[str]) -> bool:
    if term in title_terms:
        return True
    if len(term) < 3:
        return False
    return any(len(t) >= 3 and (t.startswith(term) or term.startswith(t)) for t in title_terms)


class TitleStats:
    """Document frequencies and mean length of the training titles (each distinct title counted once)."""

    def __init__(self, titles: Sequence[str]):
        docs = [[stem(t) for t in tokens(title)] for title in set(titles)]
        self.n_docs = len(docs)
        self.avg_len = sum(map(len, docs)) / max(1, self.n_docs)
        self.df: Counter[str] = Counter()
        for d in docs:
            self.df.update(set(d))

    def idf(self, term: str) -> float:
        df = self.df.get(term, 0)
        return math.log(1.0 + (self.n_docs - df + 0.5) / (df + 0.5))


def pair_features(query: str, title: str, stats: TitleStats, k1: float = 1.2, b: float = 0.75) -> dict[str, float]:
    """Every feature of FEATURES for one pair, by name."""
    nan = float("nan")
    q, t = tokens(query), tokens(title)
    qs, ts = [stem(x) for x in q], [stem(x) for x in t]
    q_set, t_set, qs_set, ts_set = set(q), set(t), set(qs), set(ts)
    compact = _NON_ALNUM.sub("", title.lower())
    nq = max(1, len(q_set))
    idf = {s: stats.idf(s) for s in qs_set}
    # fsum: exactly rounded whatever the (hash-seeded) set order, so features and fits are reproducible.
    idf_total = math.fsum(idf.values())

    tf = Counter(ts)
    norm = k1 * (1 - b + b * len(ts) / stats.avg_len) if stats.avg_len else k1
    bm25 = math.fsum(idf[s] * tf[s] * (k1 + 1) / (tf[s] + norm) for s in qs_set if s in tf)

    grams_q, grams_t = char_ngrams(query), char_ngrams(title)
    union = grams_q | grams_t
    numbers = [x for x in q_set if x[0].isdigit()]
    hits = sum(x in t_set for x in numbers)
    q_bigrams = set(zip(qs, qs[1:]))
    t_bigrams = set(zip(ts, ts[1:]))
    first_pos = next((i for i, s in enumerate(ts) if s in qs_set), None)
    return {
        "q_terms": len(q),
        "t_terms": len(t),
        "q_chars": len(query),
        "exact_overlap": len(q_set & t_set) / nq,
        "stem_overlap": len(qs_set & ts_set) / max(1, len(qs_set)),
        "prefix_overlap": sum(_prefix_match(x, t_set) for x in q_set) / nq,
        "compact_overlap": sum(x in t_set or (len(x) >= 2 and x in compact) for x in q_set) / nq,
        "idf_overlap": math.fsum(idf[s] for s in qs_set & ts_set) / idf_total if idf_total else 0.0,
        "bm25": bm25,
        "bm25_norm": bm25 / idf_total if idf_total else 0.0,
        "char3_jaccard": len(grams_q & grams_t) / len(union) if union else 0.0,
        "char3_containment": len(grams_q & grams_t) / len(grams_q) if grams_q else 0.0,
        "q_numbers": len(numbers),
        "number_match": hits / len(numbers) if numbers else nan,
        "number_miss": len(numbers) - hits,
        "first_term_match": float(bool(qs) and qs[0] in ts_set),
        "last_term_match": float(bool(qs) and qs[-1] in ts_set),
        "bigram_overlap": len(q_bigrams & t_bigrams) / len(q_bigrams) if q_bigrams else nan,
        "first_match_pos": first_pos / len(ts) if first_pos is not None else nan,
        "brand_match": float(bool(t) and t[0] in q_set),
        "q_unseen": sum(stats.df.get(s, 0) == 0 for s in qs_set) / max(1, len(qs_set)),
        "q_mean_idf": idf_total / len(idf) if idf else 0.0,
        "q_min_idf": min(idf.values()) if idf else 0.0,
    }


def file_sha256(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass(frozen=True)
class TrainSource:
    """How the training file was read, so that a saved baseline can be refitted exactly."""

    path: str
    sha256: str
    labels: list[str]
    label_column: str = "level"
    label_map: dict[str, str] | None = None


class LexicalBaseline:
    """Lexical features -> gradient-boosted trees -> probabilities over `labels` (in class order)."""

    def __init__(self, labels: Sequence[str], settings: BaselineSettings | None = None, threads: int = 1):
        if len(labels) < 2:
            raise BaselineError(f"need at least two levels, got {list(labels)}")
        self.labels = [str(x) for x in labels]
        self.settings = settings or BaselineSettings()
        # OpenMP threads for the trees. One is fast at this size; on a busy machine more threads can be
        # many times slower (they spin waiting for each other). The result does not depend on it.
        self.threads = threads
        self.stats: TitleStats | None = None
        self.source: TrainSource | None = None
        self._clf: Any = None  # a fitted sklearn HistGradientBoostingClassifier (untyped), or None

    @property
    def k(self) -> int:
        return len(self.labels)

    def features(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """(n, len(FEATURES)) float64; NaN where a feature is undefined (the trees route it)."""
        if self.stats is None:
            raise BaselineError("the baseline is not fitted")
        s = self.settings
        rows = [pair_features(q, t, self.stats, s.k1, s.b) for q, t in pairs]
        return np.array([[r[name] for name in FEATURES] for r in rows], dtype=np.float64).reshape(-1, len(FEATURES))

    def fit(self, train: Dataset) -> LexicalBaseline:
        from sklearn.ensemble import HistGradientBoostingClassifier
        from threadpoolctl import threadpool_limits

        y = np.array(train.labels)
        if len(set(y.tolist())) < 2:
            raise BaselineError(f"{train.path or 'training data'}: every row has the same level")
        if y.max() >= self.k:
            raise BaselineError(f"training labels reach class {int(y.max())} but only {self.k} levels are set")
        self.stats = TitleStats([e.title for e in train.examples])
        s = self.settings
        self._clf = HistGradientBoostingClassifier(
            max_iter=s.max_iter,
            learning_rate=s.learning_rate,
            max_leaf_nodes=s.max_leaf_nodes,
            min_samples_leaf=s.min_samples_leaf,
            l2_regularization=s.l2_regularization,
            early_stopping=len(y) >= 1000,
            validation_fraction=s.validation_fraction,
            n_iter_no_change=20,
            random_state=s.seed,
        )
        X = self.features(train.pairs)
        # A feature that is undefined on every training row (no query has a number, say) makes the
        # binning fail; as a constant it is simply never split on, whatever it is at prediction time.
        X[:, np.isnan(X).all(axis=0)] = 0.0
        with threadpool_limits(self.threads):
            self._clf.fit(X, y)
        return self

    def fit_file(
        self, path: str | Path, label_column: str = "level", label_map: dict[str, str] | None = None
    ) -> LexicalBaseline:
        """Read a labelled file and fit on it, remembering the file so that `save` can record it."""
        ds = read_labelled(path, self.labels, label_column, label_map)
        self.fit(ds)
        self.source = TrainSource(str(Path(path).resolve()), file_sha256(path), self.labels, label_column, label_map)
        return self

    def predict_proba(self, pairs: Sequence[tuple[str, str]]) -> np.ndarray:
        """(n, k) probabilities in the order of `labels`; a level absent from training gets 0."""
        if self._clf is None:
            raise BaselineError("the baseline is not fitted")
        from threadpoolctl import threadpool_limits

        out = np.zeros((len(pairs), self.k))
        if len(pairs):
            with threadpool_limits(self.threads):
                out[:, self._clf.classes_] = self._clf.predict_proba(self.features(pairs))
        return out

    @property
    def rounds(self) -> int:
        """Boosting rounds kept after early stopping."""
        return int(self._clf.n_iter_) if self._clf is not None else 0

    def save(self, path: str | Path) -> None:
        """Write the JSON recipe (settings and training file); the trees are refitted by `load`."""
        if self.source is None:
            raise BaselineError("only a baseline fitted with fit_file can be saved (its file is the model)")
        recipe = {"format": FORMAT, "settings": asdict(self.settings), "train": asdict(self.source)}
        Path(path).write_text(json.dumps(recipe, indent=2) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path, threads: int = 1) -> LexicalBaseline:
        try:
            recipe = json.loads(Path(path).read_text(encoding="utf-8"))
            if recipe.get("format") != FORMAT:
                raise BaselineError(f"{path}: not a {FORMAT} file")
            settings = BaselineSettings(**recipe["settings"])
            src = TrainSource(**recipe["train"])
        except (OSError, json.JSONDecodeError, TypeError, KeyError, AttributeError) as e:
            raise BaselineError(f"{path}: cannot read the baseline recipe: {e}") from e
        if not Path(src.path).is_file():
            raise BaselineError(f"{path}: training file {src.path} is gone")
        if file_sha256(src.path) != src.sha256:
            raise BaselineError(f"{path}: training file {src.path} has changed since the baseline was saved")
        return cls(src.labels, settings, threads).fit_file(src.path, src.label_column, src.label_map)


def evaluate_baseline(baseline: LexicalBaseline, ds: Dataset) -> dict:
    """The metrics of `model.train.evaluate.evaluate`: level = argmax, score = expected level sum_k k * p(k)."""
    probs = baseline.predict_proba(ds.pairs)
    return all_metrics(
        queries=[e.query for e in ds.examples],
        y_true=ds.labels,
        y_pred=probs.argmax(1).tolist(),
        scores=(probs @ np.arange(1, baseline.k + 1)).tolist(),
        k=baseline.k,
        relevance=[e.relevance for e in ds.examples],
    )
