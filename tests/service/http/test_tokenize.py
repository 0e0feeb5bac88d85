"""/tokenize on the live server: the pair's tokens, segment ids and what truncation cut, with no forward pass."""

from __future__ import annotations

import httpx
import pytest

from model.tokenizer import PairTokenizer

QUERY = "cordless drill"
TITLE = "DEWALT 20V MAX Cordless Drill"
LONG_TITLE = " ".join(f"word{i} drill" for i in range(120))  # far over 128 tokens


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return PairTokenizer.from_dir(tiny_checkpoint)


def post(server, body):
    r = httpx.post(server.url + "/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_pair_as_the_model_sees_it(server, tok):
    body = post(server, {"query": QUERY, "title": TITLE})
    assert body["model"] == "tiny-bert" and body["max_length"] == tok.max_length
    (res,) = body["results"]
    enc = tok.encode([QUERY], [TITLE])
    assert res["input_ids"] == enc.input_ids[0] and res["token_type_ids"] == enc.token_type_ids[0]
    assert res["length"] == len(enc.input_ids[0]) and res["truncated"] is False and res["cut_from"] is None
    texts = [t["text"] for t in res["tokens"]]
    assert texts == tok.tokens(enc.input_ids[0])
    assert texts[0] == "[CLS]" and texts[-1] == "[SEP]" and texts.count("[SEP]") == 2
    assert [t["text"] for t in res["tokens"] if t["special"]] == ["[CLS]", "[SEP]", "[SEP]"]
    nq = len(tok.encode_texts([QUERY])[0])
    assert res["query"] == {"tokens": nq, "kept": nq, "dropped": []}
    assert res["title"]["dropped"] == [] and res["title"]["kept"] == res["title"]["tokens"]
    assert [t["segment"] for t in res["tokens"]] == [0] * (nq + 2) + [1] * (res["length"] - nq - 2)


def test_a_long_title_is_cut_at_its_end_and_the_dropped_pieces_are_named(server, tok):
    (res,) = post(server, {"query": QUERY, "title": LONG_TITLE})["results"]
    full = tok.tokens(tok.encode_texts([LONG_TITLE])[0])
    assert res["truncated"] is True and res["cut_from"] == "end" and res["length"] == tok.max_length
    t = res["title"]
    assert t["tokens"] == len(full) and t["kept"] + len(t["dropped"]) == len(full)
    assert t["dropped"] == full[t["kept"] :]
    assert res["query"]["dropped"] == []  # only_second: the query stays whole
    kept_title = [x["text"] for x in res["tokens"] if x["segment"] == 1][:-1]  # without the last [SEP]
    assert kept_title == full[: t["kept"]]


def test_truncation_options_are_the_requests(server, tok):
    long_query = " ".join(f"q{i}" for i in range(100))
    left = post(server, {"query": QUERY, "title": LONG_TITLE, "truncation_direction": "Left"})["results"][0]
    full = tok.tokens(tok.encode_texts([LONG_TITLE])[0])
    assert left["cut_from"] == "start" and left["title"]["dropped"] == full[: len(full) - left["title"]["kept"]]
    both = post(server, {"pairs": [{"query": long_query, "title": LONG_TITLE}], "truncation": "longest_first"})
    res = both["results"][0]
    enc = tok.encode([long_query], [LONG_TITLE], truncation="longest_first")
    assert res["input_ids"] == enc.input_ids[0]
    assert res["query"]["dropped"] and res["title"]["dropped"]  # both sides gave up tokens


def test_a_list_of_pairs_and_no_forward_pass(server, tok):
    before = server.metric("qtrel_pairs_total")
    pairs = [{"query": QUERY, "title": TITLE}, {"query": "garden hose", "title": LONG_TITLE}] * 3  # > 4: off-loop
    body = post(server, {"pairs": pairs})
    assert [r["index"] for r in body["results"]] == list(range(6))
    assert [r["truncated"] for r in body["results"]] == [False, True] * 3
    assert server.metric("qtrel_pairs_total") == before


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"query": QUERY}, "title 0 is missing"),
        ({"query": QUERY, "title": " "}, "title 0 is missing, empty or whitespace"),
        ({"query": QUERY, "title": TITLE, "pairs": [{"query": QUERY, "title": TITLE}]}, "either"),
        ({"pairs": []}, "pairs"),
        ({"query": QUERY, "title": TITLE, "truncation": "cut"}, "truncation"),
        ({"query": QUERY, "title": TITLE, "unknown": 1}, "unknown"),
        ({"query": QUERY, "title": 5}, "title"),
    ],
)
def test_invalid_requests_get_the_one_error_shape(server, body, fragment):
    r = httpx.post(server.url + "/tokenize", json=body)
    assert r.status_code == 422, r.text
    err = r.json()
    assert set(err) == {"error", "error_type"} and err["error_type"] == "validation" and fragment in err["error"]
