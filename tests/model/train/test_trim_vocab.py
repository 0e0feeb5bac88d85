"""The vocabulary trimmer on builtin:zh's real Unigram tokenizer: `--scripts latin` keeps no CJK row, and the
exact corpus tokenises id for id as before (through the map) whichever scripts are kept."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from model.builtin import builtin_dir
from model.train.trim_vocab import META, SCRIPTS, choose_pieces, trimmed_tokenizer

TEXTS = ["cordless drill 18v", "Husqvarna 20 in. gas chainsaw", "deck screws 2-1/2 in.", "苹果手机价格"]


def _spec() -> dict:
    return json.loads((builtin_dir("zh") / "tokenizer.json").read_text(encoding="utf-8"))


def _cjk(piece: str) -> bool:
    return any(0x3000 <= ord(c) <= 0x9FFF for c in piece.replace(META, ""))


def test_latin_scripts_keep_no_cjk_character_beyond_the_exact_texts():
    spec = _spec()
    vocab = spec["model"]["vocab"]
    keep = choose_pieces(spec, TEXTS[:3], [], max_rows=3000, blocks=SCRIPTS["latin"])
    assert len(keep) == 3000
    assert not [vocab[i][0] for i in keep if _cjk(vocab[i][0])]
    both = choose_pieces(spec, TEXTS[:3], [], max_rows=12000, blocks=SCRIPTS["latin+cjk"])
    assert sum(_cjk(vocab[i][0]) for i in both) > 1000


def test_exact_texts_tokenise_as_before_after_trimming():
    spec = _spec()
    keep = choose_pieces(spec, TEXTS, [], max_rows=3000, blocks=SCRIPTS["latin"])
    full = Tokenizer.from_str(json.dumps(spec))
    small = Tokenizer.from_str(json.dumps(trimmed_tokenizer(spec, keep)))
    for text in TEXTS:
        before, after = full.encode(text, add_special_tokens=False), small.encode(text, add_special_tokens=False)
        assert [keep[i] for i in after.ids] == before.ids, text
        assert after.tokens == before.tokens
