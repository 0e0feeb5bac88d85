"""A served XLM-R and a served ModernBERT checkpoint (small, random, saved by transformers with a tokenizer.json
of their kind) answer /score, TEI /rerank and Cohere /v2/rerank with the order and scores transformers gives,
through the real app; a 3-level head grades levels 0..2 end to end."""

from __future__ import annotations

import math

import httpx
import pytest
import torch
from tokenizers import Tokenizer, processors
from tokenizers.models import Unigram, WordPiece
from tokenizers.pre_tokenizers import Metaspace, WhitespaceSplit

from tests.model.arch_fixtures import VOCAB, build_reference
from tests.service.conftest import live_server

transformers = pytest.importorskip("transformers")

WORDS = [f"w{i}" for i in range(VOCAB - 8)]
QUERY = "w1 w7 w30 w2"
TITLES = [" ".join(WORDS[(7 * i + j * 13) % len(WORDS)] for j in range(3 + i % 9)) for i in range(12)]


def xlmr_tokenizer() -> Tokenizer:
    """XLM-R's shape: SentencePiece Unigram pieces, <s> q </s></s> t </s>."""
    pieces = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)] + [(f"▁{w}", -1.0) for w in WORDS]
    tok = Tokenizer(Unigram(pieces, unk_id=3))
    tok.pre_tokenizer = Metaspace()
    tok.post_processor = processors.RobertaProcessing(("</s>", 2), ("<s>", 0))
    return tok


def modernbert_tokenizer() -> Tokenizer:
    """[CLS] q [SEP] t [SEP] from a TemplateProcessing, one segment (ModernBERT's)."""
    vocab = {t: i for i, t in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS])}
    tok = Tokenizer(WordPiece(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    return tok


def reference_logits(model, tok: Tokenizer) -> torch.Tensor:
    """transformers' logits of (QUERY, title) for every title, tokenised by transformers from the same file."""
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>" if "<pad>" in tok.get_vocab() else "[PAD]"
    )
    enc = fast([QUERY] * len(TITLES), TITLES, padding=True, return_tensors="pt", return_token_type_ids=False)
    with torch.inference_mode():
        return model(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"]).logits


@pytest.fixture(scope="module", params=["xlm-roberta", "modernbert"])
def served_reference(request, tmp_path_factory):
    name = request.param
    path = tmp_path_factory.mktemp("served") / name
    model = build_reference(name, path, 1, seed=3)
    tok = xlmr_tokenizer() if name == "xlm-roberta" else modernbert_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    return name, path, reference_logits(model, tok)[:, 0]


def test_routes_give_transformers_order_and_scores(served_reference):
    name, path, z = served_reference
    want = torch.sigmoid(z)
    order = sorted(range(len(TITLES)), key=lambda i: -float(want[i]))
    with live_server(path, max_wait_ms=5) as srv:
        info = httpx.get(srv.url + "/info").json()
        assert info["levels"] == ["0", "1"]
        assert info["model"]["architecture"] == name and info["model"]["head"] == "logit"
        assert info["model"]["path"].startswith("fast")
        body = {"query": QUERY, "titles": TITLES}
        got = httpx.post(srv.url + "/score", json=body, timeout=30).json()["results"]
        for r, w, zz in zip(got, want.tolist(), z.tolist()):
            assert r["score"] == pytest.approx(w, abs=1e-5)
            assert r["level"] == ("1" if zz > 0 else "0")
        raw = httpx.post(srv.url + "/score", json={**body, "raw_scores": True}, timeout=30).json()["results"]
        assert [r["score"] for r in raw] == pytest.approx(z.tolist(), abs=1e-4)
        tei = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": TITLES}, timeout=30).json()
        assert [r["index"] for r in tei] == order
        assert [r["score"] for r in tei] == pytest.approx([float(want[i]) for i in order], abs=1e-5)
        tei_raw = httpx.post(srv.url + "/rerank", json={"query": QUERY, "texts": TITLES, "raw_scores": True}).json()
        assert [r["score"] for r in tei_raw] == pytest.approx([float(z[i]) for i in order], abs=1e-4)
        co = httpx.post(srv.url + "/v2/rerank", json={"model": "m", "query": QUERY, "documents": TITLES}).json()
        assert [r["index"] for r in co["results"]] == order
        assert [r["relevance_score"] for r in co["results"]] == pytest.approx([float(want[i]) for i in order], abs=1e-5)


def test_a_three_level_head_grades_its_levels(tmp_path):
    path = tmp_path / "xlmr-3"
    model = build_reference("xlm-roberta", path, 3, seed=4)
    model.config.id2label = {0: "0", 1: "1", 2: "2"}  # QBQTC's labels
    model.config.label2id = {"0": 0, "1": 1, "2": 2}
    model.save_pretrained(path)
    tok = xlmr_tokenizer()
    tok.save(str(path / "tokenizer.json"))
    probs = reference_logits(model, tok).softmax(-1)
    expected = probs @ torch.tensor([0.0, 1.0, 2.0])
    with live_server(path, max_wait_ms=5) as srv:
        assert httpx.get(srv.url + "/info").json()["levels"] == ["0", "1", "2"]
        got = httpx.post(srv.url + "/score", json={"query": QUERY, "titles": TITLES}, timeout=30).json()["results"]
        assert [r["score"] for r in got] == pytest.approx(expected.tolist(), abs=1e-5)
        assert [r["level"] for r in got] == [str(int(i)) for i in probs.argmax(-1)]
        co = httpx.post(srv.url + "/v2/rerank", json={"model": "m", "query": QUERY, "documents": TITLES}).json()
        best = co["results"][0]
        assert best["relevance_score"] == pytest.approx(float(expected.max()) / 2, abs=1e-5)
        assert all(0 <= r["relevance_score"] <= 1 for r in co["results"]) and not math.isnan(best["relevance_score"])
